"""Session leases: one supervisor at a time owns a session, even when many
share one data directory (NFSv4, a cluster file system).

Theory of operation
-------------------
A session's directory holds two small files:

    lease   locked (fcntl, an open-file-description lock) by the supervisor
            that owns the session, for as long as it has the session live;
            its content names the holder: node, endpoint, pid, epoch
    epoch   the fencing epoch, "<n> <token>": n counts the takings of the
            lease, the token is random to each one

Taking the lease is: lock `lease` without waiting (held elsewhere: `moved`,
naming the holder from the file's content), then write the holder's name
into `lease`, then `epoch` anew, n + 1 with a fresh token (in place, one
small write of a fixed size: see `write_epoch`). A new session's files
are made ahead, with its spare directory (spare_dirs.py): making a file
costs a journalled metadata change, about 1 ms here, writing one a page.
The kernel (or the NFS server, once the client's state expires) drops
the lock when its process dies, so a SIGKILLed node's sessions can be
taken at once by the next supervisor asked for them.

The lock alone does not stop an owner cut off from the file server: its
lock expires there and another node takes the session, while it still
believes it owns it. That is what the epoch is for (a fencing token): every
write the supervisor makes into a session's directory first reads `epoch`
and goes ahead only if it is the one it wrote when it took the lease. An
old owner that comes back finds another's epoch, writes nothing, and gives
the session up. (A write can still race a taking that lands between its
check and the write itself; the window is one read long, and the next check
catches it.)

Where the lock can be lost, and what a check reads
--------------------------------------------------
The epoch matters only where a lock can go while its holder lives: on a
file system shared by several hosts (NFS, CIFS, a cluster file system),
whose server expires a cut-off client's locks; and wherever node leases
are on (`lease_time`, node_lease.py), since another node breaks the lock
of a holder whose node lease ran out (`Leases._break`), local disk or not:
the supervisor then counts its data directory as shared. On a local file system the
kernel keeps an open-file-description lock for as long as the descriptor
is open, so no other supervisor can take the lease, nor write a new epoch
by the protocol, while we live. Which of the two the data directory is,
`data_dir_shared` decides (the `shared_data` setting, else the file
system's type from /proc/self/mountinfo), and a lease keeps it (`shared`):

- shared: every check opens `epoch` anew and reads it, and every write
  opens and closes it: close-to-open consistency is what makes an NFS
  client ask the server, rather than answer from its own cache. The lease
  watch (lease_watch.py) reads the epochs back twice a second.
- local: the epoch is read with one pread on a descriptor the lease keeps
  open (`Lease.epoch_fd`), with no open or close a turn, and there is no
  lease watch: nothing can take a lease while its lock is held. The fence
  still holds against what could write the file anyway (a hand edit, a
  program that ignores the lock): a pread of a local file reads the page
  cache every writer shares, so it sees any write made before it, exactly
  as an open and a read would. The descriptor names the file, not its
  path: a file renamed over `epoch` is not seen, but the directory is the
  session's, read-only to its worker, and only a holder of the lock writes
  there.

Open-file-description locks (F_OFD_SETLK) are used, not classic POSIX ones:
those belong to the process, and closing any descriptor of the file (one
that only read the holder's name, say) would silently drop them. Where the
platform has none, flock(2) serves, which is per open file too.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hermes_sup.local.logfmt import kv

log = logging.getLogger("hermes_sup.supervisor")

LEASE_FILE = "lease"
EPOCH_FILE = "epoch"
_HELD = (errno.EACCES, errno.EAGAIN)
EPOCH_SIZE = 64  # the epoch line, padded: "<n> <token>"
HOLDER_SIZE = 1024  # the lease file's content, padded: who holds it (JSON)
NAMING_WAIT = 0.01  # seconds a refused taker waits for a holder to write its name
_OFD = hasattr(fcntl, "F_OFD_SETLK")


@dataclass(frozen=True)
class Holder:
    """Who holds a session's lease, as its lease file says."""

    node: str | None
    endpoint: str | None
    pid: int | None

    def describe(self) -> str:
        """For a sentence: 'node b (tcp://10.0.0.2:5555)'."""
        where = f"node {self.node}" if self.node else "another supervisor"
        return where + (f" ({self.endpoint})" if self.endpoint else "")


class LeaseHeld(Exception):
    """The lease is held by another supervisor (its holder, if known)."""

    def __init__(self, path: Path, holder: Holder | None) -> None:
        super().__init__(f"{path} is held by {(holder or Holder(None, None, None)).describe()}")
        self.holder = holder


class LeaseLost(Exception):
    """The fencing epoch is no longer ours: another supervisor took the session."""


@dataclass
class Lease:
    """A lease this supervisor holds: the locked file's descriptor and the
    epoch line it wrote."""

    dir: Path
    fd: int
    epoch: int
    token: str
    # The epoch file could not be written (a full disk): the lock alone
    # guards the session until a later check manages to write it.
    unfenced: bool = False
    # On a data directory only this host uses: the epoch file, kept open
    # for a pread a check (see "Where the lock can be lost"); None on a
    # shared one, where each check opens it anew.
    epoch_fd: int | None = None


def lock_file(fd: int) -> bool:
    """Lock the whole file for writing without waiting; False if another holds it."""
    try:
        if _OFD:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("hhqqi4x", fcntl.F_WRLCK, 0, 0, 0, 0))
        else:  # pragma: no cover - not Linux
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in _HELD or exc.errno == errno.EWOULDBLOCK:
            return False
        raise
    return True


def _locked_elsewhere(fd: int) -> bool:
    """Whether another open file (this process's or another's) holds the lock."""
    if _OFD:
        probe = struct.pack("hhqqi4x", fcntl.F_WRLCK, 0, 0, 0, 0)
        answer = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, probe)
        return struct.unpack("hhqqi4x", answer)[0] != fcntl.F_UNLCK
    if not lock_file(fd):  # pragma: no cover - not Linux
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def read_holder(session_dir: Path) -> Holder | None:
    """Who the lease file names, if it names anyone readable."""
    try:
        data = json.loads((session_dir / LEASE_FILE).read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None

    def text(name: str) -> str | None:
        value = data.get(name)
        return value if isinstance(value, str) and value.isprintable() else None

    pid = data.get("pid")
    return Holder(text("node"), text("endpoint"), pid if isinstance(pid, int) else None)


def named_holder(session_dir: Path) -> Holder | None:
    """`read_holder` for a lease found locked: a taker writes its name
    right after it locks, so an unnamed holder is waited for a moment
    (NAMING_WAIT at most), so that `moved` can say where the session is."""
    deadline = time.monotonic() + NAMING_WAIT
    while True:
        holder = read_holder(session_dir)
        if holder is not None or time.monotonic() >= deadline:
            return holder
        time.sleep(0.001)


def read_epoch(session_dir: Path) -> tuple[int, str]:
    """The epoch line's counter and token ((0, "") if there is none yet),
    read through a new open (close-to-open: on NFS, from the server)."""
    try:
        fd = os.open(os.path.join(session_dir, EPOCH_FILE), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return 0, ""
    try:
        return parse_epoch(os.read(fd, EPOCH_SIZE))
    finally:
        os.close(fd)


def parse_epoch(data: bytes) -> tuple[int, str]:
    """An epoch line's counter and token ((0, "") for none, or a torn one)."""
    number, _, token = data.decode(errors="replace").strip().partition(" ")
    try:
        return int(number), token
    except ValueError:
        return 0, ""  # torn or hand-edited: the next taker starts over above it


def write_epoch(session_dir: Path, epoch: int, token: str) -> None:
    """Write the epoch line in place, padded to a fixed size: one write of
    a few bytes into one page, no truncation, so a reader sees the old line
    or the new. Only the lease's holder writes it. (A new file, or a rename
    over one, costs a journalled metadata change, about 1 ms on ext4; this
    is a page-cache write of an existing file.)"""
    fd = os.open(session_dir / EPOCH_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        _write_fixed(fd, epoch_line(epoch, token), EPOCH_SIZE)
    finally:
        os.close(fd)


def epoch_line(epoch: int, token: str) -> bytes:
    """The epoch file's content: "<n> <token>", padded to EPOCH_SIZE."""
    return (f"{epoch} {token}".ljust(EPOCH_SIZE - 1) + "\n").encode()


def _open_epoch(session_dir: Path) -> int | None:
    """The epoch file's descriptor, kept by a lease on a local data
    directory; None if it cannot be made (a full disk has no inode for a
    new one): the lease then reads and writes it by path, as on a shared
    directory, and is unfenced until a write succeeds (`Leases.check`)."""
    try:
        return os.open(session_dir / EPOCH_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        return None


def _write_fixed(fd: int, data: bytes, size: int) -> None:
    """Write `data` (at most `size` bytes, padded) over the file's start,
    and cut the file to `size` if it was another length."""
    os.pwrite(fd, data.ljust(size), 0)
    if os.fstat(fd).st_size != size:
        os.ftruncate(fd, size)


class Leases:
    """This supervisor's side of every session lease."""

    def __init__(self, node: str, shared: bool = True) -> None:
        self.node = node
        # Whether the data directory is shared with other hosts (see "Where
        # the lock can be lost"): the safe answer is the default.
        self.shared = shared
        # The endpoint other nodes' routers reach this supervisor at (its
        # TCP endpoint once bound, else None): asked at each taking.
        self.endpoint: Any = lambda: None
        # Whether a node's lease ran out (node_lease.py): a lock it holds
        # may then be broken. Never, unless the supervisor says otherwise.
        self.expired: Callable[[str], bool] = lambda node: False

    def _holder_text(self, epoch: int) -> bytes:
        endpoint = self.endpoint()
        return json.dumps(
            {
                "node": self.node[:256],
                "endpoint": endpoint[:512] if isinstance(endpoint, str) else None,
                "pid": os.getpid(),
                "epoch": epoch,
            }
        ).encode()

    def take(self, session_dir: Path) -> Lease:
        """Take the lease of an existing session directory; LeaseHeld if
        another supervisor holds it (OSError if the directory cannot be used)."""
        fd = os.open(session_dir / LEASE_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        lease: Lease | None = None
        try:
            if not lock_file(fd):
                holder = named_holder(session_dir)
                if holder is None or not holder.node or not self.expired(holder.node):
                    raise LeaseHeld(session_dir, holder)
                os.close(fd)
                fd = -1
                fd = self._break(session_dir, holder)
            epoch_fd = None if self.shared else _open_epoch(session_dir)
            if epoch_fd is None:
                epoch, _ = read_epoch(session_dir)
            else:
                try:
                    epoch, _ = parse_epoch(os.pread(epoch_fd, EPOCH_SIZE, 0))
                except OSError:
                    os.close(epoch_fd)
                    raise
            lease = Lease(session_dir, fd, epoch + 1, os.urandom(8).hex(), epoch_fd=epoch_fd)
            # The holder's name first: one refused meanwhile reads who holds it.
            try:
                self._name_holder(lease)
            except OSError as exc:  # a full disk: the lock holds all the same
                log.warning(kv("lease_holder_unwritten", dir=session_dir.name, error=exc))
            self._write_epoch(lease)
        except BaseException:
            if fd >= 0:
                os.close(fd)  # drops the lock, if we got it
            if lease is not None and lease.epoch_fd is not None:
                os.close(lease.epoch_fd)
            raise
        return lease

    def _break(self, session_dir: Path, holder: Holder) -> int:
        """Take a lease whose holder's node lease ran out (frozen, or cut
        off): its lock cannot be taken from it, so its file is renamed away
        (the lock stays on it) and a new one locked. The new epoch fences
        the old holder when it wakes. LeaseHeld if another taker was first."""
        path = session_dir / LEASE_FILE
        os.replace(path, session_dir / (LEASE_FILE + ".broken"))
        log.warning(kv("lease_broken", dir=session_dir.name, holder=holder.node))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        if not lock_file(fd):
            os.close(fd)
            raise LeaseHeld(session_dir, named_holder(session_dir))
        return fd

    def _write_epoch(self, lease: Lease) -> None:
        """Write the lease's epoch line; on a full disk (or any failure to
        write) the lease is unfenced, the lock alone guarding it, and the
        next check tries again."""
        try:
            if lease.epoch_fd is None:
                write_epoch(lease.dir, lease.epoch, lease.token)
            else:
                _write_fixed(lease.epoch_fd, epoch_line(lease.epoch, lease.token), EPOCH_SIZE)
            lease.unfenced = False
        except OSError as exc:
            if not lease.unfenced:
                log.warning(kv("lease_unfenced", dir=lease.dir.name, error=exc.strerror or exc))
            lease.unfenced = True

    def _name_holder(self, lease: Lease) -> None:
        _write_fixed(lease.fd, self._holder_text(lease.epoch)[:HOLDER_SIZE], HOLDER_SIZE)

    def release(self, lease: Lease) -> None:
        """Give the lease up (closing the file drops the lock)."""
        epoch_fd, lease.epoch_fd = lease.epoch_fd, None
        for fd in (lease.fd, epoch_fd):
            if fd is None:
                continue
            try:
                os.close(fd)
            except OSError:
                pass

    def check(self, lease: Lease) -> None:
        """Fencing: LeaseLost unless the epoch file is still the one this
        lease wrote. Called before every write into the session's directory."""
        if lease.unfenced:
            self._write_epoch(lease)  # still ours by the lock: fence it now if we can
            return
        try:
            if lease.epoch_fd is None:
                epoch, token = read_epoch(lease.dir)
            else:
                epoch, token = parse_epoch(os.pread(lease.epoch_fd, EPOCH_SIZE, 0))
        except OSError as exc:
            raise LeaseLost(f"cannot read {lease.dir / EPOCH_FILE}: {exc}") from None
        if (epoch, token) != (lease.epoch, lease.token):
            holder = read_holder(lease.dir)
            raise LeaseLost(
                f"the session was taken over (epoch {epoch}, ours {lease.epoch}) by "
                + (holder.describe() if holder else "another supervisor")
            )

    def holder_elsewhere(self, session_dir: Path) -> Holder | None:
        """If another supervisor holds the session's lease now, who (a
        Holder, maybe with nothing known in it); None if nobody does."""
        return locked_by(session_dir)


def locked_by(session_dir: Path) -> Holder | None:
    """Who holds a session's lease now (a Holder, maybe with nothing known
    in it; ourselves included), None if nobody does or there is no lease
    file (OSError if it cannot be read)."""
    try:
        fd = os.open(session_dir / LEASE_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        if not _locked_elsewhere(fd):
            return None
    finally:
        os.close(fd)
    return named_holder(session_dir) or Holder(None, None, None)


# File systems whose locks live on one host's kernel: a lease there cannot
# be lost while its holder lives. Anything else (nfs, nfs4, cifs, smb3,
# ceph, glusterfs, gfs2, ocfs2, lustre, fuse.*, 9p, an unknown name) is
# taken to be shared, the safe side.
LOCAL_FILE_SYSTEMS = frozenset(
    {
        "ext2",
        "ext3",
        "ext4",
        "xfs",
        "btrfs",
        "tmpfs",
        "ramfs",
        "zfs",
        "f2fs",
        "bcachefs",
        "overlay",
        "jfs",
        "reiserfs",
    }
)


def data_dir_shared(data_dir: Path, setting: str = "auto") -> bool:
    """Whether leases in `data_dir` can be lost while held (see "Where the
    lock can be lost"): `setting` "yes" or "no" says so; "auto" asks the
    type of the file system the directory is on, and a type not known to
    be local, or one that cannot be told, counts as shared."""
    if setting in ("yes", "no"):
        return setting == "yes"
    fstype = file_system_type(data_dir)
    return fstype is None or fstype not in LOCAL_FILE_SYSTEMS


def file_system_type(path: Path) -> str | None:
    """The type of the file system `path` is on (its nearest existing
    ancestor's), from /proc/self/mountinfo: the mount with the longest
    mount point that contains it. None if that cannot be read."""
    probe = Path(os.path.realpath(path))
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    where = str(probe)
    best, fstype = -1, None
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
    except OSError:
        return None
    for line in lines:
        # id parent dev root MOUNT_POINT options [optional...] - TYPE source ...
        head, sep, tail = line.partition(" - ")
        fields = head.split()
        if not sep or len(fields) < 5 or not tail.split():
            continue
        point = fields[4].replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
        inside = where == point or where.startswith(point.rstrip("/") + "/")
        # The later of two mounts on one point is the one on top.
        if inside and len(point) >= best:
            best, fstype = len(point), tail.split()[0]
    return fstype


def holder_of(session_dir: Path) -> str | None:
    """The node holding a session's lease now ("" if its name is not
    known), or None if no one holds it (or it cannot be told)."""
    try:
        holder = locked_by(session_dir)
    except OSError:
        return None
    return None if holder is None else holder.node or ""


def log_lost(key: str, why: object) -> None:
    """One line for an owner that found its session taken over."""
    log.error(kv("lease_lost", session=key, error=why))
