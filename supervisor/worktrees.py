"""A session's workspace as its own git worktree, and the list of its peers
(the other sessions on its repository). (Its home seeded from a template
is homes.py.)

Theory of operation
-------------------
Sessions that all work in one checkout clobber each other: one sees the
other's uncommitted changes as its own, both commit to one branch. With a
repository (`repo` setting, or a session's `repo` option under `repo_roots`),
each session's workspace is instead its own `git worktree` of it, on its own
branch (`branch_for`: named from the session key, made safe for git), added
when the session first starts and reused when it restarts (`ensure`).

git locks a repository's files itself (index.lock, the worktrees directory,
refs), and two `git worktree add` at once fail on those locks rather than
wait. So every git command that changes a repository's worktrees runs under
one asyncio lock per repository (its common git directory): twenty sessions
started at once make their worktrees one after the other, without blocking
the event loop for anything else.

git runs as a child of the supervisor, which reaps every child itself
(server.py) and kills children that are no worker's (pool.py's orphan
cull). `GitRunner` therefore spawns git with posix_spawn (no Popen
bookkeeping), reads its output without blocking, and takes its exit status
from whichever of the two reaps it, while holding off the cull.

A crash leaves nothing that `git worktree prune` cannot clean: a worktree
whose directory went with its session's data is pruned (`ensure` prunes
before each add, `remove` after each removal), and one left half made is
removed and made again.

Peers: at each start and each turn, a session on a repository finds in
`.hermes-sup/peers` (in its worktree, ignored by git through a .gitignore
of its own) the other live sessions on the same repository, with their
branches. The supervisor writes it through directory descriptors without
following symlinks: the worktree is the session's to change.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import shutil
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from hermes_sup.local.logfmt import kv

log = logging.getLogger("hermes_sup.supervisor")

BRANCH_PREFIX = "hermes-sup/"
# The part of a branch name taken from the key, before its digest.
BRANCH_KEY_LENGTH = 40
PEERS_DIR = ".hermes-sup"
PEERS_FILE = "peers"
GIT_TIMEOUT = 120.0
# git's own lock files, should something outside the supervisor hold one.
LOCK_RETRIES = 5
LOCK_ERRORS = ("index.lock", ".lock': File exists", "cannot lock ref", "Unable to create")
MAX_GIT_OUTPUT = 64 * 1024


class WorktreeError(Exception):
    """A repository or worktree that cannot be used; the message says why."""


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


def common_dir(repo: str) -> str:
    """The repository's common git directory (shared by all its worktrees):
    what its lock is keyed by, whichever path names it."""
    top = Path(os.path.realpath(repo))
    dotgit = top / ".git"
    if dotgit.is_dir():
        return str(dotgit)
    if dotgit.is_file():
        # A linked worktree named as the repository: .git says where its
        # own git dir is, and that one's `commondir` where the shared one is.
        text = dotgit.read_text(errors="replace").strip()
        if text.startswith("gitdir:"):
            own = (top / text[len("gitdir:") :].strip()).resolve()
            try:
                shared = (own / "commondir").read_text().strip()
            except OSError:
                return str(own)
            return str((own / shared).resolve())
    return str(top)  # bare


def commit_problem(repo: str, gid: int) -> str | None:
    """Why sessions running as uids of their own, in group `gid` (sealed,
    as root), could not commit to `repo`, with what to do; None if they
    can (its objects are writable by that group or by everyone)."""
    common = common_dir(repo)
    try:
        st = os.stat(Path(common) / "objects")
    except OSError:
        return None
    if st.st_mode & 0o002 or (st.st_gid == gid and st.st_mode & 0o020):
        return None
    return (
        f"sealed sessions run as uids of their own, in group {gid}: they can read {repo} and "
        "work in their worktrees, but not commit until the repository is writable by that "
        f"group: chgrp -R {gid} {common} && chmod -R g+rwX {common} && "
        f"git -C {repo} config core.sharedRepository group (its config, hooks and the other "
        "sessions' worktrees stay read-only to them)"
    )


def branch_for(key: str) -> str:
    """The session's branch: `hermes-sup/<key made safe>-<digest>`. Only
    letters, digits, `_` and `-` are kept from the key (so none of git's
    check-ref-format rules can be broken: no `..`, `@{`, `:`, leading dot
    or `.lock`), and a digest of the whole key keeps two keys that look
    alike once made safe apart."""
    safe = re.sub(r"[^A-Za-z0-9_-]+", "-", key).strip("-")[:BRANCH_KEY_LENGTH].strip("-")
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    return f"{BRANCH_PREFIX}{safe or 'session'}-{digest}"


def worktree_ready(workspace: Path) -> bool:
    """Whether `workspace` is a finished worktree: its `.git` file names a
    git dir that exists and is not still marked as being made."""
    try:
        text = (workspace / ".git").read_text(errors="replace").strip()
    except OSError:
        return False
    if not text.startswith("gitdir:"):
        return False
    gitdir = workspace / text[len("gitdir:") :].strip()
    if not (gitdir / "HEAD").is_file():
        return False
    try:
        # `git worktree add` locks the worktree "initializing" until done.
        return "initializing" not in (gitdir / "locked").read_text()
    except OSError:
        return True


# -------------------------------------------------------------------- git


# What the supervisor's git runs with: none of the programs a repository's
# config may name is run (hooks, the file-system monitor, ssh, pager,
# editors, credential helpers, gpg, transports). Filters and diff drivers
# are named in the config too; sealed sessions cannot write it (worker/seal.py
# shows them the repository's config, hooks and attributes read-only), so
# only the operator's own would run.
SAFE_CONFIG = tuple(
    arg
    for setting in (
        "core.hooksPath=/dev/null",
        "core.fsmonitor=false",
        "core.sshCommand=false",
        "core.pager=cat",
        "core.editor=false",
        "sequence.editor=false",
        "core.askPass=false",
        "credential.helper=",
        "gpg.program=false",
        "diff.external=",
        "protocol.allow=never",
    )
    for arg in ("-c", setting)
)


@dataclass(frozen=True)
class GitResult:
    code: int
    output: str  # stdout and stderr together

    @property
    def last_line(self) -> str:
        lines = [line for line in self.output.splitlines() if line.strip()]
        return lines[-1].strip() if lines else f"exit status {self.code}"


class GitRunner:
    """Runs git without a Popen: the supervisor reaps its children itself.

    `hold`/`release` bracket a run (the orphan cull waits meanwhile), and
    `reaped(pid)` is the exit status the supervisor's reaper took for the
    pid, if it took it first."""

    def __init__(
        self,
        environ: Mapping[str, str],
        hold: Callable[[], None],
        release: Callable[[], None],
        reaped: Callable[[int], int | None],
    ) -> None:
        # What git needs of the supervisor's environment, and nothing that
        # would point it elsewhere (GIT_DIR, GIT_INDEX_FILE, ...).
        self.env = {k: v for k, v in environ.items() if k in ("PATH", "HOME", "USER", "TMPDIR")}
        self.env.update(LC_ALL="C", GIT_TERMINAL_PROMPT="0")
        self.env.setdefault("PATH", os.defpath)
        self.hold = hold
        self.release = release
        self.reaped = reaped

    async def run(self, repo: str, *args: str, timeout: float = GIT_TIMEOUT) -> GitResult:
        """`git -C repo args...` running none of the programs a repository
        can name (SAFE_CONFIG); its exit code and output."""
        argv = ["git", *SAFE_CONFIG, "-C", repo, *args]
        read_fd, write_fd = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        self.hold()
        try:
            try:
                pid = os.posix_spawnp(
                    "git",
                    argv,
                    self.env,
                    file_actions=[
                        (os.POSIX_SPAWN_DUP2, null, 0),
                        (os.POSIX_SPAWN_DUP2, write_fd, 1),
                        (os.POSIX_SPAWN_DUP2, write_fd, 2),
                    ],
                    setsid=True,
                )
            except OSError as exc:
                raise WorktreeError(f"cannot run git: {exc.strerror or exc}") from None
            finally:
                os.close(write_fd)
                os.close(null)
            output = await self._read(read_fd, pid, timeout)
            code = await self._wait(pid)
        finally:
            os.close(read_fd)
            self.release()
        return GitResult(code, output.decode("utf-8", "replace"))

    async def _read(self, fd: int, pid: int, timeout: float) -> bytes:
        """Everything git writes, until it closes its end (or is killed
        for taking longer than `timeout`)."""
        loop = asyncio.get_running_loop()
        os.set_blocking(fd, False)
        chunks: list[bytes] = []
        size = 0
        done = loop.create_future()

        def readable() -> None:
            nonlocal size
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                return
            except OSError:
                chunk = b""
            if not chunk:
                loop.remove_reader(fd)
                if not done.done():
                    done.set_result(None)
                return
            if size < MAX_GIT_OUTPUT:
                chunks.append(chunk)
                size += len(chunk)

        loop.add_reader(fd, readable)
        try:
            await asyncio.wait_for(done, timeout)
        except TimeoutError:
            loop.remove_reader(fd)
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
            chunks.append(f"\ngit took longer than {timeout:g}s and was killed".encode())
        return b"".join(chunks)

    async def _wait(self, pid: int) -> int:
        """git's exit code, reaped here or by the supervisor's reaper."""
        delay = 0.001
        while True:
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                reaped = self.reaped(pid)
                return 255 if reaped is None else os.waitstatus_to_exitcode(reaped)
            if done:
                return os.waitstatus_to_exitcode(status)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)


# -------------------------------------------------------------- worktrees


class Worktrees:
    """Sessions' worktrees, made and removed one repository at a time."""

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
        """A git command that changes the repository, tried again while
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

    async def ensure(self, repo: str, workspace: Path, branch: str) -> bool:
        """Make `workspace` a worktree of `repo` on `branch` (its own branch
        from the repository's HEAD, or the existing branch of that name)
        unless it is one already; True if it was made now. WorktreeError
        says why it cannot be."""
        problem = repository_problem(repo)
        if problem is not None:
            raise WorktreeError(problem)
        async with self._lock(repo):
            if worktree_ready(workspace):
                return False
            started = time.monotonic()
            if workspace.exists() and any(workspace.iterdir()):
                if not (workspace / ".git").is_file():
                    # Files that are no worktree's: never ours to delete.
                    raise WorktreeError(
                        f"{workspace} holds files but is no git worktree; move them away "
                        "(or kill --purge the session) to let it start"
                    )
                # Left half made (a crash during `git worktree add`): start over.
                await self.git.run(repo, "worktree", "remove", "--force", "--force", str(workspace))
                await asyncio.to_thread(shutil.rmtree, workspace, True)
            # Worktrees whose directories are gone (purged, or lost with a
            # crash) would block a new one of the same branch or path.
            await self._git(repo, "worktree", "prune")
            known = await self.git.run(
                repo, "rev-parse", "--verify", "--quiet", f"refs/heads/{branch}"
            )
            if known.code == 0:
                args = ["worktree", "add", str(workspace), branch]
            else:
                args = ["worktree", "add", "-b", branch, str(workspace), "HEAD"]
            made = await self._git(repo, *args)
            if made.code != 0:
                head = await self.git.run(repo, "rev-parse", "--verify", "--quiet", "HEAD^{commit}")
                if head.code != 0:
                    raise WorktreeError(
                        f"{repo} has no commit yet to start a session's branch from; "
                        "make a first commit"
                    )
                raise WorktreeError(f"git worktree add in {repo} failed: {made.last_line}")
            log.info(
                kv(
                    "worktree_added",
                    repo=repo,
                    branch=branch,
                    ms=round((time.monotonic() - started) * 1000),
                )
            )
            return True

    async def remove(
        self, repo: str, workspace: Path, branch: str, delete_branch: bool
    ) -> list[str]:
        """Remove a session's worktree (uncommitted changes and all), prune,
        and delete its branch only if asked; what could not be done, as
        sentences (the caller deletes the directory all the same)."""
        problems: list[str] = []
        if repository_problem(repo) is not None:
            return [f"repository {repo} is gone: nothing to remove there"]
        async with self._lock(repo):
            if workspace.exists():
                gone = await self._git(
                    repo, "worktree", "remove", "--force", "--force", str(workspace)
                )
                if gone.code != 0:
                    problems.append(f"git worktree remove: {gone.last_line}")
                    await asyncio.to_thread(shutil.rmtree, workspace, True)
            pruned = await self._git(repo, "worktree", "prune")
            if pruned.code != 0:
                problems.append(f"git worktree prune: {pruned.last_line}")
            if delete_branch:
                deleted = await self._git(repo, "branch", "-D", branch)
                if deleted.code != 0:
                    problems.append(f"branch {branch} kept: {deleted.last_line}")
        log.info(kv("worktree_removed", repo=repo, branch=branch, branch_deleted=delete_branch))
        return problems


# ------------------------------------------------------------------ peers


@dataclass(frozen=True)
class Peer:
    """Another live session on the same repository."""

    key: str
    branch: str
    state: str
    label: str | None


def peers_text(key: str, repo: str, branch: str, peers: list[Peer], now: float) -> str:
    """The peers file: comment lines for a person or an agent, then one
    tab-separated line per peer (session, branch, state, label or -)."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))
    lines = [
        f"# hermes-sup: other live sessions working on the repository {repo}, as of {stamp}",
        "# (rewritten at the start of each of your turns).",
        f"# You are session {key}, on branch {branch}, in a git worktree of your own.",
        "# Each session below works in its own worktree on its own branch: its uncommitted",
        "# changes are not in yours, nor yours in its. Share work through commits.",
    ]
    if not peers:
        lines.append("# No other session is live on this repository now.")
    else:
        lines.append("# session\tbranch\tstate\tlabel")
        lines += [f"{p.key}\t{p.branch}\t{p.state}\t{p.label or '-'}" for p in peers]
    return "\n".join(lines) + "\n"


def write_peers(session_dir: Path, text: str) -> None:
    """Write `workspace/.hermes-sup/peers` of the session in `session_dir`
    (atomically), with a `.gitignore` that keeps the directory out of git.
    Opened a directory at a time, never following a symlink: the worktree
    belongs to the session, which could have put one there. OSError if it
    cannot be written."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    top = os.open(session_dir, flags)
    try:
        workspace = os.open("workspace", flags, dir_fd=top)
    finally:
        os.close(top)
    try:
        try:
            os.mkdir(PEERS_DIR, 0o755, dir_fd=workspace)
        except FileExistsError:
            pass
        own = os.open(PEERS_DIR, flags, dir_fd=workspace)
    finally:
        os.close(workspace)
    try:
        # Readable, not writable, by the session: a sealed worker runs as a
        # uid of its own (worker/seal.py), and the directories above are
        # private to it and the service user either way.
        os.fchmod(own, 0o755)
        _write_at(own, ".gitignore", "# hermes-sup's own files, not the project's\n*\n", keep=True)
        _write_at(own, PEERS_FILE, text, keep=False)
    finally:
        os.close(own)


def _write_at(dir_fd: int, name: str, text: str, keep: bool) -> None:
    """Write `name` in the directory `dir_fd` through a new temporary file
    renamed over it; with `keep`, leave an existing one as it is."""
    if keep:
        try:
            os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            return
        except FileNotFoundError:
            pass
    tmp = f".{name}.tmp"
    try:
        os.unlink(tmp, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    fd = os.open(
        tmp,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
        0o600,
        dir_fd=dir_fd,
    )
    try:
        os.fchmod(fd, 0o644)  # see write_peers
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
