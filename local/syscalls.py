"""The Linux system calls sealing is made of (Linux only): unshare, mount,
capset, the capability bounding set's size, Landlock's scoped rulesets, a
seccomp filter, and the constants they take.

Plain plumbing, with no knowledge of sessions: worker/seal.py decides what a
worker mounts, hides and drops, and calls these to do it. Each raises
OSError (errno set, the call named) when the kernel refuses, as
hermes_sup.local.prctl does for prctl. It imports the standard library
only: the zygote imports it before it forks.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import os
import socket
import struct
from pathlib import Path

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_NOATIME = 0x400
MS_NODIRATIME = 0x800
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
MS_RELATIME = 0x200000
# statvfs f_flag bits and the mount flags they stand for: a read-only
# remount of a bind inside a user namespace must keep the flags the parent
# namespace set (they are locked), or the kernel refuses it.
STATVFS_TO_MS = {
    os.ST_NOSUID: MS_NOSUID,
    os.ST_NODEV: MS_NODEV,
    os.ST_NOEXEC: MS_NOEXEC,
    os.ST_NOATIME: MS_NOATIME,
    os.ST_NODIRATIME: MS_NODIRATIME,
    os.ST_RELATIME: MS_RELATIME,
}

PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522

# Landlock (Linux 6.12+, ABI 6): scopes that keep a sandboxed process from
# signalling, or connecting to the abstract unix sockets of, processes
# outside its domain. What closes signals between workers of one uid.
_SYS_LANDLOCK_CREATE_RULESET = 444  # the same number on every architecture
_SYS_LANDLOCK_RESTRICT_SELF = 446
_LANDLOCK_CREATE_RULESET_VERSION = 1
_LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET = 0x1
_LANDLOCK_SCOPE_SIGNAL = 0x2
LANDLOCK_SCOPE_ABI = 6

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_ulong,
    ctypes.c_char_p,
]


def _refused(call: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{call}: {os.strerror(err)}")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    """mount(2); None and "" are passed as NULL."""
    rc = _libc.mount(
        source.encode() if source is not None else None,
        target.encode(),
        fstype.encode() if fstype is not None else None,
        flags,
        data.encode() if data else None,
    )
    if rc != 0:
        raise _refused(f"mount({target})")


def unshare(flags: int) -> None:
    """unshare(2)."""
    if _libc.unshare(flags) != 0:
        raise _refused(f"unshare({clone_flag_names(flags)})")


def clone_flag_names(flags: int) -> str:
    """The namespace flags unshare is given, by name (for messages)."""
    known = (
        ("CLONE_NEWUSER", CLONE_NEWUSER),
        ("CLONE_NEWNS", CLONE_NEWNS),
        ("CLONE_NEWPID", CLONE_NEWPID),
        ("CLONE_NEWIPC", CLONE_NEWIPC),
        ("CLONE_NEWNET", CLONE_NEWNET),
    )
    names = [n for n, v in known if flags & v]
    return "|".join(names)


# mount_setattr(2) (Linux 5.12): one call changes a whole tree of mounts.
# The same number on every architecture (the generic table).
_SYS_MOUNT_SETATTR = 442
_AT_FDCWD = -100
_AT_RECURSIVE = 0x8000
MOUNT_ATTR_RDONLY = 0x1


def mount_setattr_tree(path: str, attr_set: int) -> None:
    """Set `attr_set` (MOUNT_ATTR_*) on the mount at `path` and on every
    mount below it, in one call."""
    attr = struct.pack("QQQQ", attr_set, 0, 0, 0)  # set, clr, propagation, userns_fd
    buf = ctypes.create_string_buffer(attr, len(attr))
    rc = _libc.syscall(_SYS_MOUNT_SETATTR, _AT_FDCWD, path.encode(), _AT_RECURSIVE, buf, len(attr))
    if rc != 0:
        raise _refused(f"mount_setattr({path}, AT_RECURSIVE)")


# Bringing a network namespace's loopback up: SIOCGIFFLAGS/SIOCSIFFLAGS on
# a struct ifreq (16 bytes of name, then the flags as a short).
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1


def loopback_up() -> None:
    """Bring `lo` up in this process's network namespace (a new one has
    it down: not even 127.0.0.1 answers). Needs CAP_NET_ADMIN there."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            req = fcntl.ioctl(sock.fileno(), _SIOCGIFFLAGS, struct.pack("16sh22x", b"lo", 0))
            flags = struct.unpack("16sh22x", req)[1]
            fcntl.ioctl(
                sock.fileno(), _SIOCSIFFLAGS, struct.pack("16sh22x", b"lo", flags | _IFF_UP)
            )
        except OSError as exc:
            raise OSError(exc.errno, f"ioctl(SIOCSIFFLAGS, lo up): {exc.strerror}") from None


# capset's arguments for "no capability at all", made once (in the zygote,
# which imports this before it forks): this thread's header, and two
# {effective, permitted, inheritable} u32 triples of zeros.
_CAPSET_HEADER = struct.pack("Ii", _LINUX_CAPABILITY_VERSION_3, 0)
_CAPSET_ZEROS = bytes(24)


def capset_zero() -> None:
    """Clear this thread's effective, permitted and inheritable capabilities."""
    if _libc.capset(_CAPSET_HEADER, _CAPSET_ZEROS) != 0:
        raise _refused("capset(0, 0, 0)")


@functools.cache
def last_cap() -> int:
    """The highest capability number this kernel knows."""
    try:
        return int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    except (OSError, ValueError):
        return 40


@functools.cache
def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 if it has none (or it is off)."""
    syscall = _libc.syscall
    abi = syscall(_SYS_LANDLOCK_CREATE_RULESET, None, 0, _LANDLOCK_CREATE_RULESET_VERSION)
    return max(0, int(abi))


def signal_ruleset() -> int:
    """A Landlock ruleset (its fd, close-on-exec) that scopes signals and
    abstract unix sockets."""
    attr = struct.pack("QQQ", 0, 0, _LANDLOCK_SCOPE_SIGNAL | _LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET)
    buf = ctypes.create_string_buffer(attr, len(attr))
    fd = _libc.syscall(_SYS_LANDLOCK_CREATE_RULESET, buf, len(attr), 0)
    if fd < 0:
        raise _refused("landlock_create_ruleset(scoped signals)")
    return int(fd)


def landlock_restrict_self(ruleset_fd: int) -> None:
    """Put this thread (and what it starts) in the ruleset's domain."""
    if _libc.syscall(_SYS_LANDLOCK_RESTRICT_SELF, ruleset_fd, 0) != 0:
        raise _refused("landlock_restrict_self")


# ------------------------------------------------------------------ seccomp
#
# A small classic-BPF filter, as container runtimes install: the calls a
# sealed session never needs and that widen what its shell can reach in the
# kernel are refused with EPERM. New namespaces (unshare, setns, clone with
# a CLONE_NEW* flag): a nested user namespace would give its shell every
# capability again there, and is where most unprivileged kernel exploits
# start. The kernel keyrings, bpf, userfaultfd, perf events and io_uring.
# (Mounts are left to the kernel, which refuses them to a process without
# capabilities: the worker installs the filter before it mounts its
# session's view.) clone3 passes its flags in memory a filter cannot read:
# it fails with ENOSYS, and libc falls back to clone, whose flags are
# checked. Calls made through another ABI (32-bit, x32) are refused whole:
# their numbers differ.

_SECCOMP_SET_MODE_FILTER = 1
_SECCOMP_FILTER_FLAG_TSYNC = 1
_SECCOMP_RET_ALLOW = 0x7FFF0000
_SECCOMP_RET_ERRNO = 0x00050000
_NAMESPACE_FLAGS = 0x7E020080  # every CLONE_NEW*, CLONE_NEWTIME included
_X32_BIT = 0x40000000

# Per machine: (audit arch, seccomp(2), clone, clone3, the refused calls).
_SECCOMP_ABI = {
    "x86_64": (
        0xC000003E,
        317,
        56,
        435,
        {
            "unshare": 272, "setns": 308,
            "keyctl": 250, "add_key": 248, "request_key": 249, "bpf": 321,
            "userfaultfd": 323, "perf_event_open": 298, "io_uring_setup": 425,
        },
    ),
    "aarch64": (
        0xC00000B7,
        277,
        220,
        435,
        {
            "unshare": 97, "setns": 268,
            "keyctl": 219, "add_key": 217, "request_key": 218, "bpf": 280,
            "userfaultfd": 282, "perf_event_open": 241, "io_uring_setup": 425,
        },
    ),
}  # fmt: skip


def seccomp_supported() -> bool:
    """Whether restrict_syscalls knows this machine's system call numbers."""
    return os.uname().machine in _SECCOMP_ABI


def _bpf(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k & 0xFFFFFFFF)


@functools.cache
def filter_program() -> bytes:
    """The filter's BPF program (made once: the zygote makes it for every
    worker it forks)."""
    arch, _seccomp, clone, clone3, refused = _SECCOMP_ABI[os.uname().machine]
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    eperm = _SECCOMP_RET_ERRNO | 1
    enosys = _SECCOMP_RET_ERRNO | 38
    numbers = sorted(set(refused.values()))
    # Layout: the checks, then four returns at fixed distances from the end.
    body = [
        _bpf(ld, 4),  # seccomp_data.arch
        None,  # jeq arch: go on, else EPERM
        _bpf(ld, 0),  # seccomp_data.nr
        None,  # nr >= x32 bit: EPERM
        *[None for _ in numbers],  # jeq nr: EPERM
        None,  # jeq clone3: ENOSYS
        None,  # jeq clone: check its flags
        None,  # allow
        _bpf(ld, 16),  # args[0], low word: clone's flags
        _bpf(jset, _NAMESPACE_FLAGS, 1, 0),  # a new namespace: EPERM
        _bpf(ret, _SECCOMP_RET_ALLOW),
        _bpf(ret, eperm),
        _bpf(ret, enosys),
    ]
    n = len(body)
    allow_at, eperm_at, enosys_at, flags_at = n - 3, n - 2, n - 1, n - 5

    def jump(at: int, to: int) -> int:
        return to - at - 1

    body[1] = _bpf(jeq, arch, 0, jump(1, eperm_at))
    body[3] = _bpf(jge, _X32_BIT, jump(3, eperm_at), 0)
    for i, nr in enumerate(numbers):
        at = 4 + i
        body[at] = _bpf(jeq, nr, jump(at, eperm_at), 0)
    at = 4 + len(numbers)
    body[at] = _bpf(jeq, clone3, jump(at, enosys_at), 0)
    body[at + 1] = _bpf(jeq, clone, jump(at + 1, flags_at), 0)
    body[at + 2] = _bpf(ret, _SECCOMP_RET_ALLOW)
    assert allow_at == flags_at + 2
    return b"".join(x for x in body if x is not None)


def restrict_syscalls() -> None:
    """Install the filter on every thread of this process (it needs
    no_new_privs, or CAP_SYS_ADMIN); inherited by all it starts, for good."""
    _arch, seccomp, _clone, _clone3, _refused_calls = _SECCOMP_ABI[os.uname().machine]
    program = filter_program()
    code = ctypes.create_string_buffer(program, len(program))
    fprog = struct.pack("HxxxxxxQ", len(program) // 8, ctypes.addressof(code))
    prog = ctypes.create_string_buffer(fprog, len(fprog))
    if _libc.syscall(seccomp, _SECCOMP_SET_MODE_FILTER, _SECCOMP_FILTER_FLAG_TSYNC, prog) != 0:
        raise _refused("seccomp(SECCOMP_SET_MODE_FILTER)")
