"""One repository, many sessions: each session works in a repository of its
own (borrowing the shared one's objects) on its own branch, knows which other sessions are live on the repository,
and gets its own values in a home seeded from a template. Real supervisor,
real workers, real git in temporary directories."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hermes_sup.client import Output, SupervisorError
from hermes_sup.protocol import Kind
from hermes_sup.supervisor.homes import placeholder_values, safe_value
from hermes_sup.supervisor.peers import peers_text
from hermes_sup.supervisor.worktrees import branch_for, repository_problem

from .clirunner import hermes_sup
from .test_spares import spare_pids
from .waiting import wait_for

GIT_ENV = {
    **os.environ,
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@example.com",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@example.com",
    # The operator looking into sessions' worktrees, which sealed sessions
    # own (uids of their own).
    "GIT_CONFIG_COUNT": "1",
    "GIT_CONFIG_KEY_0": "safe.directory",
    "GIT_CONFIG_VALUE_0": "*",
}
# What a session runs to commit: its worker has no git identity of its own.
COMMIT = "git -c user.name=s -c user.email=s@example.com commit -q -m"


def git(repo: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, env=GIT_ENV, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def make_repo(path: Path) -> Path:
    """A repository as an operator has one: nothing done to it for sessions
    (they read it, and never write it)."""
    path.mkdir(parents=True)
    git(path, "init", "-q", "-b", "main")
    (path / "README").write_text("shared\n")
    git(path, "add", "README")
    git(path, "commit", "-q", "-m", "first")
    return path


def heads(repo: Path) -> dict[str, str]:
    """The repository's branches: name -> commit."""
    found = git(repo, "for-each-ref", "--format=%(refname:short) %(objectname)", "refs/heads")
    return dict(line.split() for line in found.splitlines())


def subjects(repo: Path, rev: str) -> list[str]:
    return git(repo, "log", "--format=%s", rev).split("\n")[:-1]


def output(reply) -> list[str]:  # noqa: ANN001
    # One output event may hold several lines (streams are coalesced).
    text = "\n".join(e.line for e in reply.events if isinstance(e, Output))
    return text.split("\n") if text else []


def cli(sup, *args: str) -> subprocess.CompletedProcess[str]:  # noqa: ANN001
    return subprocess.run(
        [sys.executable, "-m", "hermes_sup.cli", "--state-dir", str(sup.state_dir), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


# ------------------------------------------------------------------ units


def test_branch_names_are_safe_for_git_and_apart_for_every_key() -> None:
    keys = ["telegram:42", "a..b", "x.lock", "@{u}", "...", "-flag", "user@host:1/..", "a" * 128]
    names = [branch_for(k) for k in keys]
    assert len(set(names)) == len(names)
    assert branch_for("telegram:42") != branch_for("telegram-42")  # alike once made safe
    for name in names:
        assert name.startswith("hermes-sup/")
        ok = subprocess.run(["git", "check-ref-format", f"refs/heads/{name}"], timeout=30)
        assert ok.returncode == 0, name
        assert len(name) < 80


def test_a_missing_or_plain_directory_is_no_repository(tmp_path: Path) -> None:
    assert repository_problem(str(tmp_path / "nope")) == f"{tmp_path / 'nope'} does not exist"
    (tmp_path / "plain").mkdir()
    assert "is not a git repository" in (repository_problem(str(tmp_path / "plain")) or "")
    assert repository_problem("relative/repo") == "relative/repo is not an absolute path"
    assert repository_problem(str(make_repo(tmp_path / "r"))) is None
    git(tmp_path, "init", "-q", "--bare", "bare.git")
    assert repository_problem(str(tmp_path / "bare.git")) is None


def test_placeholder_values_cannot_break_out_of_the_file_they_land_in() -> None:
    values = placeholder_values(
        "telegram:42", {"PLATFORM": "telegram", "USER_ID": 'u"1\nmodel: evil'}
    )
    assert values == {
        "session": "telegram:42",
        "platform": "telegram",
        "chat_id": "42",
        "user_id": "u%221%0Amodel:%20evil",
    }
    # Values a front end did not give fall back to ones no other session has.
    assert placeholder_values("plainkey", {})["user_id"] == "plainkey"
    assert placeholder_values("plainkey", {})["chat_id"] == "plainkey"
    assert safe_value("é") == "%C3%A9"


def test_the_peers_file_names_the_session_and_lists_each_peer_a_line() -> None:
    from hermes_sup.supervisor.peers import Peer

    text = peers_text("a", "/r", "hermes-sup/a-1", [Peer("b", "hermes-sup/b-2", "busy", None)], 0)
    lines = text.splitlines()
    assert "You are session a, on branch hermes-sup/a-1" in text
    assert [line for line in lines if not line.startswith("#")] == ["b\thermes-sup/b-2\tbusy\t-"]
    alone = peers_text("a", "/r", "hermes-sup/a-1", [], 0)
    assert "No other session is live" in alone
    assert all(line.startswith("#") for line in alone.splitlines())


# ------------------------------------------------------------- end to end


def test_two_sessions_on_one_repository_each_work_on_their_own_branch(
    supervisor_factory, tmp_path: Path
) -> None:
    repo = make_repo(tmp_path / "repo")
    sup = supervisor_factory("--repo", str(repo))
    with sup.client() as client:
        assert client.run("alice", "write alice.txt from alice").ok
        assert client.run("bob", "write bob.txt from bob").ok
        # Each sees its own uncommitted file and not the other's (nor the
        # supervisor's .hermes-sup/, which git ignores).
        assert output(client.run("alice", "sh git status --porcelain")) == ["?? alice.txt"]
        assert output(client.run("bob", "sh git status --porcelain")) == ["?? bob.txt"]
        spaces = {k: Path(client.inspect(k)["workspace"]) for k in ("alice", "bob")}
        branches = {k: client.inspect(k)["branch"] for k in ("alice", "bob")}
        assert branches == {"alice": branch_for("alice"), "bob": branch_for("bob")}
        for key in ("alice", "bob"):
            head = output(client.run(key, "sh git rev-parse --abbrev-ref HEAD"))
            assert head == [branches[key]]
            reply = client.run(key, f"sh git add {key}.txt && {COMMIT} 'work of {key}'")
            assert reply.text == "exit 0", output(reply)
        # Each branch has its own commit on top of main, in the session's
        # own repository; the shared one has neither, nor any session's branch.
        for key in ("alice", "bob"):
            assert (spaces[key] / ".git").is_dir()
            assert subjects(spaces[key], branches[key]) == [f"work of {key}", "first"]
        assert subjects(repo, "main") == ["first"]
        assert list(heads(repo)) == ["main"]
        assert not (repo / "alice.txt").exists() and not (repo / "bob.txt").exists()
        # A restart of the worker finds its repository as it left it.
        client.kill("alice")
        assert output(client.run("alice", "sh git log -1 --format=%s")) == ["work of alice"]
        rows = {r["key"]: r for r in client.sessions()}
        assert rows["alice"]["repo"] == rows["bob"]["repo"] == str(repo)

        killed = client.kill("alice", purge=True)
        assert "data purged" in killed.reason and "kept" in killed.reason
    assert not spaces["alice"].exists()
    # Purged, its branch was brought into the shared repository first.
    assert subjects(repo, branches["alice"]) == ["work of alice", "first"]
    assert branches["bob"] not in heads(repo)
    assert git(spaces["bob"], "status", "--porcelain") == ""
    assert (spaces["bob"] / "bob.txt").read_text() == "from bob"
    with sup.client() as client:
        # Back again, the session starts from its kept branch and its commit.
        assert output(client.run("alice", "sh git log -1 --format=%s")) == ["work of alice"]
        assert output(client.run("bob", "sh cat bob.txt")) == ["from bob"]
    gone = cli(sup, "kill", "alice", "--purge", "--delete-branch", "--yes")
    assert gone.returncode == 0, gone.stderr
    assert "deleted" in gone.stdout
    assert list(heads(repo)) == ["main"]
    assert "refs/hermes-sup/bases/" + branches["bob"].removeprefix("hermes-sup/") in git(
        repo, "for-each-ref", "--format=%(refname)"
    )
    assert "worktree_removed" in sup.log()


def test_twenty_sessions_created_at_once_get_twenty_worktrees(
    supervisor_factory, tmp_path: Path
) -> None:
    repo = make_repo(tmp_path / "repo")
    sup = supervisor_factory("--repo", str(repo))
    keys = [f"s{i:02d}" for i in range(20)]
    with sup.client(timeout=120) as client:
        # All twenty asked for before any is answered.
        pending = {client.submit(Kind.OPEN, {}, session=k): k for k in keys}
        deadline = time.monotonic() + 120
        while pending:
            msg = client.next(timeout=max(1.0, deadline - time.monotonic()))
            key = pending.pop(msg.re, None)
            assert msg.kind is Kind.OPENED, (key, msg.body)
            # Each its own worktree (sealed, each seen at the same fixed path):
        # its own branch, and its own file.
        for k in keys:
            assert client.run(k, f"write {k}.txt {k}").ok
        tops = {k: output(client.run(k, "sh git branch --show-current; ls *.txt")) for k in keys}
    assert all(tops[k] == [branch_for(k), f"{k}.txt"] for k in keys), tops
    bases = git(repo, "for-each-ref", "--format=%(refname)", "refs/hermes-sup/bases/")
    assert len(bases.split()) == 20 and list(heads(repo)) == ["main"]
    log = sup.log()
    assert "prepare_failed" not in log and "lock" not in log.lower()
    assert log.count("worktree_added") == 20


def test_peers_lists_the_other_live_sessions_on_the_same_repository_only(
    supervisor_factory, tmp_path: Path
) -> None:
    roots = tmp_path / "src"
    one, two = make_repo(roots / "one"), make_repo(roots / "two")
    sup = supervisor_factory("--repo-root", str(roots))
    with sup.client() as client:
        client.open("a", options={"repo": str(one), "label": "fixing login"})
        client.open("b", options={"repo": str(one)})
        client.open("c", options={"repo": str(two)})
        client.run("plain", "pid")
        reply = client.run("b", "peers")
        assert reply.text == f"a {branch_for('a')} idle"
        assert reply.data == {
            "peers": [
                {
                    "session": "a",
                    "branch": branch_for("a"),
                    "state": "idle",
                    "label": "fixing login",
                }
            ]
        }
        assert client.run("a", "peers").data["peers"] == [
            {"session": "b", "branch": branch_for("b"), "state": "idle", "label": None}
        ]
        assert client.run("c", "peers").text == "no other session is live on this repository"
        assert client.run("plain", "peers").data == {"peers": None}
        # Refreshed at each turn: a stopped peer is no longer listed.
        client.kill("b")
        assert client.run("a", "peers").data == {"peers": []}
        # git does not see the supervisor's file.
        assert output(client.run("a", "sh git status --porcelain --ignored=no")) == []
        assert "You are session a" in output(client.run("a", "sh cat .hermes-sup/peers"))[2]
    listed = cli(sup, "list", "--repo", str(one), "--json")
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert {(r["key"], r["repo"], r["branch"]) for r in rows} == {
        ("a", str(one), branch_for("a")),
        ("b", str(one), branch_for("b")),
    }
    table = cli(sup, "list")
    assert table.returncode == 0, table.stderr
    header, *lines = table.stdout.splitlines()
    assert "BRANCH" in header.split() and "LABEL" in header.split()
    assert any(line.startswith("a ") and branch_for("a") in line for line in lines)


def test_a_repository_option_is_checked_at_open(supervisor_factory, tmp_path: Path) -> None:
    roots = tmp_path / "src"
    (roots / "plain").mkdir(parents=True)
    make_repo(roots / "good")
    outside = make_repo(tmp_path / "outside")
    sup = supervisor_factory("--repo-root", str(roots))
    with sup.client() as client:
        cases = {
            str(roots / "missing"): "does not exist",
            str(roots / "plain"): "is not a git repository",
            str(outside): "is not under a repository root",
            "relative": "must be an absolute path",
        }
        for repo, says in cases.items():
            with pytest.raises(SupervisorError) as err:
                client.open("x", options={"repo": repo})
            assert err.value.code == "bad_field" and says in str(err.value), err.value
        with pytest.raises(SupervisorError) as err:
            client.open("x", options={"repo": str(roots / "good"), "workspace": str(roots)})
        assert "exclude each other" in str(err.value)
        client.open("y", options={"repo": str(roots / "good")})
        with pytest.raises(SupervisorError) as err:
            client.kill("y")
            client.open("y", options={"repo": str(outside)})
        assert err.value.code == "bad_field"
        assert [r["key"] for r in client.sessions()] == ["y"]


def test_a_bad_repo_setting_is_a_clear_error_at_open(supervisor_factory, tmp_path: Path) -> None:
    (tmp_path / "plain").mkdir()
    sup = supervisor_factory("--repo", str(tmp_path / "plain"))
    with sup.client() as client:
        with pytest.raises(SupervisorError) as err:
            client.open("x")
        assert err.value.code == "bad_config"
        assert f"{tmp_path / 'plain'} is not a git repository" in str(err.value)
        assert client.sessions() == []


def test_a_repository_without_commits_fails_the_session_with_the_reason(
    supervisor_factory, tmp_path: Path
) -> None:
    repo = tmp_path / "empty"
    repo.mkdir()
    git(repo, "init", "-q")
    sup = supervisor_factory("--repo", str(repo))
    with sup.client() as client:
        with pytest.raises(SupervisorError) as err:
            client.run("x", "pid")
        assert err.value.code == "session_failed"
        assert "has no commit yet" in str(err.value)
        assert client.sessions()[0]["state"] == "failed"


def test_a_template_home_gives_each_session_its_own_values(
    supervisor_factory, tmp_path: Path
) -> None:
    template = tmp_path / "template"
    (template / "memories").mkdir(parents=True)
    (template / "config.yaml").write_text(
        'memory:\n  provider: honcho\n  session: "hermes-{session}"\n  peer: "{platform}-{user_id}"\n'
    )
    (template / "memories" / "note.md").write_text("chat {chat_id} of {platform}, {unknown}\n")
    (template / "blob.bin").write_bytes(b"\0{session}\xff")
    (template / "link").symlink_to("config.yaml")
    agent = tmp_path / "agent.toml"
    agent.write_text(f'template_home = "{template}"\n')
    sup = supervisor_factory("--agent-config", str(agent))
    with sup.client() as client:
        client.open(
            "telegram:42", session_env={"platform": "telegram", "chat_id": "42", "user_id": "u7"}
        )
        client.open("slack:C9", session_env={"platform": "slack", "user_id": "w1"})
        homes = {k: Path(client.inspect(k)["home"]) for k in ("telegram:42", "slack:C9")}
        seen = output(client.run("telegram:42", "sh cat $HERMES_HOME/config.yaml"))
    assert seen == [
        "memory:",
        "  provider: honcho",
        '  session: "hermes-telegram:42"',
        '  peer: "telegram-u7"',
    ]
    other = (homes["slack:C9"] / "config.yaml").read_text()
    assert 'session: "hermes-slack:C9"' in other and 'peer: "slack-w1"' in other
    assert (
        homes["slack:C9"] / "memories" / "note.md"
    ).read_text() == "chat C9 of slack, {unknown}\n"
    assert (homes["telegram:42"] / "blob.bin").read_bytes() == b"\0{session}\xff"
    assert os.readlink(homes["telegram:42"] / "link") == "config.yaml"
    # A home is seeded once: what the session changed stays at its restart.
    (homes["slack:C9"] / "config.yaml").write_text("mine\n")
    with sup.client() as client:
        client.kill("slack:C9")
        client.run("slack:C9", "pid")
    assert (homes["slack:C9"] / "config.yaml").read_text() == "mine\n"


def test_what_a_crash_leaves_is_made_again_and_an_old_worktree_is_made_a_repository(
    tmp_path: Path,
) -> None:
    """Sessions' repositories with real git, no supervisor: one is reused,
    one left half made is made again, and a linked worktree an earlier
    version made becomes a repository of its own, its commits, index and
    files as they were, its entry in the shared repository gone."""
    import asyncio

    from hermes_sup.supervisor.git import GitRunner
    from hermes_sup.supervisor.worktrees import MAKING, Worktrees, worktree_ready

    repo = make_repo(tmp_path / "repo")
    trees = Worktrees(GitRunner(os.environ, lambda: None, lambda: None, lambda pid: None))
    one, two = tmp_path / "one" / "workspace", tmp_path / "two" / "workspace"
    # An earlier version's session: a linked worktree, with a commit on its
    # branch, a staged file and an untracked one.
    git(repo, "worktree", "add", "-q", "-b", branch_for("two"), str(two))
    (two / "done.txt").write_text("done\n")
    git(two, "add", "done.txt")
    git(two, "commit", "-q", "-m", "by two")
    (two / "staged.txt").write_text("staged\n")
    git(two, "add", "staged.txt")
    (two / "loose.txt").write_text("loose\n")

    async def scenario() -> list[bool]:
        made = [await trees.ensure(str(repo), one, branch_for("one"))]
        made.append(await trees.ensure(str(repo), one, branch_for("one")))  # reused
        # A crash while it was made: its files there, its repository not yet.
        subprocess.run(["rm", "-rf", str(one / ".git")], check=True, timeout=60)
        (one.parent / MAKING).mkdir()
        assert not worktree_ready(one)
        made.append(await trees.ensure(str(repo), one, branch_for("one")))
        made.append(await trees.ensure(str(repo), two, branch_for("two")))
        return made

    assert asyncio.run(scenario()) == [True, False, True, True]
    assert worktree_ready(one) and worktree_ready(two)
    assert not (one.parent / MAKING).exists()
    assert git(one, "status", "--porcelain") == ""
    assert subjects(two, "HEAD") == ["by two", "first"]
    assert sorted(git(two, "status", "--porcelain").splitlines()) == [
        "?? loose.txt",
        "A  staged.txt",
    ]
    assert git(repo, "worktree", "list", "--porcelain").count("worktree ") == 1
    # Files that no repository of ours left are never deleted.
    (one / "notes.txt").write_text("x")
    with pytest.raises(Exception, match="no session repository"):
        subprocess.run(["rm", "-rf", str(one / ".git")], check=True, timeout=60)
        asyncio.run(trees.ensure(str(repo), one, branch_for("one")))
    assert (one / "notes.txt").read_text() == "x"


def test_config_check_names_a_repository_that_cannot_be_used(tmp_path: Path) -> None:
    (tmp_path / "plain").mkdir()
    config = tmp_path / "c.toml"
    config.write_text(f'repo = "{tmp_path / "plain"}"\nrepo_roots = ["{tmp_path / "none"}"]\n')
    checked = cli_config_check(config)
    assert checked.returncode == 1 and "Traceback" not in checked.stderr
    assert f"repo: {tmp_path / 'plain'} is not a git repository" in checked.stderr
    assert f"repo_roots: {tmp_path / 'none'} is not a directory" in checked.stderr
    make_repo(tmp_path / "good")
    config.write_text(f'repo = "{tmp_path / "good"}"\nrepo_roots = ["{tmp_path}"]\n')
    assert cli_config_check(config).returncode == 0, cli_config_check(config).stderr


def cli_config_check(path: Path) -> subprocess.CompletedProcess[str]:
    return hermes_sup("config", "check", str(path))


def test_worktree_sessions_survive_a_supervisor_restart_and_take_spare_workers(
    supervisor_factory, tmp_path: Path
) -> None:
    repo = make_repo(tmp_path / "repo")
    sup = supervisor_factory("--repo", str(repo), "--spare-workers", "2")
    with sup.client() as client:
        for key in ("a", "b"):
            client.run(key, f"write {key}.txt mine")
        workspace = client.inspect("a")["workspace"]
    sup.stop()
    # Another repository for new sessions: those made before keep theirs.
    other = make_repo(tmp_path / "other")
    again = supervisor_factory("--repo", str(other), "--spare-workers", "2")
    with again.client() as client:
        rows = {r["key"]: r for r in client.sessions()}
        assert {k: (r["state"], r["repo"], r["branch"]) for k, r in rows.items()} == {
            "a": ("exited", str(repo), branch_for("a")),
            "b": ("exited", str(repo), branch_for("b")),
        }
        spares = ready_spares(again, client, 2)
        # Its own worktree, as it left it.
        assert output(client.run("a", "sh git status --porcelain")) == ["?? a.txt"]
        assert client.inspect("a")["workspace"] == workspace
        # A new session's worker, forked ahead, is given it once its worktree is made.
        assert int(client.run("c", "pid").text) in spares
        assert int(client.run("a", "pid").text) in spares
        assert client.inspect("c")["repo"] == str(other)
    for key, where in (("a", repo), ("b", repo), ("c", other)):
        bases = git(where, "for-each-ref", "--format=%(refname)", "refs/hermes-sup/bases/")
        assert branch_for(key).removeprefix("hermes-sup/") in bases


def ready_spares(sup, client, count: int) -> set[int]:  # noqa: ANN001
    """The pids of `count` ready spare workers, once there are that many."""
    wait_for(lambda: client.status()["spare_workers"] >= count, 30, what="spare workers")
    found = spare_pids(sup)
    assert len(found) == count
    return found


def test_a_worktree_being_made_blocks_no_one_else_and_can_be_killed(
    supervisor_factory, tmp_path: Path
) -> None:
    """git held at a gate (a wrapper on PATH waits for a file before
    `init`): other sessions are served meanwhile, and a kill of the
    session waiting for its worktree ends it without a worker."""
    repo = make_repo(tmp_path / "repo")
    gate = tmp_path / "gate"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    real_git = subprocess.run(["which", "git"], capture_output=True, text=True).stdout.strip()
    wrapper = bin_dir / "git"
    wrapper.write_text(
        "#!/bin/sh\n"
        'case " $* " in *" init "*)\n'
        f'  while [ ! -e "{gate}" ]; do sleep 0.02; done;;\n'
        "esac\n"
        f'exec {real_git} "$@"\n'
    )
    wrapper.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    sup = supervisor_factory("--repo-root", str(repo), env=env)
    with sup.client(timeout=60) as client:
        client.open("held", options={"repo": str(repo)})
        assert client.run("other", "pid").ok  # served while git waits at the gate
        assert {r["key"]: r["state"] for r in client.sessions()}["held"] == "starting"
        kill = client.submit(Kind.KILL, {}, session="held")
        gate.touch()
        answer = client.next(timeout=60)
        assert answer.re == kill and answer.kind is Kind.KILLED, answer.body
        assert answer.body["pid"] is None
        held = next(r for r in client.sessions() if r["key"] == "held")
        assert held["state"] == "exited" and held["pid"] is None
        # Its worktree was finished all the same, and serves its next start.
        assert output(client.run("held", "sh git branch --show-current")) == [branch_for("held")]


def test_only_a_configured_repositorys_git_directory_is_bound_into_a_session(
    tmp_path: Path,
) -> None:
    """The sealed worker binds back (read-only) the git directory whose
    objects the session's repository borrows, and only if it is one of the
    configured repositories': the session can write its alternates file,
    and a `.git` that is a symlink or a linked worktree's file counts not."""
    from hermes_sup.worker.seal_git import git_common_dir, own_worktree_admin

    repos = tmp_path / "repos"
    shared = make_repo(repos / "r")
    other = make_repo(tmp_path / "other")
    workspace = tmp_path / "w"
    alternates = workspace / ".git" / "objects" / "info" / "alternates"
    alternates.parent.mkdir(parents=True)
    alternates.write_text(f"{shared / '.git' / 'objects'}\n")
    common = (shared / ".git").resolve()
    assert git_common_dir(workspace, [shared]) == common
    assert git_common_dir(workspace, [repos / "nothing", shared]) == common
    assert git_common_dir(workspace, [tmp_path / "elsewhere"]) is None
    assert own_worktree_admin(common, workspace) is None  # nothing there is its
    # Another repository named by the session: not one of the configured.
    alternates.write_text(f"# mine\n{other / '.git' / 'objects'}\n")
    assert git_common_dir(workspace, [shared]) is None
    alternates.write_text(f"{shared / '.git'}\n")  # not its objects
    assert git_common_dir(workspace, [shared]) is None
    # A .git that is a symlink, or a linked worktree's file, is never followed.
    alternates.write_text(f"{shared / '.git' / 'objects'}\n")
    (workspace / ".git").rename(tmp_path / "real.git")
    (workspace / ".git").symlink_to(tmp_path / "real.git")
    assert git_common_dir(workspace, [shared]) is None
    (workspace / ".git").unlink()
    (workspace / ".git").write_text(f"gitdir: {shared / '.git'}\n")
    assert git_common_dir(workspace, [shared]) is None
    # A linked worktree its repository registered (a workspace an operator
    # made) counts; the same `.git` file anywhere else does not.
    tree = tmp_path / "tree"
    git(shared, "worktree", "add", "-q", str(tree))
    assert git_common_dir(tree, [repos]) == common
    (workspace / ".git").write_text((tree / ".git").read_text())
    assert git_common_dir(workspace, [repos]) is None
    # A linked worktree named as the repository (the operator's choice)
    # stands for its repository.
    (workspace / ".git").unlink()
    (tmp_path / "real.git").rename(workspace / ".git")
    assert git_common_dir(workspace, [tree]) == common


def test_a_purged_sessions_branch_never_goes_over_other_work(tmp_path: Path) -> None:
    """Purged, a session's branch is brought into the repository as a
    fast-forward; where the repository's branch of that name has commits
    the session's has not, it is kept aside in the supervisor's refs, and
    --delete-branch keeps nothing."""
    import asyncio

    from hermes_sup.supervisor.git import GitRunner
    from hermes_sup.supervisor.worktrees import KEPT_REFS, Worktrees

    repo = make_repo(tmp_path / "repo")
    trees = Worktrees(GitRunner(os.environ, lambda: None, lambda: None, lambda pid: None))
    workspace = tmp_path / "s" / "workspace"
    branch = branch_for("s")
    aside = KEPT_REFS + branch.removeprefix("hermes-sup/")
    asyncio.run(trees.ensure(str(repo), workspace, branch))
    git(workspace, "commit", "-q", "--allow-empty", "-m", "by the session")
    git(repo, "branch", branch, "main")
    git(repo, "commit", "-q", "--allow-empty", "-m", "by the operator")
    git(repo, "branch", "-f", branch, "main")
    problems = asyncio.run(trees.remove(str(repo), workspace, branch, False))
    assert problems == [
        f"branch {branch} kept as {aside}: the branch of that name there has other commits"
    ]
    assert subjects(repo, branch)[0] == "by the operator"
    assert subjects(repo, aside)[0] == "by the session"
    asyncio.run(trees.ensure(str(repo), workspace, branch))  # again, from its branch
    assert asyncio.run(trees.remove(str(repo), workspace, branch, True)) == []
    assert list(heads(repo)) == ["main"]
    assert git(repo, "for-each-ref", "refs/hermes-sup/") == ""
