"""A session's workspace as a git repository of its own that borrows the
shared repository's objects, and the list of its peers (the other sessions
on its repository). (Its home seeded from a template is homes.py; what the
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

The supervisor's own git runs with a configuration of its own (SAFE_CONFIG)
that runs nothing a repository may name, with `safe.directory` naming the
one repository it works in. Every git command that changes the shared
repository runs under one asyncio lock per repository (its common git
directory), without blocking the event loop for anything else.

git runs as a child of the supervisor, which reaps every child itself
(server.py) and kills children that are no worker's (pool.py's orphan
cull). `GitRunner` therefore spawns git with posix_spawn (no Popen
bookkeeping), reads its output without blocking, and takes its exit status
from whichever of the two reaps it, while holding off the cull.

A crash leaves nothing that is not made again: a session's repository is
made beside the workspace (`.git` in a directory of the session's own,
`MAKING`) and renamed into it last, so a workspace either has its finished
repository or is made again from the start. A session made by an earlier
version (a linked worktree of the shared repository) is turned into one of
its own at its next start, its branch, index and files as they were.

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
import shlex
import shutil
import signal
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from hermes_sup.local.logfmt import kv

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
PEERS_DIR = ".hermes-sup"
PEERS_FILE = "peers"
GIT_TIMEOUT = 120.0
# git's own lock files, should something outside the supervisor hold one.
LOCK_RETRIES = 5
LOCK_ERRORS = ("index.lock", ".lock': File exists", "cannot lock ref", "Unable to create")
MAX_GIT_OUTPUT = 64 * 1024
# Where git and its children find a session's repository handed to them
# open (GitRunner.run's pass_fds, and on).
PASSED_FD = 3


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


def owner_prefix(st: os.stat_result) -> list[str]:
    """What runs a command as the user who owns a session's repository
    (`st`: its git directory's stat; its own uid, sealed as root), nothing
    when that is us already. git on a session's repository runs as its
    owner, never as root: the files are the session's, and so is anything
    it could make git do."""
    if st.st_uid == os.geteuid():
        return []
    return [
        "setpriv",
        f"--reuid={st.st_uid}",
        f"--regid={st.st_gid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--no-new-privs",
        "--",
    ]


# The environment of git run as a session's uid: none of the supervisor's
# configuration to read (root's HOME is not its to read).
OWNER_ENV = ("HOME=/nonexistent", "XDG_CONFIG_HOME=/nonexistent", "GIT_CONFIG_NOSYSTEM=1")


def open_session_git(workspace: Path) -> tuple[int, os.stat_result]:
    """An open descriptor of a session's git directory, and its stat. Its
    workspace is in the session's directory, which only the supervisor may
    change, but `.git` in it is the session's: opened without following a
    symlink, so a `.git` that names another directory is refused (OSError)."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    top = os.open(workspace, flags)
    try:
        fd = os.open(".git", flags, dir_fd=top)
    finally:
        os.close(top)
    return fd, os.fstat(fd)


def in_owner_view(
    st: os.stat_result,
    fd: int,
    trusted: Mapping[str, str],
    argv: Callable[[Mapping[str, str]], list[str]],
) -> str:
    """A shell command that runs `argv(paths)` as the owner of a session's
    directory open as descriptor `fd` (`st`: its stat), where `paths` names
    where it finds that directory ("session") and each of the `trusted`
    ones (paths only the supervisor and the operator choose). Root hands
    them over in a mount namespace of the command's own, a tmpfs over /tmp
    with each bound there: the session's uid may not pass through the
    session's directory (the supervisor's), nor perhaps to the shared
    repository. (The session's is entered as the working directory before
    the namespace is made, the one way a directory opened outside it can be
    bound inside.) The owner being us, it reaches them itself."""
    if st.st_uid == os.geteuid():
        paths = {"session": f"/proc/self/fd/{fd}", **trusted}
        return shlex.join(["env", *OWNER_ENV, *argv(paths)])
    names = ["session", *trusted]
    paths = {name: f"/tmp/{name}" for name in names}
    opened = {"session": "."} | dict(trusted)
    steps = [f"exec {5 + i}< {shlex.quote(opened[n])}" for i, n in enumerate(names)]
    steps.append("mount -t tmpfs -o mode=0711,size=1m hermes-sup /tmp")
    for i, name in enumerate(names):
        steps += [
            f"mkdir -m 0755 /tmp/{name}",
            f"mount --no-canonicalize --bind /proc/self/fd/{5 + i} /tmp/{name}",
        ]
        if name != "session":
            steps.append(f"mount --no-canonicalize -o remount,bind,ro /tmp/{name}")
        steps.append(f"exec {5 + i}<&-")
    steps.append("cd /")
    steps.append("exec " + shlex.join(["env", *OWNER_ENV, *owner_prefix(st), *argv(paths)]))
    inner = " && ".join(steps)
    return f"cd /proc/self/fd/{fd} && exec " + shlex.join(
        ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", inner]
    )


def upload_pack_command(repo: str, fd: int, st: os.stat_result) -> str:
    """The `--upload-pack` of a fetch from a session's repository open as
    descriptor `fd` in git's children: git's upload-pack (made to serve
    repositories one does not trust), as the repository's owner
    (in_owner_view), the shared repository's objects found where that
    view has them. The path git adds after the command is left unused."""

    def argv(paths: Mapping[str, str]) -> list[str]:
        return [
            "env",
            f"GIT_ALTERNATE_OBJECT_DIRECTORIES={paths['objects']}",
            "git",
            *SAFE_CONFIG,
            "upload-pack",
            paths["session"],
        ]

    objects = str(Path(common_dir(repo)) / "objects")
    run = in_owner_view(st, fd, {"objects": objects}, argv)
    # The session's own alternates name the shared objects by a path the
    # owner may not reach: git says so on stderr, and finds them here.
    return f"serve() {{ {run} 2>/dev/null; }}; serve"


def fetch_args(repo: str, st: os.stat_result, *refspecs: str, fd: int = PASSED_FD) -> list[str]:
    """`git fetch` arguments that bring `refspecs` from a session's
    repository (`st`: its git directory's stat) into the shared one `repo`,
    to run there by the supervisor or the operator with the session's
    repository open as descriptor `fd`: the local file transport allowed
    for this one fetch, every object checked as it comes in, no tags."""
    return [
        "-c",
        "protocol.file.allow=always",
        "-c",
        "transfer.fsckObjects=true",
        "fetch",
        "--quiet",
        "--no-tags",
        "--no-write-fetch-head",
        f"--upload-pack={upload_pack_command(repo, fd, st)}",
        # Where upload-pack starts is its descriptor; git wants a path.
        f"/proc/self/fd/{fd}",
        *refspecs,
    ]


# -------------------------------------------------------------------- git


# What the supervisor's git runs with: none of the programs a repository's
# config may name is run (hooks, the file-system monitor, ssh, pager,
# editors, credential helpers, gpg, transports). Filters and diff drivers
# are named in the config too: sealed sessions cannot write the shared
# repository's (worker/seal_git.py shows them all of it read-only), and a
# session's own repository is read only as its owner (in_owner_view), with
# a configuration of ours, so only the operator's own would run as us.
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

    async def run(
        self, repo: str, *args: str, timeout: float = GIT_TIMEOUT, pass_fds: tuple[int, ...] = ()
    ) -> GitResult:
        """`git -C repo args...` running none of the programs a repository
        can name (SAFE_CONFIG); its exit code and output. `pass_fds`:
        descriptors git and its children have as PASSED_FD and on."""
        # safe.directory: the one repository named, whoever owns it (the
        # operator's, or a session's being made), and no other.
        trusted = ("-c", f"safe.directory={os.path.realpath(repo)}")
        argv = ["git", *SAFE_CONFIG, *trusted, "-C", repo, *args]
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
                        *(
                            (os.POSIX_SPAWN_DUP2, fd, PASSED_FD + i)
                            for i, fd in enumerate(pass_fds)
                        ),
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
        f"# You are session {key}, on branch {branch}, in a git repository of your own.",
        "# Each session below works in its own repository on its own branch: its commits",
        "# and uncommitted changes are not in yours, nor yours in its. The operator brings",
        "# each session's branch into the shared repository (its branches: shared/*).",
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
