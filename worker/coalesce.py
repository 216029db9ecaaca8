"""Coalescing a turn's stream at the source: many small deltas, fewer events.

An agent streams its reply token by token, and a command's output comes
line by line: hundreds of events a second per session, each one signed,
routed, recorded and sent by the supervisor, and drawn by a front end that
can only show so many updates a second. So the worker merges the stream
deltas a turn produces within a short window into one event before it
sends them.

Theory of operation
-------------------
A *delta* is an event of a type in DELTA_TYPES whose data is a string:
`token` (a piece of text; merged by concatenation) or `output` (one line of
a command's output; merged lines are joined by "\\n", so a client printing
each event's data as a line prints the same bytes). Anything else (tool,
approval, status, ... and the turn's reply or error) is a *barrier*.

The window is a throttle with a leading edge. A delta that comes while no
window is open is sent at once and opens one: so a turn's first delta, and
the first after a pause, are never held. Deltas that come while the window
is open are held, merged with the held one of the same type (a delta of
another type sends the held one first). When the window closes, what is
held is sent and a new window opens. A barrier sends what is held first,
then itself: nothing is ever sent out of order, and a tool call, an
approval request or the reply never waits behind deltas.

Merged events keep the shape of the first delta they merge: same type, same
session and turn, its timestamp (so the lag measured from it is the
longest of the merged deltas'). A merged event never grows past
MAX_MERGED_BYTES (nor the frame limit): a larger one is sent as it stands
and the next delta starts a new one. A window of 0 turns all of this off.

The `Coalescer` does no I/O and reads no clock of its own: the worker's
main loop hands it messages and the time, and sends what it returns.
"""

from __future__ import annotations

from collections.abc import Callable

from hermes_sup.protocol import Kind, Message

# Event types whose string data is a piece of a stream, and how two pieces join.
DELTA_TYPES: dict[str, str] = {"token": "", "output": "\n"}
# The supervisor's default window (stream_coalesce_ms), in milliseconds: a
# front end redraws about this often at most, and the lag it adds stays far
# below what a person notices.
DEFAULT_WINDOW_MS = 10.0
# Merged events stay well under any frame limit and cheap to re-send.
MAX_MERGED_BYTES = 64 * 1024


def delta_type(msg: Message) -> str | None:
    """The stream type of `msg` if it is a delta (see the module docstring)."""
    if msg.kind is not Kind.EVENT:
        return None
    body = msg.body
    kind = body.get("type")
    if kind in DELTA_TYPES and isinstance(body.get("data"), str):
        return str(kind)
    return None


class Coalescer:
    """Merges one worker's stream deltas within a window; see the module docstring.

    `send` is called with each message to send, in order. `offer` takes the
    next message the turn produced; `tick` sends what is held once its
    window has closed; `deadline` says when that is, for the main loop's
    poll timeout."""

    def __init__(
        self,
        send: Callable[[Message], None],
        window_ms: float = DEFAULT_WINDOW_MS,
        max_bytes: int = MAX_MERGED_BYTES,
    ) -> None:
        self.send = send
        self.window = max(0.0, window_ms) / 1000.0
        self.max_bytes = max_bytes
        self.window_end = 0.0  # the open window's end; <= now: none open
        # What is held: the first delta merged (its envelope is kept), the
        # pieces of data so far, their size in bytes (roughly: characters).
        self._first: Message | None = None
        self._pieces: list[str] = []
        self._size = 0
        self.merged = 0  # deltas that went out inside another's event

    @property
    def holding(self) -> bool:
        """Whether a delta is held (the main loop then wakes by `deadline`)."""
        return self._first is not None

    @property
    def deadline(self) -> float | None:
        """When what is held must go out (time.monotonic()); None if nothing is."""
        return self.window_end if self._first is not None else None

    def offer(self, msg: Message, now: float) -> None:
        """Take the turn's next message: send it, hold it, or merge it."""
        self.tick(now)  # a window that has closed sends its deltas first
        kind = delta_type(msg) if self.window > 0 else None
        if kind is None:
            self.flush()  # a barrier: what is held goes first
            self.send(msg)
            if msg.kind is not Kind.EVENT:
                self.window_end = 0.0  # the turn is over: the next one starts afresh
            return
        first = self._first
        if first is not None:
            data: str = msg.body["data"]
            if first.body["type"] == kind and self._size + len(data) <= self.max_bytes:
                self._pieces.append(data)
                self._size += len(data)
                self.merged += 1
                return
            self.flush()  # another type, or full: the held one goes as it stands
        if now < self.window_end:
            self._hold(msg)
        else:
            self.send(msg)  # leading edge: no window open, so no wait
            self.window_end = now + self.window

    def tick(self, now: float) -> None:
        """Send what is held if its window has closed, and open the next."""
        if self._first is not None and now >= self.window_end:
            self.flush()
            self.window_end = now + self.window

    def flush(self) -> None:
        """Send what is held now, merged into one event."""
        first = self._first
        if first is None:
            return
        pieces = self._pieces
        self._first, self._pieces, self._size = None, [], 0
        if len(pieces) == 1:
            self.send(first)
            return
        kind = first.body["type"]
        merged = Message(
            Kind.EVENT,
            {"type": kind, "data": DELTA_TYPES[kind].join(pieces)},
            session=first.session,
            re=first.re,
            id=first.id,
            ts=first.ts,
        )
        self.send(merged)

    def _hold(self, msg: Message) -> None:
        data: str = msg.body["data"]
        self._first, self._pieces, self._size = msg, [data], len(data)
