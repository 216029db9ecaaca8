"""A session's workspace as a git repository of its own that borrows the
shared repository's objects. (Its home seeded from a template is homes.py; what the
operator does with sessions' work is repos.py.)

Theory of operation
-------------------
Sessions that all work in one checkout clobber each other: one sees the
other's uncommitted changes as its own, both commit to one branch. With a
repository (`repo` setting, or a session's `repo` option under `repo_roots`),
each session's workspace is instead a repository of its own on its own
branch (`branch_for`: named from the session key, made safe for git), made
when the session first starts and reused when it restarts (`ensure`).

Linked worktrees (`git worktree add`) share one ref store: a session that
may commit may also move any branch of the repository, the operator's
`main` and every other session's among them. So a session's repository is
its own (`workspace/.git`, a directory its uid owns): its refs, index,
config and new objects are there, and its `objects/info/alternates` names
the shared repository's objects, which it reads and never writes (sealed,
the whole shared git directory is read-only in its view: worker/seal_git.py).
The session commits, branches, rebases and stashes there freely; nothing it
does reaches the shared repository. The operator brings its work in
(`hermes-sup repo take`, repos.py): git fetches from the session's
repository into the shared one, with the session's side (upload-pack, made
to be run in repositories one does not trust) run as the uid that owns the
session's repository, never as root.

The supervisor keeps, in the shared repository, the commit each session
started from (`refs/hermes-sup/bases/<name>`): git's gc keeps what a ref
names, so the objects a session borrows stay while it does.

The supervisor's own git runs as git.py says: a configuration of its own
that runs nothing a repository may name, `safe.directory` naming the one
repository it works in, and a session's repository read as its owner.
Every git command that changes the shared repository runs under one
asyncio lock per repository (its common git directory), without blocking
the event loop for anything else.

A crash leaves nothing that is not made again: a session's repository is
made beside the workspace (`.git` in a directory of the session's own,
`MAKING`) and renamed into it last, so a workspace either has its finished
repository or is made again from the start. A session made by an earlier
version (a linked worktree of the shared repository) is turned into one of
its own at its next start, its branch, index and files as they were.

The other live sessions on a repository are listed to each of them in a
file of its workspace (peers.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import shlex
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

from hermes_sup.local.logfmt import kv

from .git import (
    SAFE_CONFIG,
    GitResult,
    GitRunner,
    WorktreeError,
    common_dir,
    fetch_args,
    open_session_git,
)

log = logging.getLogger("hermes_sup.supervisor")

BRANCH_PREFIX = "hermes-sup/"
# The part of a branch name taken from the key, before its digest.
BRANCH_KEY_LENGTH = 40
# In the shared repository, the supervisor's refs: the commit each session
# started from, and each session's branches as last brought in (repos.py).
BASES_REFS = "refs/hermes-sup/bases/"
SESSIONS_REFS = "refs/hermes-sup/sessions/"
# Where a purged session's branch is kept when the branch of its name in the
# shared repository has commits it has not.
KEPT_REFS = "refs/hermes-sup/kept/"
# What a session's repository calls the shared one (a remote it can fetch
# from and never push to).
SHARED_REMOTE = "shared"
# Where a session's repository is made before it is renamed into place.
MAKING = ".workspace-git"
# git's own lock files, should something outside the supervisor hold one.
LOCK_RETRIES = 5
LOCK_ERRORS = ("index.lock", ".lock': File exists", "cannot lock ref", "Unable to create")


# ----------------------------------------------------------- repositories


def repository_problem(path: str) -> str | None:
    """Why `path` is not a git repository's top directory (None if it is
    one): a work tree with its `.git`, or a bare repository. Cheap (a few
    stats), so it can run at every `open`."""
    p = Path(path)
    if not p.is_absolute():
        return f"{path} is not an absolute path"
    if not p.exists():
        return f"{path} does not exist"
    if not p.is_dir():
        return f"{path} is not a directory"
    if (p / ".git").exists():
        return None
    if (p / "HEAD").is_file() and (p / "objects").is_dir() and (p / "refs").is_dir():
        return None  # a bare repository
    return f"{path} is not a git repository (it has no .git)"


def read_problem(repo: str, gid: int, hidden: Iterable[str] = ()) -> str | None:
    """Why sessions running as uids of their own, in group `gid` (sealed,
    as root), could not read `repo`'s objects, which their repositories
    borrow, with the command that lets them; None if they can. They never
    need to write it. `hidden`: directories a sealed session sees as
    directories of its own, which it passes whatever their modes are on
    the host (its /tmp, the repository roots)."""
    common = Path(common_dir(repo))
    mounted = [Path(h) for h in hidden]

    def seen_as_is(path: Path) -> bool:
        return not any(path == h or h in path.parents for h in mounted)

    # Each directory up to the git directory must be passable, and the
    # objects and packs readable, by that group or by everyone.
    needs: list[tuple[Path, int]] = [(d, 0o1) for d in reversed(common.parents) if seen_as_is(d)]
    needs += [(common, 0o5), (common / "objects", 0o5)]
    pack = common / "objects" / "pack"
    if pack.is_dir():
        needs.append((pack, 0o5))
        needs += [(f, 0o4) for f in sorted(pack.iterdir()) if f.suffix in (".pack", ".idx")]
    for path, bits in needs:
        try:
            st = os.stat(path)
        except OSError:
            continue
        if st.st_mode & bits == bits or (st.st_gid == gid and (st.st_mode >> 3) & bits == bits):
            continue
        if path in common.parents:
            return (
                f"sealed sessions run as uids of their own, in group {gid}, and cannot pass "
                f"through {path} to read {repo}: chmod o+x {path}"
            )
        return (
            f"sealed sessions run as uids of their own, in group {gid}, and cannot read "
            f"{path}, which their repositories borrow objects from: chgrp -R {gid} {common} "
            f"&& chmod -R g+rX {common} (or chmod -R o+rX {common}); they never write it"
        )
    return None


def branch_for(key: str) -> str:
    """The session's branch: `hermes-sup/<key made safe>-<digest>`. Only
    letters, digits, `_` and `-` are kept from the key (so none of git's
    check-ref-format rules can be broken: no `..`, `@{`, `:`, leading dot
    or `.lock`), and a digest of the whole key keeps two keys that look
    alike once made safe apart."""
    safe = re.sub(r"[^A-Za-z0-9_-]+", "-", key).strip("-")[:BRANCH_KEY_LENGTH].strip("-")
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    return f"{BRANCH_PREFIX}{safe or 'session'}-{digest}"


def session_name(branch: str) -> str:
    """The part of a session's branch after the prefix: what names its refs
    in the shared repository (`refs/hermes-sup/*/<name>`)."""
    return branch.removeprefix(BRANCH_PREFIX)


def base_ref(branch: str) -> str:
    """The shared repository's ref on the commit a session started from."""
    return f"{BASES_REFS}{session_name(branch)}"


def worktree_ready(workspace: Path) -> bool:
    """Whether `workspace` is a finished session repository: its `.git` a
    directory (never a symlink) with a HEAD. (A linked worktree that an
    earlier version made is not: `ensure` makes it a repository of its own.)"""
    dotgit = workspace / ".git"
    return dotgit.is_dir() and not dotgit.is_symlink() and (dotgit / "HEAD").is_file()


def linked_worktree(repo: str, workspace: Path) -> Path | None:
    """The directory in the shared repository (`worktrees/<name>`) of a
    workspace that is a linked worktree (how an earlier version made
    sessions), if it is one: found by its `gitdir` file, which git wrote,
    never by the workspace's `.git` (the session's to write)."""
    if not (workspace / ".git").is_file():
        return None
    wanted = os.path.realpath(workspace / ".git")
    admins = Path(common_dir(repo)) / "worktrees"
    try:
        names = sorted(os.listdir(admins))
    except OSError:
        return None
    for name in names:
        try:
            named = (admins / name / "gitdir").read_text(errors="replace").strip()
        except OSError:
            continue
        if os.path.realpath(named) == wanted and (admins / name / "HEAD").is_file():
            return admins / name
    return None


# --------------------------------------------------- sessions' repositories


class Worktrees:
    """Sessions' repositories, made and removed one shared repository at a
    time."""

    def __init__(self, git: GitRunner) -> None:
        self.git = git
        self._locks: dict[str, asyncio.Lock] = {}

    def _lock(self, repo: str) -> asyncio.Lock:
        key = common_dir(repo)
        lock = self._locks.get(key)
        if lock is None:
            lock = self._locks[key] = asyncio.Lock()
        return lock

    async def _git(self, repo: str, *args: str) -> GitResult:
        """A git command that changes a repository, tried again while
        something else (a person's git, say) holds one of git's locks."""
        delay = 0.05
        for attempt in range(LOCK_RETRIES):
            result = await self.git.run(repo, *args)
            if result.code == 0 or not any(m in result.output for m in LOCK_ERRORS):
                return result
            if attempt < LOCK_RETRIES - 1:
                await asyncio.sleep(delay)
                delay *= 2
        return result

    async def _must(self, repo: str, *args: str) -> GitResult:
        """A git command that must succeed for a session's repository to be
        made; WorktreeError with git's last line otherwise."""
        result = await self._git(repo, *args)
        if result.code != 0:
            raise WorktreeError(f"git {args[0]} for {repo} failed: {result.last_line}")
        return result

    async def ensure(self, repo: str, workspace: Path, branch: str) -> bool:
        """Make `workspace` a repository of the session's own on `branch`
        (from the shared repository's HEAD, or from its branch of that name
        if it has one: a session's work kept when it was purged), unless it
        is one already; True if it was made now. WorktreeError says why it
        cannot be."""
        problem = repository_problem(repo)
        if problem is not None:
            raise WorktreeError(problem)
        async with self._lock(repo):
            if worktree_ready(workspace):
                return False
            started = time.monotonic()
            making = workspace.parent / MAKING
            admin = linked_worktree(repo, workspace)
            if admin is not None:
                await self._convert(repo, workspace, branch, admin, making)
            else:
                await self._make(repo, workspace, branch, making)
            log.info(
                kv(
                    "worktree_added",
                    repo=repo,
                    branch=branch,
                    ms=round((time.monotonic() - started) * 1000),
                )
            )
            return True

    async def _start_point(self, repo: str, branch: str) -> str:
        """The commit a new session's branch starts from."""
        for name in (f"refs/heads/{branch}^{{commit}}", "HEAD^{commit}"):
            found = await self.git.run(repo, "rev-parse", "--verify", "--quiet", name)
            if found.code == 0:
                return found.output.strip()
        raise WorktreeError(
            f"{repo} has no commit yet to start a session's branch from; make a first commit"
        )

    async def _init(self, repo: str, making: Path, branch: str, start: str) -> Path:
        """A new repository in `making` on `branch` at `start`, whose objects
        are the shared repository's; its git directory."""
        await asyncio.to_thread(shutil.rmtree, making, True)
        making.mkdir(parents=True)
        await self._must(str(making), "init", "--quiet", f"--initial-branch={branch}")
        git_dir = making / ".git"
        (git_dir / "objects" / "info" / "alternates").write_text(
            f"{Path(common_dir(repo)) / 'objects'}\n"
        )
        # The shared repository is a remote it may fetch from (its branches
        # as `shared/*`); sealed, it could never push there.
        await self._must(str(making), "remote", "add", SHARED_REMOTE, repo)
        # Its upload-pack runs in the shared repository, which is the
        # operator's, whoever's account that is (git gives it none of the
        # fetch's -c settings).
        serve = ["git", *SAFE_CONFIG, "-c", f"safe.directory={common_dir(repo)}", "upload-pack"]
        await self._must(
            str(making),
            *("-c", "protocol.file.allow=always", "fetch", "--quiet", "--no-tags"),
            *(f"--upload-pack={shlex.join(serve)}", SHARED_REMOTE),
        )
        # And the session's own fetches, for the same reason.
        uploadpack = shlex.join(["git", "-c", f"safe.directory={common_dir(repo)}", "upload-pack"])
        await self._must(str(making), "config", f"remote.{SHARED_REMOTE}.uploadpack", uploadpack)
        # Who its commits are by, so that its first `git commit` works (a
        # session's HOME has no git identity): the session, by its branch.
        name = session_name(branch)
        await self._must(str(making), "config", "user.name", f"hermes-sup session {name}")
        await self._must(str(making), "config", "user.email", f"{name}@hermes-sup.invalid")
        await self._must(str(making), "update-ref", f"refs/heads/{branch}", start)
        # The supervisor's pin of what the session borrows (see the module).
        await self._git(repo, "update-ref", base_ref(branch), start)
        await asyncio.to_thread(give_back, repo, ("refs/hermes-sup",))
        return git_dir

    async def _make(self, repo: str, workspace: Path, branch: str, making: Path) -> None:
        """A new session's repository: made in `making`, its files checked
        out in `workspace`, and renamed into the workspace last."""
        if workspace.exists() and any(workspace.iterdir()) and not making.exists():
            # Files that no repository of ours left half made: never ours to delete.
            raise WorktreeError(
                f"{workspace} holds files but is no session repository; move them away "
                "(or kill --purge the session) to let it start"
            )
        await asyncio.to_thread(shutil.rmtree, workspace, True)
        workspace.mkdir(parents=True, exist_ok=True)
        start = await self._start_point(repo, branch)
        git_dir = await self._init(repo, making, branch, start)
        await self._must(
            str(workspace), f"--git-dir={git_dir}", f"--work-tree={workspace}",
            "reset", "--quiet", "--hard",
        )  # fmt: skip
        os.rename(git_dir, workspace / ".git")
        await asyncio.to_thread(shutil.rmtree, making, True)

    async def _convert(
        self, repo: str, workspace: Path, branch: str, admin: Path, making: Path
    ) -> None:
        """A linked worktree made by an earlier version, turned into a
        repository of the session's own: its branch from the shared
        repository, its index and files as they were."""
        start = await self._start_point(repo, branch)
        git_dir = await self._init(repo, making, branch, start)
        if (admin / "index").is_file():
            shutil.copyfile(admin / "index", git_dir / "index")
        # The session's uid owns its workspace already, and must own this
        # too (a sealed start gives it whole trees only the first time).
        owner = os.stat(workspace)
        await asyncio.to_thread(_give_tree, git_dir, owner.st_uid, owner.st_gid)
        (workspace / ".git").unlink()
        os.rename(git_dir, workspace / ".git")
        await asyncio.to_thread(shutil.rmtree, making, True)
        # The worktree's entry in the shared repository, gone with it.
        await asyncio.to_thread(shutil.rmtree, admin, True)
        await self._git(repo, "worktree", "prune")

    async def keep_branch(self, repo: str, workspace: Path, branch: str) -> str | None:
        """Bring the session's branch into the shared repository as
        `branch`, a fast-forward only (never over other work), else as
        `refs/hermes-sup/kept/<name>` (the supervisor's, never the
        operator's branches); a note on where it went unless it went to
        `branch`, or why it could not be kept."""
        try:
            fd, st = open_session_git(workspace)
        except OSError as exc:
            return f"not kept: no session repository to keep it from ({exc.strerror})"
        aside = f"{KEPT_REFS}{session_name(branch)}"
        try:
            for refspec in (
                f"refs/heads/{branch}:refs/heads/{branch}",
                f"+refs/heads/{branch}:{aside}",
            ):
                kept = await self.git.run(repo, *fetch_args(repo, st, refspec), pass_fds=(fd,))
                if kept.code == 0:
                    break
        finally:
            os.close(fd)
        if kept.code != 0:
            return f"not kept: {kept.last_line}"
        if refspec.endswith(aside):
            return f"kept as {aside}: the branch of that name there has other commits"
        return None

    async def remove(
        self, repo: str, workspace: Path, branch: str, delete_branch: bool
    ) -> list[str]:
        """Remove a session's repository (uncommitted changes and all): its
        branch kept in the shared repository first, unless `delete_branch`;
        what could not be done, as sentences (the caller deletes the
        directory all the same)."""
        problems: list[str] = []
        if repository_problem(repo) is not None:
            return [f"repository {repo} is gone: nothing to remove there"]
        async with self._lock(repo):
            if linked_worktree(repo, workspace) is not None:
                gone = await self._git(
                    repo, "worktree", "remove", "--force", "--force", str(workspace)
                )
                if gone.code != 0:
                    problems.append(f"git worktree remove: {gone.last_line}")
            elif not delete_branch and worktree_ready(workspace):
                why = await self.keep_branch(repo, workspace, branch)
                if why is not None:
                    problems.append(f"branch {branch} {why}")
            await asyncio.to_thread(shutil.rmtree, workspace, True)
            await asyncio.to_thread(shutil.rmtree, workspace.parent / MAKING, True)
            await self._git(repo, "worktree", "prune")
            # The supervisor's refs of the session: what it borrowed, what
            # the operator last listed of it (and, keeping nothing, its
            # work kept aside at an earlier purge).
            kept = [f"{KEPT_REFS}{session_name(branch)}"] if delete_branch else []
            refs = await self.git.run(
                repo, "for-each-ref", "--format=%(refname)",
                base_ref(branch), f"{SESSIONS_REFS}{session_name(branch)}/", *kept,
            )  # fmt: skip
            names = refs.output.split() if refs.code == 0 else []
            if delete_branch:
                known = await self.git.run(
                    repo, "rev-parse", "--verify", "--quiet", f"refs/heads/{branch}"
                )
                if known.code == 0:
                    names.append(f"refs/heads/{branch}")
            for name in names:
                deleted = await self._git(repo, "update-ref", "-d", name)
                if deleted.code != 0 and name == f"refs/heads/{branch}":
                    problems.append(f"branch {branch} kept: {deleted.last_line}")
            await asyncio.to_thread(give_back, repo)
        log.info(kv("worktree_removed", repo=repo, branch=branch, branch_deleted=delete_branch))
        return problems


def give_back(repo: str, tops: tuple[str, ...] = ("refs", "logs", "objects")) -> None:
    """Give what root's git just wrote in a shared repository another
    account owns (under `tops` of its git directory, and packed-refs) to
    that account, so that the operator's own git there is never refused by
    a file or directory of root's. Nothing to do but as root."""
    if os.geteuid() != 0:
        return
    common = Path(common_dir(repo))
    try:
        owner = os.stat(common)
    except OSError:
        return
    if owner.st_uid == 0:
        return
    paths = [common / "packed-refs"]
    for top in tops:
        for root, dirs, files in os.walk(common / top):
            paths.append(Path(root))
            paths += [Path(root) / name for name in dirs + files]
    for path in paths:
        try:
            if os.lstat(path).st_uid == 0:
                os.lchown(path, owner.st_uid, owner.st_gid)
        except OSError:
            continue  # gone meanwhile (git's own lock files)


def _give_tree(top: Path, uid: int, gid: int) -> None:
    """chown a tree the supervisor just made (no symlink in it is followed)."""
    if (os.lstat(top).st_uid, os.lstat(top).st_gid) == (uid, gid):
        return
    for root, dirs, files in os.walk(top):
        os.lchown(root, uid, gid)
        for name in dirs + files:
            os.lchown(os.path.join(root, name), uid, gid)
