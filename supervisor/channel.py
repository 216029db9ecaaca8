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
    recv_frames,
    recv_frames_from,
    send_frames,
)

log = logging.getLogger("hermes_sup.supervisor")

BATCH = 256


class Channel:
    """One socket, one handler for what arrives on it."""

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        handler: Callable[[list[bytes]], None],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.sock = sock
        self.handler = handler
        self.loop = loop
        self._scheduled = False
        self._refused: Mapping[int, object] = {}
        self._on_refused: Callable[[int, list[bytes]], bool] | None = None
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
        if self.sock.closed:
            return
        for _ in range(BATCH):
            if not int(self.sock.getsockopt(EVENTS)) & POLLIN:
                return
            try:
                if self._refused:
                    frames, fd = recv_frames_from(self.sock, NOBLOCK)
                else:
                    frames, fd = recv_frames(self.sock, NOBLOCK), -1
            except zmq.Again:
                return
            try:
                screen = self._on_refused
                if fd >= 0 and screen is not None and fd in self._refused and screen(fd, frames):
                    continue
                self.handler(frames)
            except Exception:
                # A bug in a handler must not stop the socket being served.
                log.exception("handler failed for a message; continuing")
        self._schedule()  # more waiting: let other work run, then continue

    def send(self, frames: list[bytes]) -> None:
        """Send without blocking; raises zmq.Again (queue full) or zmq.ZMQError."""
        try:
            send_frames(self.sock, frames, NOBLOCK)
        finally:
            events = 0 if self.sock.closed else int(self.sock.getsockopt(EVENTS))
            if events & POLLIN:
                self._schedule()

    def close(self) -> None:
        """Stop watching and close the socket at once (linger 0)."""
        self.loop.remove_reader(self._fd)
        self.sock.close(0)
