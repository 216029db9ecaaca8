"""Message kinds and the shape of each kind's body.

Every message is one `Message` envelope; what differs between kinds is the
body, checked against the schema in `BODY_SCHEMAS`. The schemas are data, not
classes, so PROTOCOL.md and implementations in other languages can follow
them line by line.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Kind(StrEnum):
    """Every message kind. Client and supervisor use the first group; worker and
    supervisor the second; `event`, `reply`, `cancel` and `error` appear on both."""

    # client <-> supervisor
    PING = "ping"
    PONG = "pong"
    OPEN = "open"
    OPENED = "opened"
    SEND = "send"
    EVENT = "event"
    REPLY = "reply"
    CANCEL = "cancel"
    CANCELLED = "cancelled"
    LIST = "list"
    SESSIONS = "sessions"
    KILL = "kill"
    KILLED = "killed"
    WATCH = "watch"
    UNWATCH = "unwatch"
    LOGS = "logs"
    LOG_LINES = "log_lines"
    STATUS = "status"
    INFO = "info"
    APPROVE = "approve"
    APPROVED = "approved"
    RELOAD = "reload"
    RELOADED = "reloaded"
    SIGNAL = "signal"
    SIGNALLED = "signalled"
    INSPECT = "inspect"
    INSPECTED = "inspected"
    SHUTDOWN = "shutdown"
    SHUTDOWN_STARTED = "shutdown_started"
    DRAIN = "drain"
    NODE = "node"
    TURN_STATUS = "turn_status"
    TURN_STATE = "turn_state"
    ERROR = "error"
    # worker <-> supervisor
    HELLO = "hello"
    TURN = "turn"
    STOP = "stop"
    HEARTBEAT = "heartbeat"
    SPARE = "spare"
    ASSIGN = "assign"


_NONE = type(None)
_NUM = (int, float)

# kind -> {field: (accepted python types, required)}. `object` accepts any
# msgpack value. A field that may be nil lists NoneType among its types.
BODY_SCHEMAS: dict[Kind, dict[str, tuple[tuple[type, ...], bool]]] = {
    Kind.PING: {},
    Kind.PONG: {
        "version": ((str,), True),
        "protocol": ((int,), True),
        "pid": ((int,), True),
        "uptime": (_NUM, True),
    },
    Kind.OPEN: {"options": ((dict,), False)},
    Kind.OPENED: {
        "pid": ((int, _NONE), True),
        "state": ((str,), True),
        "created": ((bool,), True),
    },
    Kind.SEND: {
        "text": ((str,), True),
        "options": ((dict,), False),
        "context": ((dict,), False),
        "ack": ((bool,), False),  # false: no `running` event when the turn starts
        "orphan_grace": (_NUM, False),  # cancel it when its client is gone this long
    },
    Kind.EVENT: {
        "type": ((str,), True),
        "data": ((object,), False),
        "turn": ((str,), False),
        "replayed": ((bool,), False),
    },
    Kind.REPLY: {"text": ((str,), True), "ok": ((bool,), True), "data": ((dict,), False)},
    Kind.CANCEL: {"turn": ((str, _NONE), False)},
    Kind.CANCELLED: {"turn": ((str, _NONE), True)},
    Kind.LIST: {"prefix": ((str,), False), "state": ((str,), False)},
    Kind.SESSIONS: {"sessions": ((list,), True)},
    Kind.KILL: {"force": ((bool,), False), "purge": ((bool,), False)},
    Kind.KILLED: {"pid": ((int, _NONE), True), "reason": ((str,), True)},
    Kind.WATCH: {"replay": ((int,), False), "types": ((list,), False)},
    Kind.UNWATCH: {"watch": ((str,), True)},
    Kind.LOGS: {"lines": ((int,), False), "follow": ((bool,), False)},
    Kind.LOG_LINES: {"lines": ((list,), True)},
    Kind.STATUS: {},
    Kind.APPROVE: {"choice": ((str,), True), "approval": ((str,), False)},
    Kind.RELOAD: {},
    Kind.RELOADED: {"changed": ((list,), True), "restart_needed": ((list,), True)},
    Kind.APPROVED: {
        "choice": ((str,), True),
        "turn": ((str,), True),
        "approval": ((str,), False),
    },
    Kind.INFO: {"supervisor": ((dict,), True)},
    Kind.SIGNAL: {"signal": ((str,), True), "group": ((bool,), False)},
    Kind.SIGNALLED: {"pid": ((int,), True), "signal": ((str,), True)},
    Kind.INSPECT: {},
    Kind.INSPECTED: {"session": ((dict,), True)},
    Kind.SHUTDOWN: {},
    Kind.SHUTDOWN_STARTED: {"pid": ((int,), True), "grace": (_NUM, True)},
    Kind.DRAIN: {"on": ((bool,), False)},
    Kind.NODE: {"node": ((dict,), True)},
    Kind.TURN_STATUS: {"turn": ((str,), True)},
    Kind.TURN_STATE: {
        "turn": ((str,), True),
        "state": ((str,), True),  # queued, running, ended, interrupted, unknown
        "node": ((str, _NONE), True),
        "outcome": ((dict, _NONE), False),
        "started": (_NUM + (_NONE,), False),
        "ended": (_NUM + (_NONE,), False),
        "since": (_NUM + (_NONE,), False),
    },
    # `node`, `endpoint` and `reason` only with `moved` (PROTOCOL.md, "Nodes").
    Kind.ERROR: {
        "code": ((str,), True),
        "message": ((str,), True),
        "node": ((str, _NONE), False),
        "endpoint": ((str, _NONE), False),
        "reason": ((str,), False),
    },
    Kind.HELLO: {"pid": ((int,), True)},
    Kind.TURN: {"text": ((str,), True), "context": ((dict,), False)},
    Kind.STOP: {},
    Kind.HEARTBEAT: {"busy": ((bool,), False)},
    Kind.SPARE: {"pid": ((int,), True)},
    Kind.ASSIGN: {"request": ((dict,), True)},
}

# Kinds whose envelope must name a session.
SESSION_KINDS = frozenset(
    {
        Kind.OPEN,
        Kind.SEND,
        Kind.CANCEL,
        Kind.KILL,
        Kind.HELLO,
        Kind.LOGS,
        Kind.APPROVE,
        Kind.SIGNAL,
        Kind.INSPECT,
        Kind.TURN_STATUS,
    }
)

MAX_ID_LENGTH = 64


def new_id() -> str:
    """A fresh random message id (128 bits, hex)."""
    return os.urandom(16).hex()


@dataclass(frozen=True)
class Message:
    """One protocol message: an envelope around a kind-specific body.

    `re` names the request this message answers or streams for; `session` is
    the session key it concerns, if any.
    """

    kind: Kind
    body: dict[str, Any] = field(default_factory=dict)
    session: str | None = None
    re: str | None = None
    id: str = field(default_factory=new_id)
    ts: float = field(default_factory=time.time)
    # A request's time to live: its sender waits this many seconds after
    # `ts` for the first answer, and the supervisor refuses it later.
    ttl: float | None = None

    def reply(self, kind: Kind, body: dict[str, Any] | None = None) -> Message:
        """A message answering this one: same session, `re` set to this id."""
        return Message(kind, body or {}, session=self.session, re=self.id)


def error_message(
    code: str,
    message: str,
    *,
    re: str | None = None,
    session: str | None = None,
    detail: dict[str, Any] | None = None,
) -> Message:
    """Build an `error` message with a stable code and a readable sentence
    (and, for some codes, fields for programs: `detail`)."""
    body: dict[str, Any] = {"code": code, "message": message}
    if detail:
        body.update(detail)
    return Message(Kind.ERROR, body, session=session, re=re)


# A process notice's `event` (PROTOCOL.md, "Notices"): the fields of a
# background process's completion that a chat's notification needs; the
# worker sends these and the gateway plugin reads no others.
PROCESS_NOTICE_FIELDS = (
    "type",
    "session_id",
    "command",
    "exit_code",
    "completion_reason",
    "termination_source",
    "output",
    "started_at",
    "pattern",
    "suppressed",
    "message",
)
