"""Sealed sessions: each worker in its own mount and PID namespaces, seeing
only its own session's files and processes, and the service's code.

The zygote forks a sealed worker into a PID namespace of its own (and, not
root, a user namespace: `namespaces_for`), so the worker is the init of its
session: the session's processes see no other process on the machine (its
/proc is the namespace's own), cannot name one to signal or trace it, and
all die with the worker, by the kernel's hand. Then the worker, while it is
still single-threaded (no zmq context, no thread: a user namespace cannot
be entered by a process with threads, and unshare(CLONE_NEWNS) moves only
the calling thread):

1. `enter`: a new mount namespace (root: unshare(CLONE_NEWNS); not root:
   in the user namespace it was born into, mapping our own uid and gid to
   themselves, never to 0, which would let the session's shell undo the
   mounts), `/` made private so nothing we mount reaches the host, a /proc
   of the worker's own PID namespace; then the bounding set
   emptied (before any setresuid: after it, PR_CAPBSET_DROP fails),
   no_new_privs, a Landlock domain that keeps signals (and abstract unix
   sockets) inside the session where the kernel has it, and a seccomp
   filter (no new namespaces, keyrings, bpf, ...: see
   hermes_sup.local.syscalls). All of these are per thread and inherited by
   threads created later, which is why they come before the zmq context
   starts its threads.
2. `mount_session`: a tmpfs of its own (size-limited) over /tmp, /var/tmp
   and /dev/shm; a read-only tmpfs over the data dir (every other session,
   the zygote's home), over the state dir (the signing key, the sockets)
   and over the workspace and repository roots; then bound back at their
   own paths only what this worker needs: its own session directory
   (read-only), the service's code if it lived under a hidden directory, a
   git worktree's common directory; and the session's home, workspace and
   HOME over the fixed paths P, W, U (`SealedPaths`) that the zygote
   imported under. Every path captured at import is then the session's own.
   The worker socket is not bound back: nothing in the session's view
   leads to it. A worker forked for a session keeps an O_PATH descriptor
   of it, connects through that (`/proc/self/fd/N`) and closes it once
   connected, before any of the session's code runs; a spare connected
   before its mounts. A session's shell (or code loaded into the worker
   later) has no path to any socket of the supervisor's, so it cannot
   open connections to exhaust its descriptors.
3. `drop`: as root, setgroups([]), setresgid/setresuid to the session's
   own uid (glibc applies them to every thread: a spare's zmq threads
   too), capabilities cleared; not root, capabilities cleared. The
   parent-death signal is cleared by the kernel when credentials change:
   the caller sets it again. Only then does a forked worker create its zmq
   context and connect: as root,
   the supervisor made the worker socket connectable by any uid
   (supervisor/sealing.py says why only sealed workers could reach it).

Any failing step raises SealError and the worker exits with
WorkerExit.SEAL_FAILED before any runtime code runs: it never runs against
the zygote's paths or with other sessions' files in view (fail closed).

The system calls themselves (unshare, mount, capset, Landlock) and their
constants are hermes_sup.local.syscalls; this module is the plan of what a
sealed worker mounts, hides and drops.
"""

from __future__ import annotations

import errno
import functools
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hermes_sup.local import syscalls
from hermes_sup.local.prctl import prctl
from hermes_sup.local.syscalls import (
    CLONE_NEWIPC,
    CLONE_NEWNET,
    CLONE_NEWNS,
    CLONE_NEWPID,
    CLONE_NEWUSER,
    LANDLOCK_SCOPE_ABI,
    MOUNT_ATTR_RDONLY,
    MS_BIND,
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    MS_PRIVATE,
    MS_RDONLY,
    MS_REC,
    MS_REMOUNT,
    PR_CAP_AMBIENT,
    PR_CAP_AMBIENT_CLEAR_ALL,
    PR_CAPBSET_DROP,
    PR_SET_DUMPABLE,
    PR_SET_NO_NEW_PRIVS,
    landlock_abi,
)

from .seal_calls import (
    MOUNTPOINT_MODE,
    SealError,
    _capset_zero,
    _check_fault,
    _fail,
    _makedirs,
    _mount,
    _open_path,
    _remount_readonly,
    _remount_writable,
    _under,
    _unshare,
    _write,
)
from .seal_git import _protect_git, git_common_dir, own_worktree_admin

# The tmpfs over what a session may not see: empty, tiny, read-only once
# its mount points are made.
TMPFS_FLAGS = MS_NOSUID | MS_NODEV | MS_NOEXEC
TMPFS_DATA = f"mode={MOUNTPOINT_MODE:o},size=64k"
MODES = ("root", "user")
# A session's own /proc: of its PID namespace, nothing in it to execute.
PROC_FLAGS = MS_NOSUID | MS_NODEV | MS_NOEXEC
# The session's /tmp when it is a tmpfs (plan["tmp_bytes"]): a /tmp as any
# program expects it, in the session's view only.
TMP_FLAGS = MS_NOSUID | MS_NODEV

# The namespaces this worker was born into (set by the zygote in the child,
# right after the clone: `born`), its pid as the supervisor sees it (in its
# own PID namespace it is 1), and its uid and gid outside a user namespace
# it was born into (inside, until mapped, they read as 65534).
BORN_INTO = 0
_OUTSIDE_PID: int | None = None
_OUTSIDE_IDS: tuple[int, int] | None = None


@dataclass(frozen=True)
class SealedPaths:
    """The fixed paths the zygote imports under and every sealed worker
    finds its own session's directories at: P (HERMES_HOME), W (the
    workspace and cwd), U (HOME)."""

    home: Path
    workspace: Path
    user: Path

    @classmethod
    def for_data_dir(cls, data_dir: str | os.PathLike[str]) -> SealedPaths:
        base = Path(data_dir) / "sealed"
        return cls(home=base / "home", workspace=base / "workspace", user=base / "user")

    def make(self) -> None:
        """Create the three (empty) directories, as the zygote does."""
        for path in (self.home, self.workspace, self.user):
            path.mkdir(mode=0o700, parents=True, exist_ok=True)


@dataclass(frozen=True)
class SessionDirs:
    """One session's own directories, at their real paths."""

    dir: Path  # the session's directory under <data>/sessions
    home: Path
    workspace: Path
    tmp: Path
    user: Path  # its HOME


# ------------------------------------------------------------------ syscalls


def _signal_ruleset(step: str) -> int:
    """A Landlock ruleset that scopes signals and abstract unix sockets."""
    try:
        return syscalls.signal_ruleset()
    except OSError as exc:
        raise _fail(step, "landlock_create_ruleset(scoped signals)", exc.errno) from None


# Made once by the zygote (`prepare`), inherited by every worker it forks
# (close-on-exec: nothing a session runs holds it).
_RULESET_FD: int | None = None


def _scope_signals(step: str) -> bool:
    """Keep this thread (and what it starts) from signalling processes
    outside its own Landlock domain. False where the kernel cannot."""
    global _RULESET_FD
    if landlock_abi() < LANDLOCK_SCOPE_ABI:
        return False
    fd = _RULESET_FD
    _RULESET_FD = None  # this process's copy: used once, then closed
    if fd is None:
        fd = _signal_ruleset(step)
    try:
        syscalls.landlock_restrict_self(fd)
    except OSError as exc:
        raise _fail(step, "landlock_restrict_self", exc.errno) from None
    finally:
        os.close(fd)
    return True


# ------------------------------------------------------------------- stages


def namespaces_for(mode: str) -> int:
    """The CLONE_NEW* flags the zygote forks a sealed worker with: a PID
    namespace, and not root a user namespace to own it (an unprivileged
    process may make a PID namespace only together with one)."""
    return CLONE_NEWPID if mode == "root" else CLONE_NEWUSER | CLONE_NEWPID


def born(flags: int, ids: tuple[int, int]) -> None:
    """In a worker just forked into the namespaces `flags`: remember them,
    our uid and gid before the fork (`ids`), and the pid the supervisor
    knows us by, read while /proc is still the supervisor's (our own
    replaces it in `enter`)."""
    global BORN_INTO, _OUTSIDE_PID, _OUTSIDE_IDS
    BORN_INTO, _OUTSIDE_IDS = flags, ids
    if flags & CLONE_NEWPID:
        _OUTSIDE_PID = int(os.readlink("/proc/self"))


def outside_pid() -> int:
    """This process's pid as the supervisor sees it."""
    return _OUTSIDE_PID if _OUTSIDE_PID is not None else os.getpid()


def mode_for_this_process() -> str:
    """ "root" where we may set up the namespace and change uid ourselves
    (euid 0), "user" otherwise (a user namespace of our own)."""
    return "root" if os.geteuid() == 0 else "user"


# What a session's network may be (supervisor/config.py's `network`):
# "egress" and "none" give the worker a network namespace of its own with
# only `lo` (the supervisor's proxy is its way out, or its only peer);
# "host" leaves it in the host's, as unsealed workers are.
NETWORKS = ("egress", "none", "host")


def namespaces_entered(network: str) -> int:
    """The namespaces `enter` makes besides the mount namespace: always IPC
    (System V objects and POSIX queues of its own, gone with the session),
    and a network namespace unless the network is the host's."""
    return CLONE_NEWIPC | (0 if network == "host" else CLONE_NEWNET)


def enter(mode: str, fault: str | None = None, network: str = "egress") -> dict[str, Any]:
    """Stage 1: the namespaces, / private, and what must be set while this
    process has one thread. Returns what was done (for logs)."""
    if mode not in MODES:
        raise SealError("unshare", f"unknown sealing mode {mode!r}")
    if network not in NETWORKS:
        raise SealError("network", f"unknown network {network!r} (one of {', '.join(NETWORKS)})")
    more = namespaces_entered(network)
    if len(os.listdir("/proc/self/task")) != 1:
        raise SealError("unshare", "the worker already has threads; sealing needs one")
    uid, gid = os.getuid(), os.getgid()
    _check_fault("unshare", fault)
    if mode == "root":
        _unshare("unshare", CLONE_NEWNS | more)
    else:
        if not BORN_INTO & CLONE_NEWUSER:
            _unshare("unshare", CLONE_NEWUSER)
        elif _OUTSIDE_IDS is not None:
            # Born into it: until the map is written we are nobody there.
            uid, gid = _OUTSIDE_IDS
        _check_fault("map", fault)
        # Our own ids to themselves: inside, we are who we were, so a program
        # we exec has no capabilities (a map to 0 would give it all of them).
        _write("map", "/proc/self/setgroups", "deny")
        _write("map", "/proc/self/uid_map", f"{uid} {uid} 1\n")
        _write("map", "/proc/self/gid_map", f"{gid} {gid} 1\n")
        # Owned by our user namespace, where we still hold every capability:
        # enough to bring its loopback up and mount its mqueue.
        _unshare("unshare", CLONE_NEWNS | more)
    if more & CLONE_NEWNET:
        # Only `lo`, and down until we bring it up: nothing of the host's
        # or another session's loopback, no host socket in /proc/net.
        _check_fault("network", fault)
        try:
            syscalls.loopback_up()
        except OSError as exc:
            raise _fail("network", "bring lo up", exc.errno) from None
    _check_fault("private", fault)
    _mount("private", None, "/", None, MS_REC | MS_PRIVATE)
    if BORN_INTO & CLONE_NEWPID:
        # /proc of our own PID namespace: the session's processes only.
        _check_fault("proc", fault)
        _mount("proc", "proc", "/proc", "proc", PROC_FLAGS)
    _check_fault("harden", fault)
    # The bounding set first: once our uid is not 0 we could not drop it.
    # It and no_new_privs only limit what an exec may gain; our effective
    # capabilities (mount, chown, setuid) stay until `drop`.
    for cap in range(syscalls.last_cap() + 1):
        try:
            prctl(PR_CAPBSET_DROP, cap)
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # a number this kernel does not know
                raise SealError(
                    "harden", f"prctl(PR_CAPBSET_DROP, {cap}): {exc.strerror}"
                ) from None
    try:
        prctl(PR_SET_NO_NEW_PRIVS, 1)
    except OSError as exc:
        raise SealError("harden", f"prctl(PR_SET_NO_NEW_PRIVS): {exc.strerror}") from None
    scoped = _scope_signals("harden")
    # The seccomp filter now, while we have one thread (a spare's zmq
    # threads inherit it): it keeps mount, which the session's mounts still
    # need; a session has no capability left to mount with.
    _check_fault("filter", fault)
    if syscalls.seccomp_supported():
        try:
            syscalls.restrict_syscalls()
        except OSError as exc:
            raise _fail("filter", "seccomp filter", exc.errno) from None
    return {"mode": mode, "signals_scoped": scoped, "network": network}


# What no session may see of a temporary directory shared by the machine.
COMMON_TMP = (Path("/tmp"), Path("/var/tmp"), Path("/dev/shm"))


@dataclass(frozen=True)
class View:
    """What every session of one supervisor's settings hides (tmpfs over
    each, shallowest first) and which of the service's code comes back at
    its own path (read-only): the same for all its sessions, so worked out
    once (a spare, before it has a session)."""

    hidden: tuple[Path, ...]
    code: tuple[Path, ...]


@functools.lru_cache(maxsize=4)
def view_for(
    mode: str, data_dir: str, state_dir: str, hide: tuple[str, ...], shared: tuple[str, ...]
) -> View:
    """The View of a plan's settings (`shared`: the directories every
    session reads, such as an agent's template home, that exist)."""
    shared_paths = [Path(p) for p in shared]
    codes = (*code_paths(), *shared_paths)
    own = [Path(data_dir), Path(state_dir)]
    hide_set = {*own, *(Path(p) for p in hide)}
    if mode == "root":
        hide_set |= _closed_code_ancestors() | closed_ancestors(shared_paths)
    hidden = tuple(sorted(hide_set, key=lambda p: len(p.parts)))
    code = []
    for path in codes:
        if _under(path, own) or any(_under(p, [path]) for p in own):
            continue  # nothing of the data or state dir comes back this way
        # Hidden code comes back; not root, all of it comes back read-only:
        # the session's uid may own it, and a worker must not change what
        # the next supervisor or zygote will run.
        if mode == "user" or _under(path, [*hidden, *COMMON_TMP]):
            code.append(path)
    return View(hidden=hidden, code=tuple(code))


def plan_view(plan: dict[str, Any]) -> View:
    """The View of a sealing plan (or of a spare's, which carries the same
    settings: see supervisor/sealing.py)."""
    shared = tuple(p for p in plan.get("read", ()) if os.path.isdir(p))
    return view_for(
        plan["mode"], plan["data_dir"], plan["state_dir"], tuple(plan.get("hide", ())), shared
    )


@functools.cache
def code_paths() -> tuple[Path, ...]:
    """Where this worker's code comes from: the interpreter's prefixes,
    the directories on sys.path, and this package. Not sys.path[0]: under
    `python -m` that is only the directory the service was started in."""
    found: list[Path] = []
    for raw in (sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path[1:]):
        if raw and os.path.isdir(raw):
            found.append(Path(os.path.realpath(raw)))
    found.append(Path(os.path.realpath(__file__)).parent.parent)
    unique: list[Path] = []
    for path in sorted(set(found), key=lambda p: len(p.parts)):
        if not _under(path, unique):
            unique.append(path)
    return tuple(unique)


@functools.cache
def _closed_code_ancestors() -> frozenset[Path]:
    return frozenset(closed_ancestors(code_paths()))


def prepare() -> None:
    """In the zygote, before it forks: what every sealed worker would
    work out the same way (where the code is, the kernel's last capability
    and Landlock version), so no worker spends its start on it."""
    global _RULESET_FD
    code_paths()
    _closed_code_ancestors()
    syscalls.last_cap()
    if syscalls.seccomp_supported():
        syscalls.filter_program()
    if landlock_abi() >= LANDLOCK_SCOPE_ABI and _RULESET_FD is None:
        try:
            _RULESET_FD = _signal_ruleset("harden")
        except SealError:
            pass  # each worker tries for itself, and says why if it fails


def closed_ancestors(paths: Iterable[Path]) -> set[Path]:
    """The highest directory above each path that other users cannot pass
    through (e.g. /root, when the interpreter is in /root/.pyenv). Hidden
    under a tmpfs that others may pass through, with the path bound back,
    the code becomes reachable by a session's own uid, and nothing else of
    that directory does."""
    closed: set[Path] = set()
    for path in paths:
        for parent in reversed(path.parents):
            if parent == Path("/"):
                continue
            try:
                if not os.stat(parent).st_mode & 0o001:
                    closed.add(parent)
                    break
            except OSError:
                break
    return closed


# The lock directories a session gets a tmpfs of its own over (/var/lock
# is mostly a link to /run/lock): writable by every uid on the host, so
# what a session leaves there would outlive it.
LOCK_DIRS = ("/run/lock", "/var/lock")
LOCK_TMPFS_DATA = "mode=1777,size=1m"


def _lock_dirs() -> list[Path]:
    found: list[Path] = []
    for raw in LOCK_DIRS:
        path = Path(os.path.realpath(raw))
        if path.is_dir() and path not in found:
            found.append(path)
    return found


def _read_only_root(step: str) -> None:
    """Every mount of this (private) namespace read-only, in one call where
    the kernel has mount_setattr (5.12), else one remount each. Our own
    /proc stays writable: programs set their own oom_score_adj, comm, ..."""
    try:
        syscalls.mount_setattr_tree("/", MOUNT_ATTR_RDONLY)
    except OSError as exc:
        if exc.errno != errno.ENOSYS:
            raise _fail(step, "mount_setattr(/, read-only, recursive)", exc.errno) from None
        for target in _mount_points():
            _remount_readonly(step, target)
    if BORN_INTO & CLONE_NEWPID:
        _remount_writable(step, Path("/proc"))


def _mount_points() -> list[Path]:
    """This namespace's mount points, from /proc/self/mountinfo."""
    points: list[Path] = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4:
                # Octal escapes (\040 for a space) as the kernel writes them.
                points.append(Path(fields[4].encode().decode("unicode_escape")))
    return points


def mount_session(
    plan: dict[str, Any], dirs: SessionDirs, paths: SealedPaths, keep_socket: bool = False
) -> dict[str, Any]:
    """Stage 2: hide what is shared, bind back what this session needs,
    put its directories over the fixed paths, chdir to W. `keep_socket`:
    return an O_PATH descriptor of the worker socket as "socket_fd" (for a
    worker that has yet to connect; it must close it once connected)."""
    fault = plan.get("fault")
    data_dir = Path(plan["data_dir"])
    state_dir = Path(plan["state_dir"])
    tmp_bytes = int(plan.get("tmp_bytes") or 0)
    # Taken before any mount: a path may be hidden by the time it is bound.
    fds: dict[str, int] = {}
    socket_fd: int | None = None
    umask = os.umask(0)  # mount points get exactly MOUNTPOINT_MODE
    try:
        if keep_socket:
            socket_fd = _open_path("session", Path(plan["socket"]))
        for name, path in (
            ("home", dirs.home),
            ("workspace", dirs.workspace),
            ("user", dirs.user),
            ("dir", dirs.dir),
        ):
            fds[name] = _open_path("session", path)
        if not tmp_bytes:
            fds["tmp"] = _open_path("session", dirs.tmp)
        view = plan_view(plan)
        hidden = view.hidden
        # Nothing of the host is writable from here on but what is mounted
        # below for the session: its own directories, its tmp, its locks.
        # (Files a session wrote to /run/lock or into a directory its uid
        # owns would outlive it, or run as the service at its next start.)
        _check_fault("readonly", fault)
        _read_only_root("readonly")
        # What must stay at its own path: (name, source, target, read-only).
        keep: list[tuple[str, Path, bool]] = [("dir", dirs.dir, True)]
        if not _under(dirs.workspace, [dirs.dir]):
            keep.append(("workspace", dirs.workspace, False))
        repos = [Path(r) for r in plan.get("repos", ()) if r]
        common = git_common_dir(dirs.workspace, repos) if repos else None
        if common is not None and (_under(common, [data_dir, state_dir]) or not common.is_dir()):
            common = None
        if common is not None:
            fds["git"] = _open_path("session", common)
            keep.append(("git", common, False))
        # The service's code (and what every session reads) that is hidden.
        for i, code in enumerate(view.code):
            fds[f"code{i}"] = _open_path("session", code)
            keep.append((f"code{i}", code, True))

        # The session's tmp is every shared temporary directory: a tmpfs of
        # its own, bounded and gone with the session's last process, or
        # (tmp_bytes 0) its tmp/ on disk.
        _check_fault("tmp", fault)
        if tmp_bytes:
            _mount("tmp", "tmpfs", "/tmp", "tmpfs", TMP_FLAGS, f"mode=1777,size={tmp_bytes}")
            tmp_src = "/tmp"
        else:
            tmp_src = f"/proc/self/fd/{fds['tmp']}"
        for common_tmp in ("/tmp", "/var/tmp", "/dev/shm"):
            if os.path.isdir(common_tmp) and (common_tmp, tmp_src) != ("/tmp", "/tmp"):
                _mount("tmp", tmp_src, common_tmp, None, MS_BIND)
                if not tmp_bytes:  # a bind of the (now read-only) disk
                    _remount_writable("tmp", Path(common_tmp))
        # Lock directories every program may write: the session's own,
        # small, gone with it. And its IPC namespace's message queues where
        # the host shows them.
        for lock_dir in _lock_dirs():
            _mount("tmp", "tmpfs", str(lock_dir), "tmpfs", TMPFS_FLAGS, LOCK_TMPFS_DATA)
        if os.path.isdir("/dev/mqueue"):
            _mount("tmp", "mqueue", "/dev/mqueue", "mqueue", TMPFS_FLAGS)

        # Read-only empty directories over what no session may see.
        _check_fault("hide", fault)
        tmpfs: list[Path] = []
        for path in hidden:
            _makedirs("hide", path)
            _mount("hide", "tmpfs", str(path), "tmpfs", TMPFS_FLAGS, TMPFS_DATA)
            tmpfs.append(path)

        # The session's directories over the fixed paths.
        _check_fault("session", fault)
        for name, target in (
            ("home", paths.home),
            ("workspace", paths.workspace),
            ("user", paths.user),
        ):
            _makedirs("session", target)
            _mount("session", f"/proc/self/fd/{fds[name]}", str(target), None, MS_BIND | MS_REC)
            _remount_writable("session", target)

        # What stays visible at its own path, shallowest first.
        _check_fault("bind", fault)
        for name, path, readonly in sorted(keep, key=lambda k: len(k[1].parts)):
            hidden_here = _under(path, [*hidden, *COMMON_TMP])
            if not hidden_here and not name.startswith("code") and readonly:
                continue  # never hidden, and read-only with the rest of /
            _makedirs("bind", path)
            _mount("bind", f"/proc/self/fd/{fds[name]}", str(path), None, MS_BIND | MS_REC)
            if readonly:
                _remount_readonly("bind", path)
            else:
                _remount_writable("bind", path)
        for path in tmpfs:  # ours: no flags to keep but those we gave
            _mount("hide", None, str(path), None, MS_REMOUNT | MS_BIND | MS_RDONLY | TMPFS_FLAGS)
        if common is not None:
            _protect_git(common, dirs.workspace)
    except BaseException:
        if socket_fd is not None:
            os.close(socket_fd)
        raise
    finally:
        os.umask(umask)
        for fd in fds.values():
            os.close(fd)
    try:
        os.chdir(paths.workspace)
    except OSError as exc:
        if socket_fd is not None:
            os.close(socket_fd)
        raise SealError("session", f"chdir {paths.workspace}: {exc.strerror}") from None
    return {"hidden": [str(p) for p in hidden], "socket_fd": socket_fd}


def chown_session(
    dirs: SessionDirs,
    uid: int,
    gid: int,
    repos: Iterable[str | os.PathLike[str]] = (),
    tmp: bool = True,
) -> None:
    """Give the session's uid its own directories (as root, before `drop`).
    Whole trees only when their top is not the uid's yet (the first sealed
    start of a session): later starts touch four inodes. Its session
    directory itself stays root's: session.json and the logs are the
    supervisor's. A git worktree workspace's own directory in the
    repository (`worktrees/<name>`) is the session's too: git refuses to
    work in a worktree whose directories another user owns. `tmp`: its tmp/
    on disk is its /tmp (not a tmpfs)."""
    tops = [dirs.home, dirs.workspace, dirs.user, *([dirs.tmp] if tmp else [])]
    repo_paths = [Path(r) for r in repos if r]
    common = git_common_dir(dirs.workspace, repo_paths) if repo_paths else None
    admin = own_worktree_admin(common, dirs.workspace) if common is not None else None
    if admin is not None:
        tops.append(admin)
    for top in tops:
        try:
            st = os.lstat(top)
            if st.st_uid == uid and st.st_gid == gid:
                continue
            os.lchown(top, uid, gid)
            with os.scandir(top) as entries:
                if next(entries, None) is None:
                    continue  # a new session's: empty
            for root, subdirs, files in os.walk(top):
                os.lchown(root, uid, gid)
                for name in subdirs + files:
                    os.lchown(os.path.join(root, name), uid, gid)
        except OSError as exc:
            raise SealError("session", f"chown {top} to {uid}:{gid}: {exc.strerror}") from None


def drop(
    mode: str,
    uid: int | None = None,
    gid: int | None = None,
    fault: str | None = None,
    groups: Iterable[int] = (),
) -> None:
    """Stage 3: the session's own uid (root), in `groups` besides its own,
    and no capabilities left."""
    _check_fault("drop", fault)
    if mode == "root":
        if uid is None or gid is None or uid == 0 or gid == 0:
            raise SealError(
                "drop", f"a sealed root worker needs its own uid and gid, not {uid}:{gid}"
            )
        try:
            os.setgroups([g for g in groups if g != 0])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)  # glibc: on every thread of ours
        except OSError as exc:
            raise SealError("drop", f"switch to uid {uid} gid {gid}: {exc.strerror}") from None
    try:
        prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    except OSError as exc:
        raise SealError("drop", f"clear ambient capabilities: {exc.strerror}") from None
    _capset_zero("drop")
    # Not dumpable (a uid change made a root worker so already; a user
    # namespace's is not): the session's own shell runs as our uid, and a
    # dumpable worker's memory (/proc/1/mem, process_vm_readv, ptrace) is
    # open to it, and whatever secret the runtime holds with it. Programs
    # we exec are dumpable again (execve resets it), as they should be.
    prctl(PR_SET_DUMPABLE, 0)
    if mode == "root" and (os.getuid(), os.geteuid()) != (uid, uid):
        raise SealError("drop", f"still uid {os.getuid()}/{os.geteuid()}")


def probe(
    mode: str,
    scratch: Path,
    uid: int | None,
    gid: int | None,
    fault: str | None,
    network: str = "host",
) -> dict[str, Any]:
    """What the supervisor's start-up check runs in a child of its own: the
    same kinds of steps as a worker (namespace, tmpfs, bind, read-only
    remount, the drop), on a scratch directory. Raises SealError."""
    # A session's uid must be able to read the code itself (the directories
    # above it it will pass through: see closed_ancestors).
    unreadable = [str(p) for p in code_paths() if os.stat(p).st_mode & 0o005 != 0o005]
    done = enter(mode, fault, network)
    _check_fault("readonly", fault)
    _read_only_root("readonly")
    _check_fault("hide", fault)
    _mount("hide", "tmpfs", str(scratch), "tmpfs", MS_NOSUID | MS_NODEV, "mode=0711,size=64k")
    inner = scratch / "bound"
    _makedirs("bind", inner)
    _check_fault("bind", fault)
    _mount("bind", "/proc/self", str(inner), None, MS_BIND)
    _remount_readonly("bind", inner)
    _remount_readonly("hide", scratch)
    drop(mode, uid, gid, fault)
    if mode == "root" and unreadable:
        raise SealError(
            "drop",
            f"the service's code is not readable by the sessions' uid {uid}: "
            f"{', '.join(unreadable)} (install it where others may read it, e.g. /opt)",
        )
    return done
