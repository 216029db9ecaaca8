"""hermes-sup's Python client: embed the supervisor behind any front end.

    from hermes_sup.client import Client, Token, Reply

    with Client() as hs:                      # this user's supervisor
        hs.open("telegram:42", session_env={"platform": "telegram", "chat_id": "42"})
        for event in hs.send("telegram:42", "hello"):
            if isinstance(event, Token):
                print(event.text, end="")

`AsyncClient` has the same calls, awaited. Both are thin transports over one
sans-IO core (`core.py`): the protocol logic exists once.

Each name is imported from its module when first used (PEP 562), so that
`from hermes_sup.client import Client` does not load asyncio for the
blocking client, nor the blocking one for `AsyncClient`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .aio import AsyncClient, AsyncTurn
    from .aio_failover import AsyncRouters
    from .blocking import Client, Turn
    from .connection import Connection, Curve, session_options
    from .core import Killed, Opened, Pong, Signalled
    from .errors import (
        AccessDenied,
        BadRequest,
        Busy,
        ClientError,
        DiskFull,
        InternalError,
        NoSuchSession,
        NothingToApprove,
        NotRunning,
        Overloaded,
        ProtocolError,
        SessionConflict,
        SessionFailed,
        SessionKilled,
        ShuttingDown,
        Starting,
        SupervisorError,
        Timeout,
        TurnFailed,
        TurnTimeout,
        WorkerDied,
    )
    from .events import (
        ApprovalRequest,
        ApprovalTimeout,
        Backoff,
        Dropped,
        Duplicate,
        Event,
        Output,
        Queued,
        Reply,
        Running,
        StateChange,
        Token,
        ToolComplete,
        ToolStart,
        TurnStarted,
    )
    from .failover import Routers

_WHERE = {
    "AccessDenied": "errors",
    "ApprovalRequest": "events",
    "ApprovalTimeout": "events",
    "AsyncClient": "aio",
    "AsyncRouters": "aio_failover",
    "AsyncTurn": "aio",
    "Backoff": "events",
    "BadRequest": "errors",
    "Busy": "errors",
    "Client": "blocking",
    "ClientError": "errors",
    "Connection": "connection",
    "Curve": "connection",
    "Dropped": "events",
    "Duplicate": "events",
    "Event": "events",
    "DiskFull": "errors",
    "InternalError": "errors",
    "Killed": "core",
    "NoSuchSession": "errors",
    "NotRunning": "errors",
    "Starting": "errors",
    "NothingToApprove": "errors",
    "Opened": "core",
    "Output": "events",
    "Overloaded": "errors",
    "Pong": "core",
    "ProtocolError": "errors",
    "Queued": "events",
    "Reply": "events",
    "Routers": "failover",
    "Running": "events",
    "SessionConflict": "errors",
    "SessionFailed": "errors",
    "SessionKilled": "errors",
    "ShuttingDown": "errors",
    "Signalled": "core",
    "StateChange": "events",
    "SupervisorError": "errors",
    "Timeout": "errors",
    "Token": "events",
    "ToolComplete": "events",
    "ToolStart": "events",
    "Turn": "blocking",
    "TurnFailed": "errors",
    "TurnStarted": "events",
    "TurnTimeout": "errors",
    "WorkerDied": "errors",
    "session_options": "connection",
}


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public names, as `from hermes_sup.client import *` sees them."""
    return sorted(__all__)


__all__ = [
    "AccessDenied",
    "ApprovalRequest",
    "ApprovalTimeout",
    "AsyncClient",
    "AsyncRouters",
    "AsyncTurn",
    "Backoff",
    "BadRequest",
    "Busy",
    "Client",
    "ClientError",
    "Connection",
    "Curve",
    "Dropped",
    "Duplicate",
    "DiskFull",
    "Event",
    "InternalError",
    "Killed",
    "NoSuchSession",
    "NotRunning",
    "Starting",
    "NothingToApprove",
    "Opened",
    "Output",
    "Overloaded",
    "Pong",
    "ProtocolError",
    "Queued",
    "Reply",
    "Routers",
    "Running",
    "SessionConflict",
    "SessionFailed",
    "SessionKilled",
    "Signalled",
    "ShuttingDown",
    "StateChange",
    "SupervisorError",
    "Timeout",
    "Token",
    "ToolComplete",
    "ToolStart",
    "Turn",
    "TurnFailed",
    "TurnStarted",
    "TurnTimeout",
    "WorkerDied",
    "session_options",
]
