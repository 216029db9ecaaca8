"""Session directories made ahead of time, so that a new session's worker
finds its directories there instead of creating them as it starts.

A new session's directory, with its `home/`, `workspace/` and `tmp/`, is four
directory creations; on ext4 each is a journalled metadata change of a few
hundred microseconds. A spare made earlier is moved into place with one
rename, before the worker is asked for, and a new spare is made behind it.
With leases (leases.py) a spare also comes with its session lease already
taken (epoch 1): the lock is on the file, so it moves with the rename, and a
new session's lease costs nothing more than the rename.

Several supervisors may share one data directory. Each keeps its spares in a
directory of its own, `.spare-sessions/<node>-<random>/`, beside a lock file
`<node>-<random>.lock` it holds while it runs: at start a supervisor removes
only the spares of those whose lock is free (they are gone), never another
live one's, and no two ever number spares in one directory.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import shutil
import socket
from pathlib import Path

from .leases import Lease, LeaseHeld, Leases, lock_file
from .session import sessions_dir

log = logging.getLogger("hermes_sup.supervisor")

SPARE_DIR = ".spare-sessions"  # beside <data>/sessions, on the same file system
LOCK_SUFFIX = ".lock"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def node_file_name(node: str) -> str:
    """A node's name as part of a file name (anything else as `_`)."""
    return _UNSAFE.sub("_", node)[:64] or "node"


class SpareDirs:
    """A few empty session directories, ready to be renamed into place."""

    def __init__(self, data_dir: Path, target: int = 4) -> None:
        self.base = data_dir / SPARE_DIR
        self.sessions = sessions_dir(data_dir)
        self.target = target
        self.node = socket.gethostname()
        self.leases: Leases | None = None
        self.root = self.base / self._own_name()
        self.free: list[tuple[Path, Lease | None]] = []
        self._names = itertools.count()
        self._lock_fd: int | None = None

    def _own_name(self) -> str:
        return f"{node_file_name(self.node)}-{os.urandom(4).hex()}"

    def serve(self, node: str, leases: Leases | None) -> None:
        """Name the spares by `node`, and take each spare's session lease
        ahead (before `reset`)."""
        self.node, self.leases = node, leases
        self.root = self.base / self._own_name()

    def reset(self) -> None:
        """Make our spare directory (locked as ours), remove those of
        supervisors that are gone (and any older layout's), and make a full set."""
        self.release_all()
        self.base.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            os.chmod(self.base, 0o700)  # made by an older run, or by hand
        except OSError:
            pass  # another user's (another supervisor's): ours below is 0700
        self.sessions.mkdir(mode=0o700, exist_ok=True)
        if self._lock_fd is None:
            fd = os.open(
                self.root.with_name(self.root.name + LOCK_SUFFIX),
                os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                0o600,
            )
            if not lock_file(fd):  # new and random: never held
                os.close(fd)
                raise OSError(f"{self.root} is locked by another supervisor")
            self._lock_fd = fd
        self._sweep()
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(mode=0o700)
        self.refill(self.target)

    def _sweep(self) -> None:
        """Remove the spares no live supervisor holds: those whose lock file
        we can lock, and directories with no lock file at all."""
        try:
            entries = list(os.scandir(self.base))
        except FileNotFoundError:
            return
        names = {entry.name for entry in entries}
        for entry in entries:
            if entry.name.endswith(LOCK_SUFFIX):
                self._sweep_locked(Path(entry.path))
            elif entry.name + LOCK_SUFFIX not in names and entry.path != str(self.root):
                shutil.rmtree(entry.path, ignore_errors=True)

    def _sweep_locked(self, lock: Path) -> None:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return  # removed by another sweeper meanwhile
        try:
            if not lock_file(fd):
                return  # a live supervisor's (or our own)
            shutil.rmtree(lock.with_name(lock.name.removesuffix(LOCK_SUFFIX)), ignore_errors=True)
            lock.unlink(missing_ok=True)
        finally:
            os.close(fd)

    def release_all(self) -> None:
        """Give up the leases the spares hold (their directories stay)."""
        for _path, lease in self.free:
            if lease is not None and self.leases is not None:
                self.leases.release(lease)
        self.free.clear()

    def take(self, dest: Path, with_workspace: bool = True) -> bool:
        """Move a spare to `dest` (see `take_leased`); whether one moved.
        Its lease, if it had one, is given up."""
        moved = self._move(dest, with_workspace)
        if moved is None:
            return False
        lease = moved[1]
        if lease is not None and self.leases is not None:
            self.leases.release(lease)
        return True

    def take_leased(self, dest: Path, with_workspace: bool = True) -> Lease | None:
        """Move a spare, its lease taken, to `dest` and return the lease;
        None if there is no leased spare, or `dest` is already there with
        something in it (another supervisor, or a worker, got there first).
        A `dest` that is there but empty is replaced: whoever made it finds
        the spare's directories, and its lease, taken (worker.main._make_dir)."""
        if self.free and self.free[-1][1] is None:
            return None
        moved = self._move(dest, with_workspace)
        if moved is None:
            return None
        lease = moved[1]
        assert lease is not None
        lease.dir = dest
        return lease

    def _move(self, dest: Path, with_workspace: bool) -> tuple[Path, Lease | None] | None:
        if not self.free:
            return None
        spare = self.free.pop()
        try:
            os.rename(spare[0], dest)
        except OSError:
            self.free.append(spare)
            return None
        if not with_workspace:
            try:
                (dest / "workspace").rmdir()  # the session's workspace is elsewhere
            except OSError:
                pass
        return spare

    def wanted(self) -> bool:
        """Whether there are fewer spares than the target."""
        return len(self.free) < self.target

    def refill(self, most: int = 1) -> None:
        """Make up to `most` spares, stopping at the target."""
        for _ in range(most):
            if len(self.free) >= self.target:
                return
            spare = self.root / str(next(self._names))
            lease = None
            try:
                spare.mkdir(mode=0o700)
                (spare / "home").mkdir(mode=0o700)
                (spare / "workspace").mkdir(mode=0o700)
                (spare / "tmp").mkdir(mode=0o700)
                (spare / "user").mkdir(mode=0o700)
                if self.leases is not None:
                    lease = self.leases.take(spare)
            except (OSError, LeaseHeld) as exc:
                log.warning("cannot make a spare session directory %s: %s", spare, exc)
                shutil.rmtree(spare, ignore_errors=True)
                return
            self.free.append((spare, lease))
