"""The Linux system calls sealing is made of (Linux only): unshare, mount,
capset, the capability bounding set's size, Landlock's scoped rulesets, and
the constants they take.

Plain plumbing, with no knowledge of sessions: worker/seal.py decides what a
worker mounts, hides and drops, and calls these to do it. Each raises
OSError (errno set, the call named) when the kernel refuses, as
hermes_sup.local.prctl does for prctl. It imports the standard library
only: the zygote imports it before it forks.
"""

from __future__ import annotations

import ctypes
import functools
import os
import struct
from pathlib import Path

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
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
    names = [
        n for n, v in (("CLONE_NEWUSER", CLONE_NEWUSER), ("CLONE_NEWNS", CLONE_NEWNS)) if flags & v
    ]
    return "|".join(names)


def capset_zero() -> None:
    """Clear this thread's effective, permitted and inheritable capabilities."""
    header = struct.pack("Ii", _LINUX_CAPABILITY_VERSION_3, 0)
    data = bytes(24)  # two {effective, permitted, inheritable} u32 triples
    hdr_buf = ctypes.create_string_buffer(header, len(header))
    data_buf = ctypes.create_string_buffer(data, len(data))
    if _libc.capset(hdr_buf, data_buf) != 0:
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
