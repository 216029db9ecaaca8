"""A zmq socket driven by the asyncio loop without a future per message.

A zmq socket's FD is edge-triggered: it signals "something changed", and any
operation on the socket (a send included) may consume that edge while input
is waiting. So: on FD readiness, drain while EVENTS says POLLIN (in bounded
batches, yielding to the loop between them); after every send, look at
EVENTS again and schedule a drain if input is now pending. Nothing blocks:
sends use NOBLOCK and the caller decides what a full queue means.

zmq.asyncio would await one future per message, which costs several times
the routing work itself at the message rates a supervisor of many sessions
sees; this keeps the whole supervisor on one asyncio loop all the same.

A client socket's channel can be given a screen (`screen`): while the
client gate has refused connections waiting for an answer, each message's
source descriptor is read, and one from a refused connection goes to the
screen instead of the handler. With none waiting, it costs one check.

A channel made with `keep_last` (the TCP socket's) keeps the last frame of
the message its handler is given, as zmq received it: its metadata names
the CURVE key the connection authenticated with (`peer_user_id`), which a
handler asks for only for the rare request that needs it (`drain`). The
frames are received without copying (copy=False) on every channel alike;
keeping the last one is one reference, not a property read per message.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

import zmq

# The frame helpers and plain-int flags are the client's too (hermes_sup.local).
from hermes_sup.local.frames import (
    EVENTS,
    NOBLOCK,
    POLLIN,
    SRCFD,
    recv_frames,
    recv_frames_from,
    send_frames,
)

log = logging.getLogger("hermes_sup.door")

BATCH = 256
# The metadata property libzmq sets from the ZAP handler's reply (the
# supervisor's authenticator answers with the client's Z85 public key).
USER_ID = "User-Id"
_recv = zmq.backend.Socket.recv
# The backend's getsockopt, called unbound: a plain int for EVENTS, without
# the sugar's option handling (read once per message received or sent).
_getsockopt = zmq.backend.Socket.get


def _events(sock: zmq.Socket[bytes]) -> int:
    """The socket's EVENTS bits (an int option: typed here as one)."""
    return int(_getsockopt(sock, EVENTS))


class Channel:
    """One socket, one handler for what arrives on it."""

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        handler: Callable[[list[bytes]], None],
        loop: asyncio.AbstractEventLoop,
        keep_last: bool = False,
    ) -> None:
        self.sock = sock
        self.handler = handler
        self.loop = loop
        self._scheduled = False
        self._refused: Mapping[int, object] = {}
        self._on_refused: Callable[[int, list[bytes]], bool] | None = None
        self._keep_last = keep_last
        # The last frame of the message being handled (keep_last only).
        self.last: zmq.Frame | None = None
        self._fd: int = int(sock.getsockopt(zmq.FD))
        loop.add_reader(self._fd, self._drain)
        self._schedule()  # input may have arrived before we were watching

    def screen(
        self, refused: Mapping[int, object], on_refused: Callable[[int, list[bytes]], bool]
    ) -> None:
        """While `refused` (descriptors of refused connections) is not
        empty, a message from one of them goes to `on_refused(fd, frames)`;
        it returns False to have the message handled as usual."""
        self._refused, self._on_refused = refused, on_refused

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._scheduled = False
        if self._read(BATCH):
            self._schedule()  # more waiting: let other work run, then continue

    def read_waiting(self, limit: int) -> bool:
        """Handle what is waiting now, up to `limit` messages, without
        yielding to the loop: for a caller about to judge by what has
        arrived. True if more is still waiting."""
        more = self._read(limit)
        if more:
            self._schedule()
        return more

    def _read(self, limit: int) -> bool:
        """Handle up to `limit` messages; True if more may be waiting."""
        if self.sock.closed:
            return False
        for _ in range(limit):
            if not _events(self.sock) & POLLIN:
                return False
            try:
                if self._keep_last:
                    frames, self.last = _recv_keeping_last(self.sock)
                    fd = _source_fd(self.last) if self._refused else -1
                elif self._refused:
                    frames, fd = recv_frames_from(self.sock, NOBLOCK)
                else:
                    frames, fd = recv_frames(self.sock, NOBLOCK), -1
            except zmq.Again:
                return False
            try:
                screen = self._on_refused
                if fd >= 0 and screen is not None and fd in self._refused and screen(fd, frames):
                    continue
                self.handler(frames)
            except Exception:
                # A bug in a handler must not stop the socket being served.
                log.exception("handler failed for a message; continuing")
            finally:
                self.last = None  # it names this message's sender only
        return True

    def peer_user_id(self) -> str | None:
        """The User-Id of the connection the message being handled came in
        on (its CURVE key, Z85), or None: not a keep_last channel, or zmq
        says none (no ZAP handler: no CURVE on this socket)."""
        frame = self.last
        if frame is None:
            return None
        try:
            value = frame.get(USER_ID)
        except zmq.ZMQError:
            return None
        return value if isinstance(value, str) and value else None

    def send(self, frames: list[bytes]) -> None:
        """Send without blocking; raises zmq.Again (queue full) or zmq.ZMQError."""
        try:
            send_frames(self.sock, frames, NOBLOCK)
        finally:
            events = 0 if self.sock.closed else _events(self.sock)
            if events & POLLIN:
                self._schedule()

    def close(self) -> None:
        """Stop watching and close the socket at once (linger 0)."""
        self.loop.remove_reader(self._fd)
        self.sock.close(0)


def _recv_keeping_last(sock: zmq.Socket[bytes]) -> tuple[list[bytes], zmq.Frame]:
    """recv_frames (local/frames.py), and the last frame as zmq received it."""
    frames = []
    while True:
        frame = _recv(sock, NOBLOCK, copy=False)
        frames.append(frame.bytes)
        if not frame.more:
            return frames, frame


def _source_fd(frame: zmq.Frame) -> int:
    """The descriptor of the connection a frame came in on (-1: zmq does not say)."""
    try:
        return int(frame.get(SRCFD))
    except zmq.ZMQError:
        return -1
