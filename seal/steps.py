"""The steps a process takes to seal itself: its namespaces, its filters,
its uid. A sealed worker takes them for its session; the supervisor's
start-up check takes the same ones in a child of its own (`probe`).

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
2. `drop`: as root, setgroups([]), setresgid/setresuid to the session's
   own uid (glibc applies them to every thread: a spare's zmq threads
   too), capabilities cleared; not root, capabilities cleared. The
   parent-death signal is cleared by the kernel when credentials change:
   the caller sets it again. Only then does a forked worker create its zmq
   context and connect: as root,
   the supervisor made the worker socket connectable by any uid
   (supervisor/sealing.py says why only sealed workers could reach it).

Between the two, a worker mounts its session's view (worker/seal.py's
`mount_session`: what it hides, what it binds back, its directories over
the fixed paths of `paths.SealedPaths`).

Any failing step raises SealError and the worker exits with
WorkerExit.SEAL_FAILED before any runtime code runs: it never runs against
the zygote's paths or with other sessions' files in view (fail closed).

The system calls themselves (unshare, mount, capset, Landlock) and their
constants are hermes_sup.local.syscalls; this module is the order they are
made in and what each step makes sure of.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable
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
    MS_REC,
    PR_CAP_AMBIENT,
    PR_CAP_AMBIENT_CLEAR_ALL,
    PR_CAPBSET_DROP,
    PR_SET_DUMPABLE,
    PR_SET_NO_NEW_PRIVS,
    landlock_abi,
)

from .calls import (
    SealError,
    _capset_zero,
    _check_fault,
    _fail,
    _makedirs,
    _mount,
    _remount_readonly,
    _remount_writable,
    _unshare,
    _write,
)
from .paths import _closed_code_ancestors, code_paths

MODES = ("root", "user")
# A session's own /proc: of its PID namespace, nothing in it to execute.
PROC_FLAGS = MS_NOSUID | MS_NODEV | MS_NOEXEC
# The namespaces this worker was born into (set by the zygote in the child,
# right after the clone: `born`), its pid as the supervisor sees it (in its
# own PID namespace it is 1), and its uid and gid outside a user namespace
# it was born into (inside, until mapped, they read as 65534).
BORN_INTO = 0
_OUTSIDE_PID: int | None = None
_OUTSIDE_IDS: tuple[int, int] | None = None


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


def read_only_root(step: str) -> None:
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
    read_only_root("readonly")
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
