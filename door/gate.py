"""The client gate: client connections counted, capped, and refused beyond the cap.

Theory of operation
-------------------
Every client connection costs the service (a supervisor, or a router) a
file descriptor, and libzmq aborts the whole process when it cannot get
one: an ipc listener's accept() failing with EMFILE is an assertion (`Too
many open files (src/ipc_listener.cpp)`), and so is a new zmq socket's
mailbox. 1,100 connections under `ulimit -n 1024` took the supervisor and
every worker down. libzmq itself has no limit on a socket's connections,
and no way to pause a listener without closing every connection it
accepted.

So the gate watches each client socket's monitor: EVENT_ACCEPTED names the
new connection's descriptor, EVENT_DISCONNECTED its end. Connections up to
the socket's cap are counted; one over it is refused: shut down (shutdown(2),
not close: the descriptor stays libzmq's, which then sees the connection end
and closes it itself). Before it is shut down, a refused connection may wait
a moment (REFUSAL_GRACE) for its first request, to be answered with an
`overloaded` error that says why (fronts.py reads the descriptor a
request came from); at most REFUSALS_WAITING wait at once, the rest are shut
at once. Refusals are logged through a throttle.

That is a race: libzmq accepts in its own thread, and the gate can only
answer after. A flood from several processes on a busy machine outran it
and ran the descriptors out all the same. So the local socket's name is
also a door (`Door`): when more connections over the cap come than can
wait to be told why, while it stays full (a flood, not a client too many),
the gate
renames a socket that nobody accepts on over `control.sock` (the real one
stays listening under another name, its connections untouched), and new
connections wait in the kernel instead of costing descriptors, however long
the flood and however slow the gate. When connections are back under the
cap for a moment, the real socket gets its name back. The TCP socket needs
no door: libzmq's TCP listener survives running out of descriptors.

The gate runs in its own thread, blocked on the monitors: a connection flood
must be answered while the event loop is busy with something else, and the
descriptors libzmq takes meanwhile are the gate's margin (BURST_FDS in the
budget below). A descriptor is only ever shut down once it is known to be
a connection on the watched socket: its local address must be the
socket's own (not a worker's connection, a pipe or a file that took the
number since), and for one that waited, its inode the one seen at accept.

The local socket and the TCP socket have separate caps, so peers on the
network can never lock local clients (the operator's CLI) out.

Budget: of the open-file limit, BASE_FDS are the interpreter's, zmq's, the
logs' and (in a supervisor) the zygote's (about 30 measured), BURST_FDS are
the margin, and the service's own work holds what it says (`held`: a
supervisor's sessions, a router's node links); client connections get the
rest. A supervisor keeps FD_RESERVE back from sessions (its limits.py), so
clients get at least that less the above, and whatever sessions do not use
when `max_sessions` is set below what the descriptor limit allows.
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from hermes_sup.local.frames import NOBLOCK, recv_frames
from hermes_sup.local.logfmt import kv

from .throttle import Throttle, flush_all, flush_due

log = logging.getLogger("hermes_sup.door")

# The budget (see the module docstring): descriptors of the service's
# own, the margin for connections taken before the gate shuts them, and the
# fewest client connections a socket gets however tight the limit.
BASE_FDS = 64
BURST_FDS = 64
MIN_CLIENTS = 8
# A refused connection may wait this long for a first request to answer.
REFUSAL_GRACE = 1.0
REFUSALS_WAITING = 16
# How long a refusal answer has to leave before its connection is shut.
REFUSAL_LINGER = 0.2
# How often the gate checks its counts against the descriptors themselves
# (a connection whose end it missed must not hold a place for good).
RECOUNT_INTERVAL = 5.0
POLL_MS = 1000
# The door stays closed at least this long after the last refusal.
DOOR_HOLD = 1.0

REFUSED = Throttle(log, "client_refused")
DOOR = Throttle(log, "client_door_closed")
EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
ACCEPTED, DISCONNECTED = int(zmq.EVENT_ACCEPTED), int(zmq.EVENT_DISCONNECTED)
# A monitor event's first frame: the event (uint16) and its value (uint32).
# Read here rather than with pyzmq's parse_monitor_message, which took 7 us
# of the 13 a refusal costs when a flood is to be outrun.
EVENT_HEAD = struct.Struct("=HI")


def client_caps(fd_limit: int, held: int, wanted: int | None, tcp: bool) -> tuple[int, int]:
    """How many connections the local socket and the TCP socket may each
    hold under `fd_limit` descriptors, with the `held` descriptors of the
    service's own work budgeted first: `wanted` (max_clients, both
    together), lowered to what is safe, or what is safe. With TCP on, each
    socket gets half."""
    room = fd_limit - BASE_FDS - BURST_FDS - held
    total = max(room, MIN_CLIENTS * (2 if tcp else 1))
    if wanted is not None:
        total = min(total, wanted)  # an operator may ask for fewer
    if not tcp:
        return max(total, 1), 0
    local = max(total // 2, 1)
    return local, max(total - local, 1)


@dataclass
class Watched:
    """One client socket the gate watches."""

    index: int  # the front socket's index (fronts.py)
    name: str  # for the log: "control" or "tcp"
    cap: int
    address: Callable[[bytes], bool]  # is this local sockaddr the socket's own?
    monitor: zmq.Socket[bytes]
    other: Callable[[list[bytes]], None] | None  # events other than accept/disconnect
    door: Door | None = None
    live: dict[int, int] = field(default_factory=dict)  # fd -> inode
    last_refusal: float = 0.0
    refused_while_full: int = 0  # since it was last under its cap


@dataclass
class Refusal:
    """A connection over the cap, waiting a moment to be told why."""

    index: int
    inode: int
    deadline: float
    name: str
    cap: int


class Gate:
    """Counts and caps client connections from a thread of its own."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.ctx = ctx
        self.watched: list[Watched] = []
        # Read by the event loop (fronts.py) for every request while not
        # empty; entries are taken with pop, by whichever side is first.
        self.refusing: dict[int, Refusal] = {}
        self.refused = 0
        self._thread: threading.Thread | None = None
        self._stop_send: zmq.Socket[bytes] | None = None
        self._stop_recv: zmq.Socket[bytes] | None = None

    def watch(
        self,
        sock: zmq.Socket[bytes],
        index: int,
        name: str,
        cap: int,
        address: Callable[[bytes], bool],
        extra_events: int = 0,
        other: Callable[[list[bytes]], None] | None = None,
        door: Door | None = None,
    ) -> None:
        """Watch a client socket: call before it binds, so no connection is
        missed. `extra_events` go to `other` (e.g. failed handshakes); `door`
        is closed while the socket is full."""
        endpoint = f"inproc://hermes-sup-gate-{index}"
        sock.monitor(endpoint, EVENTS | extra_events)
        monitor = self.ctx.socket(zmq.PAIR)
        monitor.setsockopt(zmq.LINGER, 0)
        # Unlimited: a dropped event would be a connection never counted,
        # or one counted for good.
        monitor.setsockopt(zmq.RCVHWM, 0)
        monitor.connect(endpoint)
        self.watched.append(Watched(index, name, cap, address, monitor, other, door))

    def start(self) -> None:
        """Start the gate's thread (after `watch`, before clients come)."""
        self._stop_recv = self.ctx.socket(zmq.PAIR)
        self._stop_recv.setsockopt(zmq.LINGER, 0)
        self._stop_recv.bind("inproc://hermes-sup-gate-stop")
        self._stop_send = self.ctx.socket(zmq.PAIR)
        self._stop_send.setsockopt(zmq.LINGER, 0)
        self._stop_send.connect("inproc://hermes-sup-gate-stop")
        self._thread = threading.Thread(target=self._run, name="hermes-sup-gate", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and close the gate's sockets (before ctx.term)."""
        if self._thread is not None and self._stop_send is not None:
            self._stop_send.send(b"stop")
            self._thread.join(5.0)
        for sock in (self._stop_send, self._stop_recv):
            if sock is not None:
                sock.close(0)
        if self._thread is None or not self._thread.is_alive():
            for watched in self.watched:
                watched.monitor.close(0)
        for watched in self.watched:
            if watched.door is not None:
                watched.door.remove()
        flush_all()

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        assert self._stop_recv is not None
        poller = zmq.Poller()
        poller.register(self._stop_recv, zmq.POLLIN)
        by_socket = {}
        for watched in self.watched:
            poller.register(watched.monitor, zmq.POLLIN)
            by_socket[watched.monitor] = watched
        next_recount = time.monotonic() + RECOUNT_INTERVAL
        while True:
            try:
                ready = dict(poller.poll(self._poll_ms()))
            except zmq.ZMQError:
                return
            if self._stop_recv in ready:
                return
            for sock in ready:
                ready_one = by_socket.get(sock)
                if ready_one is not None:
                    self._drain(ready_one)
            now = time.monotonic()
            self._expire(now)
            self._reopen(now)
            if now >= next_recount:
                next_recount = now + RECOUNT_INTERVAL
                self._recount()
            flush_due()

    def _poll_ms(self) -> int:
        if not self.refusing:
            return POLL_MS
        soonest = min((r.deadline for r in list(self.refusing.values())), default=0.0)
        return max(1, min(POLL_MS, int((soonest - time.monotonic()) * 1000) + 1))

    def _drain(self, watched: Watched) -> None:
        monitor = watched.monitor
        while True:
            try:
                frames = recv_frames(monitor, NOBLOCK)
            except zmq.Again:
                return
            try:
                self._on_event(watched, frames)
            except Exception:
                log.exception(kv("bug", where="client gate"))

    def _on_event(self, watched: Watched, frames: list[bytes]) -> None:
        kind, fd = EVENT_HEAD.unpack_from(frames[0])
        if kind == ACCEPTED:
            if len(watched.live) < watched.cap:
                inode = _identify(fd, watched.address)
                if inode is not None:  # else gone, and the number another's
                    watched.live[fd] = inode
            else:
                self._refuse(watched, fd)
        elif kind == DISCONNECTED:
            if watched.live.pop(fd, None) is not None:
                watched.refused_while_full = 0  # under its cap again
            self.refusing.pop(fd, None)
        elif watched.other is not None:
            watched.other(frames)

    def _refuse(self, watched: Watched, fd: int) -> None:
        self.refused += 1
        watched.last_refusal = time.monotonic()
        watched.refused_while_full += 1
        # More refused than can wait to be told, while the socket stays
        # full: a flood, not a client too many. Close the door before the
        # flood runs the descriptors out.
        door = watched.door
        flood = watched.refused_while_full > REFUSALS_WAITING
        if flood and door is not None and not door.closed and door.close() and DOOR.due():
            log.warning(
                kv(
                    "client_door_closed",
                    socket=watched.name,
                    limit=watched.cap,
                    reason="at the client connection limit; new connections wait",
                )
            )
        if REFUSED.due():
            log.warning(
                kv(
                    "client_refused",
                    socket=watched.name,
                    connections=len(watched.live),
                    limit=watched.cap,
                    hint="close idle clients, or raise max_clients or the open-file limit",
                )
            )
        if len(self.refusing) >= REFUSALS_WAITING:
            shut(fd, watched.address)  # the fast way: a flood is on
            return
        inode = _identify(fd, watched.address)
        if inode is not None:
            self.refusing[fd] = Refusal(
                watched.index,
                inode,
                time.monotonic() + REFUSAL_GRACE,
                watched.name,
                watched.cap,
            )

    def _expire(self, now: float) -> None:
        for fd, refusal in list(self.refusing.items()):
            if refusal.deadline <= now and self.refusing.pop(fd, None) is refusal:
                shut_known(fd, refusal.inode)

    def _reopen(self, now: float) -> None:
        """Give a socket its name back once it is under its cap again."""
        for watched in self.watched:
            door = watched.door
            if (
                door is not None
                and door.closed
                and len(watched.live) < watched.cap
                and now - watched.last_refusal >= DOOR_HOLD
            ):
                door.open()
                log.info(kv("client_door_opened", socket=watched.name))

    def _recount(self) -> None:
        """Forget connections whose descriptor no longer holds them."""
        for watched in self.watched:
            for fd, inode in list(watched.live.items()):
                if _inode(fd) != inode:
                    watched.live.pop(fd, None)

    # ------------------------------------------------------ the event loop's

    def take_refusal(self, fd: int) -> Refusal | None:
        """The refusal waiting on descriptor `fd`, if a request came in on a
        refused connection; it is then the caller's to answer and shut."""
        refusal = self.refusing.pop(fd, None)
        if refusal is not None and _inode(fd) != refusal.inode:
            return None  # that connection is gone; the number is another's now
        return refusal


class Door:
    """The name of a unix socket, which the gate can close to newcomers.

    Closing it keeps the real socket under a second name (a hard link) and
    renames a stand-in over the first: a listening socket nobody accepts
    on, so connections to it wait in the kernel (a blocking connect) or are
    refused for now (a zmq client tries again later). Opening it renames the
    real socket back. Renames are atomic: the name is never missing, and a
    client never concludes that no supervisor runs. The stand-in is made
    ahead, so closing needs no descriptor when there are none to spare."""

    def __init__(self, path: str) -> None:
        self.path = path
        # Names no longer than `control.sock`, so they fit sun_path as it does.
        base = os.path.dirname(path)
        self.aside = os.path.join(base, "control.real")
        self.spare = os.path.join(base, "control.door")
        self.closed = False
        self._standin: socket.socket | None = None
        self._prepare()

    def _prepare(self) -> None:
        _unlink(self.spare)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(self.spare)
        except OSError:
            sock.close()
            raise
        finally:
            os.umask(old)
        sock.listen(0)
        self._standin = sock

    def close(self) -> bool:
        """Put the stand-in in the socket's place; False if there is none."""
        if self.closed:
            return True
        if self._standin is None:
            try:
                self._prepare()
            except OSError:
                return False
        try:
            _unlink(self.aside)
            os.link(self.path, self.aside)
            os.rename(self.spare, self.path)
        except OSError as exc:
            log.error(kv("client_door_failed", path=self.path, error=exc))
            return False
        self.closed = True
        return True

    def open(self) -> None:
        """Give the real socket its name back, and make the next stand-in."""
        if not self.closed:
            return
        try:
            os.rename(self.aside, self.path)
        except OSError as exc:
            log.error(kv("client_door_failed", path=self.path, error=exc))
            return
        self.closed = False
        if self._standin is not None:
            self._standin.close()
            self._standin = None
        try:
            self._prepare()
        except OSError:
            pass  # again at the next close

    def remove(self) -> None:
        """At shutdown: the real socket back in place, the stand-in gone."""
        self.open()
        if self._standin is not None:
            self._standin.close()
            self._standin = None
        _unlink(self.spare)
        _unlink(self.aside)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _inode(fd: int) -> int | None:
    try:
        return os.fstat(fd).st_ino
    except OSError:
        return None


# getsockname(2) and shutdown(2) on a bare descriptor: a Python socket
# object around it cost 5 us of a refusal, and a refusal must be cheaper
# for the gate than an accept is for libzmq, or a flood outruns it.
_libc = ctypes.CDLL(None, use_errno=True)
_getsockname = _libc.getsockname
_getsockname.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32)]
_shutdown = _libc.shutdown
_shutdown.argtypes = [ctypes.c_int, ctypes.c_int]
_SOCKADDR_SIZE = 128  # sockaddr_storage
_local = threading.local()


def local_address(fd: int) -> bytes | None:
    """The raw local sockaddr of descriptor `fd`; None if it is not a socket."""
    buf = getattr(_local, "buf", None)
    if buf is None:
        buf = _local.buf = ctypes.create_string_buffer(_SOCKADDR_SIZE)
        _local.size = ctypes.c_uint32()
    size = _local.size
    size.value = _SOCKADDR_SIZE
    if _getsockname(fd, buf, ctypes.byref(size)) != 0:
        return None
    return buf.raw[: size.value]


def unix_address(path: str) -> Callable[[bytes], bool]:
    """Matches the local address of a connection on the unix socket `path`."""
    family = struct.pack("=H", socket.AF_UNIX)
    want = family + path.encode()
    return lambda raw: raw.rstrip(b"\0") == want


def tcp_address(port: int) -> Callable[[bytes], bool]:
    """Matches the local address of a TCP connection to `port` (v4 or v6)."""
    families = {struct.pack("=H", socket.AF_INET), struct.pack("=H", socket.AF_INET6)}
    want = port.to_bytes(2, "big")
    return lambda raw: raw[:2] in families and raw[2:4] == want


def _identify(fd: int, address: Callable[[bytes], bool]) -> int | None:
    """The inode of `fd` if it is a connection on the watched socket."""
    raw = local_address(fd)
    if raw is None or not address(raw):
        return None
    return _inode(fd)


def shut(fd: int, address: Callable[[bytes], bool]) -> None:
    """Shut a connection down if `fd` is one on the watched socket: libzmq
    sees it end and closes the descriptor itself (never close it here)."""
    raw = local_address(fd)
    if raw is not None and address(raw):
        _shutdown(fd, socket.SHUT_RDWR)


def shut_known(fd: int, inode: int) -> None:
    """Shut a refused connection down, if `fd` is still that connection."""
    if _inode(fd) == inode:
        _shutdown(fd, socket.SHUT_RDWR)
