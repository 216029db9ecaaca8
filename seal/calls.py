"""The system calls a sealed worker makes, each failing as a SealError that
names the step it was part of (steps.py's `unshare`, `map`, `private`,
`proc`, `harden`, `filter`, `drop`; worker/seal.py's `tmp`, `hide`,
`session`, `bind`, `git`), and the fault a test may inject at a step
(FAULT_ENV).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from hermes_sup.local import syscalls
from hermes_sup.local.syscalls import MS_BIND, MS_RDONLY, MS_REMOUNT, STATVFS_TO_MS

# For tests: make one step fail as if the kernel had refused it (EPERM).
# The supervisor reads it from its own environment and passes it on.
FAULT_ENV = "HERMES_SUP_SEAL_FAULT"
# Mount points made in tmpfs or in the session's tmp: traversable by the
# session's uid, listable by nobody.
MOUNTPOINT_MODE = 0o711


class SealError(Exception):
    """A step of sealing failed; the worker must not run its session."""

    def __init__(self, step: str, message: str) -> None:
        super().__init__(f"{step}: {message}")
        self.step = step
        self.message = message


def _fail(step: str, what: str, err: int | None) -> SealError:
    err = errno.EIO if err is None else err  # never None from hermes_sup.local.syscalls
    return SealError(step, f"{what}: {os.strerror(err)} (errno {errno.errorcode.get(err, err)})")


def _check_fault(step: str, fault: str | None) -> None:
    if fault == step:
        raise _fail(step, f"injected failure ({FAULT_ENV}={fault})", errno.EPERM)


def _mount(
    step: str, source: str | None, target: str, fstype: str | None, flags: int, data: str = ""
) -> None:
    try:
        syscalls.mount(source, target, fstype, flags, data)
    except OSError as exc:
        raise _fail(
            step, f"mount {source or fstype or '(remount)'} on {target}", exc.errno
        ) from None


def _unshare(step: str, flags: int) -> None:
    try:
        syscalls.unshare(flags)
    except OSError as exc:
        raise _fail(step, f"unshare({syscalls.clone_flag_names(flags)})", exc.errno) from None


def _write(step: str, path: str, text: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as exc:
        raise SealError(step, f"write {text.strip()!r} to {path}: {exc.strerror}") from None


def _capset_zero(step: str) -> None:
    """Clear this thread's effective, permitted and inheritable capabilities."""
    try:
        syscalls.capset_zero()
    except OSError as exc:
        raise _fail(step, "capset(0, 0, 0)", exc.errno) from None


def _open_path(step: str, path: Path) -> int:
    try:
        return os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError as exc:
        raise SealError(step, f"open {path}: {exc.strerror}") from None


def _makedirs(step: str, path: Path) -> None:
    """mkdir -p, each directory made MOUNTPOINT_MODE whatever the umask
    (mount_session runs under umask 0): the session's uid must be able to
    pass through to what is mounted. Most of these are new: try first."""
    try:
        os.mkdir(path, MOUNTPOINT_MODE)
        return
    except FileExistsError:
        return
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise SealError(step, f"mkdir {path}: {exc.strerror}") from None
    _makedirs(step, path.parent)
    try:
        os.mkdir(path, MOUNTPOINT_MODE)
    except FileExistsError:
        pass
    except OSError as exc:
        raise SealError(step, f"mkdir {path}: {exc.strerror}") from None


def _remount_readonly(step: str, target: Path) -> None:
    """Make one mount read-only, keeping the flags it has (locked ones
    in a user namespace must be kept)."""
    try:
        f_flag = os.statvfs(target).f_flag
    except OSError as exc:
        raise SealError(step, f"statvfs {target}: {exc.strerror}") from None
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY
    for st, ms in STATVFS_TO_MS.items():
        if f_flag & st:
            flags |= ms
    _mount(step, None, str(target), None, flags)


def _remount_writable(step: str, target: Path) -> None:
    """Make one mount of ours writable again (a bind taken from the
    read-only tree), keeping its other flags."""
    try:
        f_flag = os.statvfs(target).f_flag
    except OSError as exc:
        raise SealError(step, f"statvfs {target}: {exc.strerror}") from None
    flags = MS_REMOUNT | MS_BIND
    for st, ms in STATVFS_TO_MS.items():
        if f_flag & st:
            flags |= ms
    _mount(step, None, str(target), None, flags)


def _under(path: Path, parents: Iterable[Path]) -> bool:
    """Whether `path` is one of `parents` or below one (as strings: pathlib's
    `parents` made this a good part of a spare's assignment)."""
    text = str(path)
    for parent in parents:
        top = str(parent)
        if text == top or text.startswith(top if top.endswith("/") else top + "/"):
            return True
    return False


def _read_small(path: Path, limit: int = 4096) -> str | None:
    """A small regular file's text, or None: never through a symlink, never
    blocking on a FIFO (the workspace is the session's to fill)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, limit).decode()
    except (OSError, UnicodeDecodeError):
        return None
    finally:
        os.close(fd)
