"""One repository, many sessions, one of them hostile: two sealed sessions
commit at once, each in its own repository; the hostile one tries every way
to move a ref outside its own (update-ref on its neighbour's branch and on
main, push, gc and prune, config, hooks, packed-refs, reflog expire, the
objects themselves) and to make the operator's git run its commands. Its
neighbour's commits and the operator's branches are intact, and the
operator brings each session's work in with one command. Sealed as root
and as an unprivileged service user; real supervisors, real git."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from hermes_sup.client import Client, Output
from hermes_sup.supervisor.worktrees import branch_for

from .test_hostile_session import NOBODY, refused, require_sealed, start_lab, tries
from .test_sealed import as_nobody_with_the_interpreter_reachable, sh
from .test_worktrees import GIT_ENV, git, heads, make_repo, subjects

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="starts supervisors as root and as nobody"),
]

COMMIT = "git -c user.name=s -c user.email=s@example.com commit -q"


def operator(mode: str) -> Callable[[], None] | None:
    """Who the operator is: root, or (unprivileged) the service user."""
    return as_nobody_with_the_interpreter_reachable if mode == "user" else None


def repo_cli(data_dir: Path, mode: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`hermes-sup repo ...` as the operator."""
    return subprocess.run(
        [sys.executable, "-m", "hermes_sup.cli", "repo", *args, "--data-dir", str(data_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**GIT_ENV, "HOME": "/nonexistent"},
        preexec_fn=operator(mode),
    )


def commit_loop(client: Client, key: str, count: int):  # noqa: ANN201
    """Send (without waiting) a turn that commits `count` times, each
    changing README (the file both sessions change) and a file of its own."""
    command = (
        f"for i in $(seq {count}); do echo {key} $i >> README; echo $i > {key}.txt; "
        f"git add README {key}.txt && {COMMIT} -m '{key} '$i || exit 1; done; echo rc=$?"
    )
    return client.send(key, f"sh {command}")


@pytest.mark.parametrize("mode", ["root", "user"])
def test_a_hostile_session_moves_no_ref_outside_its_own_and_the_operator_takes_the_work(
    supervisor_factory, workdir: Path, mode: str
) -> None:
    repo = make_repo(workdir / "repo")
    common = repo / ".git"
    pwned = workdir / "pwned"
    pwned.mkdir()
    os.chmod(pwned, 0o777)
    os.chmod(workdir, 0o755)
    lab = start_lab(supervisor_factory, workdir, mode, "--repo", str(repo))
    require_sealed(lab)
    main = heads(repo)["main"]
    config = (common / "config").read_text()
    hooks = sorted(p.name for p in (common / "hooks").iterdir())
    branch_a, branch_b = branch_for("a"), branch_for("b")
    ws_b = lab.workspace("b")

    with lab.client() as one, lab.client() as two:
        one.open("a")
        two.open("b")
        # Both commit at once, each in its own repository.
        turns = [commit_loop(one, "a", 5), commit_loop(two, "b", 5)]
        for turn in turns:
            lines = "\n".join(e.line for e in turn.collect().events if isinstance(e, Output))
            assert lines.splitlines()[-1] == "rc=0", lines
        # b works as it would alone: branches, stashes, rebases on main.
        _, lines = sh(
            two,
            "b",
            "git fetch -q shared && echo wip > wip.txt && git add wip.txt && git stash -q && "
            "git checkout -q -b b-topic && git checkout -q - && git rebase -q shared/main && "
            "git stash pop -q && git log --format=%s shared/main; echo rc=$?",
        )
        assert lines == ["first", "rc=0"], lines

        got = tries(
            one,
            "a",
            {
                "update-ref main": f"git --git-dir={common} update-ref refs/heads/main HEAD",
                "update-ref b's branch there": (
                    f"git --git-dir={common} update-ref refs/heads/{branch_b} HEAD"
                ),
                "b's own repository": (
                    f"git --git-dir={ws_b}/.git update-ref refs/heads/{branch_b} HEAD"
                ),
                "push main": "git push -q shared HEAD:main",
                "push force": "git push -q -f shared HEAD:refs/heads/main",
                "push b's branch": f"git push -q shared HEAD:refs/heads/{branch_b}",
                "push by path": f"git push -q {repo} HEAD:refs/heads/main",
                "gc there": f"git --git-dir={common} gc -q --prune=now",
                "repack there": f"git --git-dir={common} repack -a -d -q",
                "config there": f"git --git-dir={common} config core.fsmonitor 'touch {pwned}/x'",
                "config file": f"echo '[core] fsmonitor = touch {pwned}/x' >> {common}/config",
                "hook": f"printf '#!/bin/sh\\ntouch {pwned}/hook\\n' > {common}/hooks/post-merge",
                "packed-refs": f"echo '{'0' * 40} refs/heads/main' > {common}/packed-refs",
                "loose ref": f"echo {'0' * 40} > {common}/refs/heads/main",
                "objects": f"rm -rf {common}/objects/pack {common}/objects/info",
                "reflog": f"echo > {common}/logs/HEAD",
            },
        )
        for name, lines in got.items():
            assert refused(lines), (name, lines)
        # What may run and must change nothing outside a's own repository,
        # and a's own configuration made to run commands wherever git reads it.
        sh(
            one,
            "a",
            f"git --git-dir={common} prune; "
            f"git --git-dir={common} reflog expire --expire=now --all; "
            "git gc -q --prune=now; git reflog expire --expire=now --all; "
            f"git config core.fsmonitor 'touch {pwned}/fsmonitor; false'; "
            f"git config core.alternateRefsCommand 'touch {pwned}/alternates'; "
            f"git config filter.evil.clean 'touch {pwned}/clean; cat'; "
            f"git config filter.evil.smudge 'touch {pwned}/smudge; cat'; "
            f"git config uploadpack.packObjectsHook 'touch {pwned}/pack-hook;'; "
            f"printf '#!/bin/sh\\ntouch {pwned}/own-hook\\n' > .git/hooks/pre-upload && "
            "chmod +x .git/hooks/pre-upload; echo '* filter=evil' > .gitattributes",
        )
        # b goes on committing; a's work is its own.
        _, lines = sh(two, "b", f"echo more >> b.txt && {COMMIT} -am 'b last'; echo rc=$?")
        assert lines[-1] == "rc=0", lines
        sh(two, "b", "echo notes > notes.txt")
        assert output_of(one, "a", "git log --format=%s -1") == ["a 5"]

    # The operator's branches, config and hooks as they were; the shared
    # repository whole.
    assert heads(repo) == {"main": main}
    assert (common / "config").read_text() == config
    assert sorted(p.name for p in (common / "hooks").iterdir()) == hooks
    assert not (common / "packed-refs").exists()
    git(repo, "fsck", "--no-progress", "--no-dangling")
    assert subjects(repo, "main") == ["first"]
    # b's commits on its branch, in its own repository, none of a's.
    expected_b = ["b last", *(f"b {i}" for i in range(5, 0, -1)), "first"]
    assert subjects(ws_b, branch_b) == expected_b

    # The operator: each session's branches, its uncommitted files, and the
    # file both change.
    listed = repo_cli(lab.data_dir, mode, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    seen = json.loads(listed.stdout)
    rows = {s["session"]: s for s in seen["sessions"]}
    assert set(rows) == {"a", "b"}
    mine = {b["name"]: (b["ahead"], b["behind"]) for b in rows["b"]["branches"]}
    assert mine == {branch_b: (6, 0), "b-topic": (5, 0)}, rows["b"]
    assert rows["b"]["dirty"] == ["notes.txt"]
    assert {b["name"]: b["ahead"] for b in rows["a"]["branches"]} == {branch_a: 5}
    assert rows["a"]["dirty"] == [".gitattributes"]
    assert seen["overlaps"] == {str(repo): {"README": ["a", "b"]}}
    table = repo_cli(lab.data_dir, mode, "list", "--repo", str(repo))
    assert table.returncode == 0, table.stderr
    assert "README: a, b" in table.stdout

    taken = repo_cli(lab.data_dir, mode, "take", "b")
    assert taken.returncode == 0, taken.stderr
    assert subjects(repo, branch_b) == expected_b
    assert repo_cli(lab.data_dir, mode, "take", "a", "--as", "from-a").returncode == 0
    assert subjects(repo, "from-a")[0] == "a 5"
    # A take never moves a branch over commits it does not have.
    over = repo_cli(lab.data_dir, mode, "take", "a", "--as", branch_b)
    assert over.returncode == 1 and "nothing was moved" in over.stderr, over.stderr
    assert subjects(repo, branch_b) == expected_b
    assert heads(repo)["main"] == main
    # Nothing a session configured ran outside its seal.
    assert sorted(os.listdir(pwned)) == []
    if mode == "user":
        assert (common / "refs" / "heads" / "from-a").stat().st_uid == NOBODY


def output_of(client: Client, key: str, command: str) -> list[str]:
    return sh(client, key, command)[1]


def test_the_operator_is_told_what_is_wrong(supervisor_factory, tmp_path: Path) -> None:
    """No data directory, no such session, a name git refuses."""
    nowhere = subprocess.run(
        [sys.executable, "-m", "hermes_sup.cli", "repo", "list", "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert nowhere.returncode == 1 and "holds no sessions" in nowhere.stderr
    assert "Traceback" not in nowhere.stderr
    repo = make_repo(tmp_path / "repo")
    sup = supervisor_factory("--repo", str(repo))
    with sup.client() as client:
        client.run("a", "pid")
    missing = repo_cli(sup.data_dir, "root", "take", "nobody-here")
    assert missing.returncode == 1 and "no session 'nobody-here'" in missing.stderr
    bad = repo_cli(sup.data_dir, "root", "take", "a", "--as", "a..b")
    assert bad.returncode == 1 and "not a name git takes" in bad.stderr
    assert list(heads(repo)) == ["main"]
