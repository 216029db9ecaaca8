"""The operator's side of a repository that sessions work on: each session's
branches and their state against the repository's HEAD (ahead, behind, its
uncommitted changes), which files each session changed (so two sessions on
one file show), and a session's branch brought into the repository.

Theory of operation
-------------------
Every session works in a repository of its own (worktrees.py). To see its
work, the supervisor's view of it is brought into the shared repository:
git fetches the session's branches into refs of the supervisor's own,
`refs/hermes-sup/sessions/<name>/heads/*` (and its HEAD beside them), never
into the operator's branches; ahead, behind and the files changed are then
plain git in the shared repository, which is the operator's and trusted.
`take` fetches one session branch into `refs/heads/<branch>`, as a
fast-forward only, so the operator's branches never lose a commit.

What reads the session's repository is never root's git in it: the fetch
runs upload-pack there as the repository's owner (the session's uid,
sealed as root), and its uncommitted changes are read as that owner too,
by a `git status` whose git directory is one made here, with nothing of the
session's configuration: the session's repository may name a file-system
monitor, hooks or filters, and none of them runs.

This runs in the `hermes-sup repo` command, beside the supervisor: it reads
session.json files in the data directory, as `logs --data-dir` does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .git import GIT_TIMEOUT, SAFE_CONFIG, common_dir, fetch_args, in_owner_view, open_session_git
from .session import read_session_meta, sessions_dir, stored_worktree
from .worktrees import (
    SESSIONS_REFS,
    give_back,
    repository_problem,
    session_name,
    worktree_ready,
)


class RepoError(Exception):
    """What the operator asked cannot be done; the message says why."""


@dataclass(frozen=True)
class Branch:
    """One of a session's branches, against the repository's HEAD."""

    name: str
    commit: str
    ahead: int
    behind: int


@dataclass
class SessionWork:
    """A session on the repository, and its work."""

    key: str
    repo: str  # as its session.json names it
    branch: str  # the branch the supervisor made for it
    workspace: Path
    branches: list[Branch] = field(default_factory=list)
    # Paths changed and not committed; None when they could not be read.
    dirty: list[str] | None = None
    files: list[str] = field(default_factory=list)  # what its work changes
    problem: str | None = None

    def describe(self) -> dict[str, object]:
        """As `repo list --json` shows it."""
        return {
            "session": self.key,
            "repo": self.repo,
            "branch": self.branch,
            "workspace": str(self.workspace),
            "branches": [b.__dict__ for b in self.branches],
            "dirty": self.dirty,
            "files": self.files,
            "problem": self.problem,
        }


def _env() -> dict[str, str]:
    """git's environment: nothing of ours that would point it elsewhere."""
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "USER", "TMPDIR")}
    env.update(LC_ALL="C", GIT_TERMINAL_PROMPT="0")
    env.setdefault("PATH", os.defpath)
    return env


def git(repo: str, *args: str, pass_fd: int | None = None) -> subprocess.CompletedProcess[str]:
    """`git -C repo args` in the shared repository, running nothing its
    configuration or a session's could name (git.SAFE_CONFIG), with
    `pass_fd` open in it (at its own number)."""
    trusted = ("-c", f"safe.directory={os.path.realpath(repo)}")
    return subprocess.run(
        ["git", *SAFE_CONFIG, *trusted, "-C", repo, *args],
        capture_output=True,
        text=True,
        errors="replace",
        env=_env(),
        timeout=GIT_TIMEOUT,
        pass_fds=() if pass_fd is None else (pass_fd,),
        stdin=subprocess.DEVNULL,
    )


def _last_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
    return lines[-1].strip() if lines else f"exit status {done.returncode}"


def sessions_on(data_dir: Path, repo: str | None = None) -> list[SessionWork]:
    """The sessions the data directory holds on a repository (on `repo` if
    given, by its git directory, whichever path names it), in key order."""
    wanted = common_dir(repo) if repo is not None else None
    found = []
    try:
        entries = sorted(os.scandir(sessions_dir(data_dir)), key=lambda e: e.name)
    except OSError as exc:
        raise RepoError(f"cannot read the sessions in {data_dir}: {exc.strerror}") from None
    for entry in entries:
        meta = read_session_meta(entry.path)
        bound = stored_worktree(meta)
        their, branch = bound["repo"], bound["branch"]
        if meta is None or their is None or branch is None:
            continue
        if wanted is not None and (
            repository_problem(their) is not None or common_dir(their) != wanted
        ):
            continue
        workspace = Path(entry.path) / "workspace"
        found.append(SessionWork(str(meta.get("key")), their, branch, workspace))
    return sorted(found, key=lambda w: w.key)


def find_session(data_dir: Path, key: str) -> SessionWork:
    """Session `key`, if it works on a repository; RepoError otherwise."""
    for work in sessions_on(data_dir):
        if work.key == key:
            return work
    raise RepoError(
        f"no session {key!r} works on a repository in {data_dir} "
        "(hermes-sup repo list shows those that do)"
    )


def _fetch(repo: str, work: SessionWork, *refspecs: str, prune: bool = False) -> None:
    """Fetch `refspecs` from the session's repository into `repo`, as its
    owner's upload-pack (git.fetch_args); RepoError if it fails."""
    if not worktree_ready(work.workspace):
        raise RepoError(
            f"session {work.key!r} has no repository of its own yet (one is made at its next start)"
        )
    try:
        fd, st = open_session_git(work.workspace)
    except OSError as exc:
        raise RepoError(f"cannot open session {work.key!r}'s repository: {exc.strerror}") from None
    try:
        args = fetch_args(repo, st, *refspecs, fd=fd)
        args.remove("--quiet")  # quiet, git would not say why it refused a ref
        if prune:
            args.insert(args.index("fetch") + 1, "--prune")
        done = git(repo, *args, pass_fd=fd)
    finally:
        os.close(fd)
    if done.returncode != 0:
        if "non-fast-forward" in done.stderr or "[rejected]" in done.stderr:
            raise RepoError(
                f"the branch there has commits session {work.key!r}'s branch has not: "
                "nothing was moved; take it as another branch (--as)"
            )
        raise RepoError(f"cannot fetch from session {work.key!r}: {_last_line(done)}")


def bring_in(repo: str, work: SessionWork) -> None:
    """Bring the session's branches and HEAD into the supervisor's refs of
    it in `repo` (branches it deleted go from there too)."""
    ours = f"{SESSIONS_REFS}{session_name(work.branch)}"
    _fetch(repo, work, f"+refs/heads/*:{ours}/heads/*", f"+HEAD:{ours}/HEAD", prune=True)


def _count(repo: str, base: str, ref: str) -> tuple[int, int]:
    """How many commits `ref` has that `base` has not, and the other way."""
    done = git(repo, "rev-list", "--left-right", "--count", f"{base}...{ref}")
    if done.returncode != 0:
        return 0, 0
    behind, ahead = (int(n) for n in done.stdout.split())
    return ahead, behind


def survey(data_dir: Path, repo: str | None = None) -> list[SessionWork]:
    """Every session on a repository (on `repo` if given), with its
    branches against its repository's HEAD, its uncommitted changes and the
    files it changed."""
    works = sessions_on(data_dir, repo)
    for work in works:
        _look_at(work)
    for repository in {w.repo for w in works if repository_problem(w.repo) is None}:
        give_back(repository)
    return works


def _look_at(work: SessionWork) -> None:
    """Fill in what the session did, or why that cannot be told."""
    repo = work.repo
    if repository_problem(repo) is not None:
        work.problem = repository_problem(repo)
        return
    base = git(repo, "rev-parse", "--verify", "--quiet", "HEAD^{commit}").stdout.strip()
    try:
        bring_in(repo, work)
    except RepoError as exc:
        work.problem = str(exc)
        return
    ours = f"{SESSIONS_REFS}{session_name(work.branch)}"
    listed = git(repo, "for-each-ref", "--format=%(refname) %(objectname)", f"{ours}/heads/")
    files: set[str] = set()
    for line in listed.stdout.splitlines():
        ref, commit = line.split()
        ahead, behind = _count(repo, base, ref) if base else (0, 0)
        work.branches.append(Branch(ref.removeprefix(f"{ours}/heads/"), commit, ahead, behind))
        if base and ahead:
            changed = git(repo, "diff", "--name-only", "-z", f"{base}...{ref}")
            files.update(p for p in changed.stdout.split("\0") if p)
    head = git(repo, "rev-parse", "--verify", "--quiet", f"{ours}/HEAD").stdout.strip()
    work.dirty = uncommitted(repo, work, head) if head else None
    files.update(work.dirty or ())
    work.files = sorted(files)


def overlaps(works: list[SessionWork]) -> dict[str, dict[str, list[str]]]:
    """The files more than one session on one repository changes:
    repository -> file -> the sessions."""
    by_repo: dict[str, dict[str, list[str]]] = {}
    for work in works:
        files = by_repo.setdefault(work.repo, {})
        for path in work.files:
            files.setdefault(path, []).append(work.key)
    return {
        repo: {path: keys for path, keys in sorted(files.items()) if len(keys) > 1}
        for repo, files in sorted(by_repo.items())
        if any(len(keys) > 1 for keys in files.values())
    }


# A git directory of our own for reading a session's work tree: its HEAD is
# the session's commit, its configuration ours (none of the session's).
SCRATCH_CONFIG = "[core]\n\trepositoryformatversion = 0\n\tbare = false\n"


def uncommitted(repo: str, work: SessionWork, head: str) -> list[str] | None:
    """The paths the session changed and did not commit (staged or not, and
    new files git does not ignore), read as its repository's owner; None if
    they cannot be read."""
    try:
        fd, st = _open_workspace(work.workspace)
    except OSError:
        return None
    scratch = Path(tempfile.mkdtemp(prefix="hermes-sup-status-"))
    try:
        (scratch / "objects").mkdir()
        (scratch / "refs").mkdir()
        (scratch / "HEAD").write_text(f"{head}\n")
        (scratch / "config").write_text(SCRATCH_CONFIG)
        for path in (scratch, scratch / "objects", scratch / "refs"):
            os.chmod(path, 0o755)
        objects = str(Path(common_dir(repo)) / "objects")

        def argv(paths: Mapping[str, str]) -> list[str]:
            own = f"{paths['session']}/.git"
            return [
                "env",
                f"GIT_DIR={paths['scratch']}",
                f"GIT_WORK_TREE={paths['session']}",
                f"GIT_INDEX_FILE={own}/index",
                f"GIT_OBJECT_DIRECTORY={own}/objects",
                f"GIT_ALTERNATE_OBJECT_DIRECTORIES={paths['objects']}",
                "git",
                *SAFE_CONFIG,
                "--no-optional-locks",
                "status",
                "--porcelain",
                "-z",
                "--untracked-files=all",
            ]

        command = in_owner_view(st, fd, {"scratch": str(scratch), "objects": objects}, argv)
        done = subprocess.run(
            ["sh", "-c", command],
            capture_output=True,
            text=True,
            errors="replace",
            env=_env(),
            timeout=GIT_TIMEOUT,
            pass_fds=(fd,),
            stdin=subprocess.DEVNULL,
        )
    finally:
        os.close(fd)
        shutil.rmtree(scratch, ignore_errors=True)
    if done.returncode != 0:
        return None
    return _porcelain_paths(done.stdout)


def _open_workspace(workspace: Path) -> tuple[int, os.stat_result]:
    """The session's work tree, open, and its repository's stat (whose
    owner reads it). The workspace is in the session's directory, which
    only the supervisor may change."""
    fd = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.stat(".git", dir_fd=fd, follow_symlinks=False)
    except OSError:
        os.close(fd)
        raise
    return fd, st


def _porcelain_paths(text: str) -> list[str]:
    """The paths of `git status --porcelain -z`: "XY path", a rename's
    source after it as an entry of its own."""
    paths: list[str] = []
    entries = text.split("\0")
    i = 0
    while i < len(entries):
        entry = entries[i]
        i += 1
        if len(entry) < 4:
            continue
        paths.append(entry[3:])
        if entry[0] in "RC":
            i += 1  # the source of a rename or copy
    return sorted(set(paths))


def take(data_dir: Path, key: str, as_branch: str | None) -> tuple[SessionWork, str, str]:
    """Bring session `key`'s branch into its repository as `as_branch` (its
    own branch's name if None), a fast-forward only; (the session, the
    branch, its commit) once done, RepoError saying why not."""
    work = find_session(data_dir, key)
    repo = work.repo
    problem = repository_problem(repo)
    if problem is not None:
        raise RepoError(problem)
    branch = as_branch or work.branch
    named = git(repo, "check-ref-format", "--branch", branch)
    if named.returncode != 0 or branch.startswith("-"):
        raise RepoError(f"{branch!r} is not a name git takes for a branch")
    try:
        _fetch(repo, work, f"refs/heads/{work.branch}:refs/heads/{branch}")
    finally:
        give_back(repo)
    commit = git(repo, "rev-parse", "--verify", "--quiet", f"refs/heads/{branch}")
    return work, branch, commit.stdout.strip()
