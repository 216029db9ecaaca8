"""The client gate: client connections counted, capped, and refused beyond the cap.

Theory of operation
-------------------
Every client connection costs the supervisor a file descriptor, and libzmq
aborts the whole process when it cannot get one: an ipc listener's accept()
failing with EMFILE is an assertion (`Too many open files
(src/ipc_listener.cpp)`), and so is a new zmq socket's mailbox. 1,100
connections under `ulimit -n 1024` took the supervisor and every worker
down. libzmq itself has no limit on a socket's connections, and no way to
pause a listener without closing every connection it accepted.

So the gate watches each client socket's monitor: EVENT_ACCEPTED names the
new connection's descriptor, EVENT_DISCONNECTED its end. Connections up to
the socket's cap are counted; one over it is refused: shut down (shutdown(2),
not close: the descriptor stays libzmq's, which then sees the connection end
and closes it itself). Before it is shut down, a refused connection may wait
a moment (REFUSAL_GRACE) for its first request, to be answered with an
`overloaded` error that says why (endpoints.py reads the descriptor a
request came from); at most REFUSALS_WAITING wait at once, the rest are shut
at once. Refusals are logged through a throttle.

The gate runs in its own thread, blocked on the monitors: a connection flood
must be answered while the event loop is busy with something else, and the
descriptors libzmq takes meanwhile are the gate's margin (BURST_FDS in the
budget below). A descriptor is only ever shut down once it is known to be
the same connection: the local address must be the socket's own (not a
worker's connection, a pipe or a file that took the number since) and its
inode the one recorded at accept.

The local socket and the TCP socket have separate caps, so peers on the
network can never lock local clients (the operator's CLI) out.

Budget: of the descriptors `limits.py` keeps back from sessions
(FD_RESERVE), BASE_FDS are the interpreter's, zmq's, the logs' and the
zygote's (about 30 measured) and BURST_FDS are the margin; client
connections get the rest, and whatever sessions do not use when
`max_sessions` is set below what the descriptor limit allows.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import parse_monitor_message

from .limits import FDS_PER_SESSION, allowed_sessions
from .logfmt import kv
from .throttle import Throttle, flush_all, flush_due

log = logging.getLogger("hermes_sup.supervisor")

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

REFUSED = Throttle(log, "client_refused")
EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED


def client_caps(
    fd_limit: int,
    spare_workers: int,
    max_sessions: int | None,
    wanted: int | None,
    tcp: bool,
) -> tuple[int, int]:
    """How many connections the local socket and the TCP socket may each
    hold under `fd_limit` descriptors, with sessions budgeted first:
    `wanted` (max_clients, both together), lowered to what is safe, or what
    is safe. With TCP on, each socket gets half."""
    sessions = allowed_sessions(fd_limit, spare_workers, max_sessions)
    room = fd_limit - BASE_FDS - BURST_FDS - FDS_PER_SESSION * (sessions + spare_workers)
    total = max(room, MIN_CLIENTS * (2 if tcp else 1))
    if wanted is not None:
        total = min(total, wanted)
    if not tcp:
        return max(total, MIN_CLIENTS), 0
    local = max(total // 2, MIN_CLIENTS)
    return local, max(total - total // 2, MIN_CLIENTS)


@dataclass
class Watched:
    """One client socket the gate watches."""

    index: int  # the front socket's index (endpoints.py)
    name: str  # for the log: "control" or "tcp"
    cap: int
    address: Callable[[object], bool]  # is this local address the socket's own?
    monitor: zmq.Socket[bytes]
    other: Callable[[list[bytes]], None] | None  # events other than accept/disconnect
    live: dict[int, int] = field(default_factory=dict)  # fd -> inode


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
        # Read by the event loop (endpoints.py) for every request while not
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
        address: Callable[[object], bool],
        extra_events: int = 0,
        other: Callable[[list[bytes]], None] | None = None,
    ) -> None:
        """Watch a client socket: call before it binds, so no connection is
        missed. `extra_events` go to `other` (e.g. failed handshakes)."""
        endpoint = f"inproc://hermes-sup-gate-{index}"
        sock.monitor(endpoint, EVENTS | extra_events)
        monitor = self.ctx.socket(zmq.PAIR)
        monitor.setsockopt(zmq.LINGER, 0)
        # Unlimited: a dropped event would be a connection never counted,
        # or one counted for good.
        monitor.setsockopt(zmq.RCVHWM, 0)
        monitor.connect(endpoint)
        self.watched.append(Watched(index, name, cap, address, monitor, other))

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
        while True:
            try:
                frames = watched.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._on_event(watched, frames)
            except Exception:
                log.exception(kv("bug", where="client gate"))

    def _on_event(self, watched: Watched, frames: list[bytes]) -> None:
        event = parse_monitor_message(frames)
        kind, fd = event["event"], int(event["value"])
        if kind == zmq.EVENT_ACCEPTED:
            self._on_accepted(watched, fd)
        elif kind == zmq.EVENT_DISCONNECTED:
            watched.live.pop(fd, None)
            self.refusing.pop(fd, None)
        elif watched.other is not None:
            watched.other(frames)

    def _on_accepted(self, watched: Watched, fd: int) -> None:
        inode = _identify(fd, watched.address)
        if inode is None:
            return  # already gone, and the number taken by something else
        if len(watched.live) < watched.cap:
            watched.live[fd] = inode
            return
        self.refused += 1
        REFUSED.warning(
            kv(
                "client_refused",
                socket=watched.name,
                connections=len(watched.live),
                limit=watched.cap,
                hint="close idle clients, or raise max_clients or the open-file limit",
            )
        )
        if len(self.refusing) < REFUSALS_WAITING:
            self.refusing[fd] = Refusal(
                watched.index,
                inode,
                time.monotonic() + REFUSAL_GRACE,
                watched.name,
                watched.cap,
            )
        else:
            shut(fd, inode)

    def _expire(self, now: float) -> None:
        for fd, refusal in list(self.refusing.items()):
            if refusal.deadline <= now and self.refusing.pop(fd, None) is refusal:
                shut(fd, refusal.inode)

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


def _inode(fd: int) -> int | None:
    try:
        return os.fstat(fd).st_ino
    except OSError:
        return None


def _identify(fd: int, address: Callable[[object], bool]) -> int | None:
    """The inode of `fd` if it is a connection on the watched socket."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        if not address(sock.getsockname()):
            return None
        return os.fstat(fd).st_ino
    except OSError:
        return None
    finally:
        sock.detach()  # the descriptor is libzmq's: never close it here


def shut(fd: int, inode: int) -> None:
    """Shut a refused connection down, if `fd` is still that connection.
    libzmq sees it end and closes the descriptor itself."""
    if _inode(fd) != inode:
        return
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.detach()
