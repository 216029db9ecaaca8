"""The client's protocol logic, without I/O (sans-IO, as in h11).

`ClientCore` turns requests into signed frames and incoming frames into
answers matched to the request they belong to. It never touches a socket,
a clock or a thread: the blocking and asyncio transports each drive one.

A request is *pending* until its final answer arrives:
  - a plain request (ping, open, list, kill, ...): its one answer;
  - `send`: `event`s, then one `reply` or `error`;
  - `watch` and `logs` with follow: events until `unwatched` or an `error`.

A client that reads too slowly may miss some of a stream (PROTOCOL.md,
"Slow consumers"): the supervisor then sends that stream an event
`dropped`. Events it dropped are gone, but a turn's final answer must not
be: one kept for the client follows the notice, yet beyond what the
supervisor keeps the oldest are dropped too. So on a `dropped` notice for a
`send` the core queues the very same frames again (`outbox`, which the
transport sends): a resend is answered with the turn's final answer if it
has ended, `duplicate` and the rest of the turn if not, or an `expired` /
`too_large` error, never a second run. Either way the turn ends.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from hermes_sup.protocol import (
    Kind,
    Limits,
    Message,
    RemoteProtocolError,
    decode,
    encode,
)

from .errors import error_for

# Request kinds answered by a stream of events rather than one message.
STREAMING = frozenset({Kind.SEND, Kind.WATCH})


@dataclass
class Pending:
    """One request waiting for its answers."""

    id: str
    kind: Kind
    session: str | None
    stream: bool
    inbox: deque[Message] = field(default_factory=deque)
    done: bool = False
    frames: list[bytes] | None = None  # a send's own frames, to resend them

    def pop(self) -> Message | None:
        """The next answer that arrived, if any."""
        return self.inbox.popleft() if self.inbox else None


def is_final(pending: Pending, msg: Message) -> bool:
    """Whether `msg` is the last answer `pending` will get."""
    if not pending.stream or msg.kind is Kind.ERROR:
        return True
    if pending.kind is Kind.SEND:
        return msg.kind is not Kind.EVENT
    # watch, logs with follow: a first answer (log_lines), events, `unwatched`
    return msg.kind is Kind.EVENT and msg.body.get("type") == "unwatched"


def is_dropped_notice(msg: Message) -> bool:
    """Whether `msg` says the supervisor dropped some of its stream."""
    return msg.kind is Kind.EVENT and msg.body.get("type") == "dropped"


def check(msg: Message) -> Message:
    """Raise the typed error if `msg` is an `error`; else return it."""
    if msg.kind is Kind.ERROR:
        raise error_for(str(msg.body.get("code")), str(msg.body.get("message")), msg.session)
    return msg


class ClientCore:
    """Protocol state of one client connection (one socket)."""

    def __init__(self, key: bytes, limits: Limits | None = None) -> None:
        self.key = key
        self.limits = limits or Limits()
        self.pending: dict[str, Pending] = {}
        self.dropped = 0  # frames that were not ours: bad signature, unknown request
        self.outbox: list[list[bytes]] = []  # frames the transport must send (resends)

    def request(
        self,
        kind: Kind,
        body: dict[str, Any] | None = None,
        session: str | None = None,
        *,
        stream: bool | None = None,
        msg_id: str | None = None,
        ttl: float | None = None,
    ) -> tuple[Pending, list[bytes]]:
        """A new pending request and the frames to send for it. With `ttl`
        (the seconds its sender will wait for a first answer) the supervisor
        refuses it when it arrives later than that."""
        msg = Message(kind, body or {}, session=session, ttl=ttl)
        if msg_id is not None:
            msg = Message(kind, body or {}, session=session, id=msg_id, ttl=ttl)
        frames = encode(msg, self.key, self.limits)
        if stream is None:
            # `logs` with follow streams its new lines after the first answer.
            stream = kind in STREAMING or (kind is Kind.LOGS and bool((body or {}).get("follow")))
        pending = Pending(msg.id, kind, session, stream)
        if kind is Kind.SEND:
            pending.frames = frames
        self.pending[msg.id] = pending
        return pending, frames

    def notice(self, kind: Kind, body: dict[str, Any], session: str | None = None) -> list[bytes]:
        """Frames for a message whose answer nobody waits for (unwatch, cancel)."""
        return encode(Message(kind, body, session=session), self.key, self.limits)

    def receive(self, frames: list[bytes]) -> Pending | None:
        """Take one incoming message; returns the request it belongs to (its
        answer is in that request's inbox), or None if it was dropped."""
        try:
            msg = decode(frames, self.key, self.limits)
        except RemoteProtocolError:
            self.dropped += 1  # not signed with our key: not from our supervisor
            return None
        pending = self.pending.get(msg.re or "")
        if pending is None:
            self.dropped += 1  # an answer to a request we gave up on
            return None
        pending.inbox.append(msg)
        if is_final(pending, msg):
            pending.done = True
            del self.pending[pending.id]
        elif pending.frames is not None and is_dropped_notice(msg):
            # Its final answer may have been dropped as well: ask for it again.
            self.outbox.append(pending.frames)
        return pending

    def take_outbox(self) -> list[list[bytes]]:
        """The frames queued to send (resends), emptying the queue."""
        out, self.outbox = self.outbox, []
        return out

    def forget(self, pending: Pending) -> None:
        """Stop waiting for a request (timed out, abandoned)."""
        self.pending.pop(pending.id, None)


# ------------------------------------------------------------------ commands
# Each command is a request plus how to read its answer, shared by both
# transports so neither holds protocol logic of its own. Answers are read
# by field name: a newer supervisor may add fields (the schemas allow it).


@dataclass(frozen=True)
class Pong:
    version: str
    protocol: int
    pid: int
    uptime: float


@dataclass(frozen=True)
class Opened:
    session: str
    pid: int | None
    state: str
    created: bool


@dataclass(frozen=True)
class Killed:
    session: str
    pid: int | None
    reason: str


@dataclass(frozen=True)
class Signalled:
    session: str
    pid: int
    signal: str


@dataclass(frozen=True)
class Call:
    """A request and the function that turns its answer into a result."""

    kind: Kind
    body: dict[str, Any]
    session: str | None
    read: Any  # Callable[[Message], result]


def ping() -> Call:
    return Call(
        Kind.PING,
        {},
        None,
        lambda m: Pong(m.body["version"], m.body["protocol"], m.body["pid"], m.body["uptime"]),
    )


def open_session(session: str, options: dict[str, Any] | None) -> Call:
    body = {"options": options} if options else {}
    return Call(
        Kind.OPEN,
        body,
        session,
        lambda m: Opened(session, m.body["pid"], m.body["state"], m.body["created"]),
    )


def sessions(prefix: str = "", state: str | None = None) -> Call:
    body: dict[str, Any] = {"prefix": prefix} if prefix else {}
    if state:
        body["state"] = state
    return Call(Kind.LIST, body, None, lambda m: list(m.body["sessions"]))


def kill(session: str, force: bool = False, purge: bool = False) -> Call:
    return Call(
        Kind.KILL,
        {"force": force, "purge": purge},
        session,
        lambda m: Killed(session, m.body["pid"], m.body["reason"]),
    )


def status() -> Call:
    return Call(Kind.STATUS, {}, None, lambda m: dict(m.body["supervisor"]))


def logs(session: str, lines: int = 50) -> Call:
    return Call(Kind.LOGS, {"lines": lines}, session, lambda m: list(m.body["lines"]))


def cancel(session: str, turn: str | None = None) -> Call:
    body = {"turn": turn} if turn else {}
    return Call(Kind.CANCEL, body, session, lambda m: m.body["turn"])


def approve(session: str, choice: str, approval: str | None = None) -> Call:
    body = {"choice": choice} if approval is None else {"choice": choice, "approval": approval}
    return Call(Kind.APPROVE, body, session, lambda m: m.body["choice"])


def reload() -> Call:
    return Call(Kind.RELOAD, {}, None, lambda m: dict(m.body))


def signal(session: str, sig: str, group: bool = False) -> Call:
    body: dict[str, Any] = {"signal": sig, "group": True} if group else {"signal": sig}
    return Call(
        Kind.SIGNAL,
        body,
        session,
        lambda m: Signalled(session, m.body["pid"], m.body["signal"]),
    )


def inspect(session: str) -> Call:
    return Call(Kind.INSPECT, {}, session, lambda m: dict(m.body["session"]))


def turn_status(session: str, turn: str) -> Call:
    return Call(Kind.TURN_STATUS, {"turn": turn}, session, lambda m: dict(m.body))


def shutdown() -> Call:
    return Call(Kind.SHUTDOWN, {}, None, lambda m: dict(m.body))


def send_body(
    text: str,
    options: dict[str, Any] | None,
    context: dict[str, Any] | None = None,
    orphan_grace: float | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {"text": text}
    if orphan_grace is not None:
        body["orphan_grace"] = orphan_grace
    if options:
        body["options"] = options
    if context:
        body["context"] = context
    return body
