"""How the supervisor runs git: with a configuration of its own that runs
nothing a repository may name (SAFE_CONFIG), as a child it reaps itself
(GitRunner), and in a session's repository as that repository's owner,
never as root (in_owner_view, fetch_args).

git runs as a child of the supervisor, which reaps every child itself
(server.py) and kills children that are no worker's (pool.py's orphan
cull). `GitRunner` therefore spawns git with posix_spawn (no Popen
bookkeeping), reads its output without blocking, and takes its exit status
from whichever of the two reaps it, while holding off the cull.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

GIT_TIMEOUT = 120.0
MAX_GIT_OUTPUT = 64 * 1024
# Where git and its children find a session's repository handed to them
# open (GitRunner.run's pass_fds, and on).
PASSED_FD = 3


class WorktreeError(Exception):
    """A repository or worktree that cannot be used; the message says why."""


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
