"""Typed events: what a turn streams, and what a watch sees.

Every event keeps its wire `type` and raw `data`, so nothing the supervisor
sends is lost; the common types get their own class with named fields. An
event type this client does not know arrives as a plain `Event`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hermes_sup.protocol import Kind, Message


@dataclass(frozen=True)
class Event:
    """One streamed event. `session` and `turn` are set where known."""

    type: str
    data: Any = None
    session: str | None = None
    turn: str | None = None
    replayed: bool = False


@dataclass(frozen=True)
class Queued(Event):
    """The turn waits behind others of its session."""

    position: int = 0


@dataclass(frozen=True)
class Running(Event):
    """The turn started in the worker with this pid."""

    pid: int | None = None


@dataclass(frozen=True)
class Duplicate(Event):
    """A resent `send`: the same turn continues, it does not run twice."""


@dataclass(frozen=True)
class Backoff(Event):
    """The session's worker keeps dying; the turn waits for the next try."""

    retry_in: float = 0.0
    reason: str = ""


@dataclass(frozen=True)
class Dropped(Event):
    """`count` events of this stream never reached this client: it read too
    slowly and the supervisor dropped them (`reason` "slow_consumer"). What
    was streamed is incomplete; a turn's final answer is still delivered
    (the client asks for it again if it was dropped too, see core.py)."""

    count: int = 0
    reason: str = ""


@dataclass(frozen=True)
class Token(Event):
    """A piece of streamed text."""

    text: str = ""


@dataclass(frozen=True)
class Output(Event):
    """One line of a command's output."""

    line: str = ""


@dataclass(frozen=True)
class ToolStart(Event):
    """The agent started a tool."""

    id: str = ""
    name: str = ""
    args: Any = None


@dataclass(frozen=True)
class ToolComplete(Event):
    """A tool finished."""

    id: str = ""
    name: str = ""
    result: Any = None


@dataclass(frozen=True)
class ApprovalRequest(Event):
    """The agent waits for a person to allow a command: answer with
    `approve(session, choice, approval=id)`, one of `choices`. Naming the
    `id` makes sure a late answer never approves a different command."""

    command: str = ""
    description: str = ""
    choices: tuple[str, ...] = ()
    allow_permanent: bool = False
    id: str | None = None  # None from a runtime that gives none


@dataclass(frozen=True)
class ApprovalTimeout(Event):
    """Nobody answered an approval in time: the command was denied."""

    command: str = ""
    outcome: str = ""
    id: str | None = None  # the request's id, as in its ApprovalRequest


@dataclass(frozen=True)
class StateChange(Event):
    """(watch) The session changed state."""

    state: str = ""
    previous: str | None = None
    pid: int | None = None
    reason: str | None = None


@dataclass(frozen=True)
class TurnStarted(Event):
    """(watch) A turn started, sent by any client."""

    text: str = ""


@dataclass(frozen=True)
class Reply(Event):
    """The final answer of a turn. `events` holds what the turn streamed,
    when it was collected with `run`."""

    text: str = ""
    ok: bool = True
    events: list[Event] = field(default_factory=list)

    @property
    def cancelled(self) -> bool:
        """Whether the turn was cancelled before it finished (the probe
        says `cancelled`, Hermes `interrupted`): its text is no answer."""
        data = self.data if isinstance(self.data, dict) else {}
        return bool(data.get("cancelled") or data.get("interrupted"))


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float(value: Any) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if ok else 0.0


def _str(value: Any) -> str:
    return value if isinstance(value, str) else "" if value is None else str(value)


def _optional_str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _strings(value: Any, default: tuple[str, ...]) -> tuple[str, ...]:
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return tuple(value)
    return default


def _status(base: dict[str, Any], data: dict[str, Any]) -> Event:
    state = data.get("state")
    if state == "queued":
        return Queued(**base, position=_int(data.get("position")) or 0)
    if state == "running":
        return Running(**base, pid=_int(data.get("pid")))
    if state == "duplicate":
        return Duplicate(**base)
    if state == "backoff":
        return Backoff(
            **base, retry_in=_float(data.get("retry_in")), reason=_str(data.get("reason"))
        )
    return Event(**base)


def to_event(msg: Message) -> Event:
    """The typed form of an `event` or `reply` message."""
    body = msg.body
    if msg.kind is Kind.REPLY:
        return Reply(
            type="reply",
            data=body.get("data"),
            session=msg.session,
            turn=msg.re,
            text=body["text"],
            ok=body["ok"],
        )
    etype = str(body.get("type", ""))
    data = body.get("data")
    base: dict[str, Any] = {
        "type": etype,
        "data": data,
        "session": msg.session,
        "turn": body.get("turn", msg.re),
        "replayed": bool(body.get("replayed", False)),
    }
    d = data if isinstance(data, dict) else {}
    # A field of an unexpected type gets its default; `data` keeps it as sent.
    if etype == "status":
        return _status(base, d)
    if etype == "dropped":
        return Dropped(**base, count=_int(d.get("count")) or 0, reason=_str(d.get("reason")))
    if etype == "token":
        return Token(**base, text=data if isinstance(data, str) else _str(d.get("text")))
    if etype == "output":
        return Output(**base, line=_str(data))
    if etype == "tool_start":
        return ToolStart(**base, id=_str(d.get("id")), name=_str(d.get("name")), args=d.get("args"))
    if etype == "tool_complete":
        return ToolComplete(
            **base, id=_str(d.get("id")), name=_str(d.get("name")), result=d.get("result")
        )
    if etype == "approval":
        return ApprovalRequest(
            **base,
            command=_str(d.get("command")),
            description=_str(d.get("description")),
            choices=_strings(d.get("choices"), ("once", "session", "deny")),
            allow_permanent=d.get("allow_permanent") is True,
            id=_optional_str(d.get("id")),
        )
    if etype == "approval_timeout":
        return ApprovalTimeout(
            **base,
            command=_str(d.get("command")),
            outcome=_str(d.get("outcome")),
            id=_optional_str(d.get("id")),
        )
    if etype == "state":
        previous, reason = d.get("previous"), d.get("reason")
        return StateChange(
            **base,
            state=_str(d.get("state")),
            previous=previous if isinstance(previous, str) else None,
            pid=_int(d.get("pid")),
            reason=reason if isinstance(reason, str) else None,
        )
    if etype == "turn":
        return TurnStarted(**base, text=_str(d.get("text")))
    if etype == "reply":  # (watch) a turn's final answer, as its event
        return Reply(
            **{**base, "data": d.get("data")}, text=_str(d.get("text")), ok=d.get("ok") is True
        )
    return Event(**base)
