"""hermes-sup's Python client: embed the supervisor behind any front end.

    from hermes_sup.client import Client, Token, Reply

    with Client() as hs:                      # this user's supervisor
        hs.open("telegram:42", session_env={"platform": "telegram", "chat_id": "42"})
        for event in hs.send("telegram:42", "hello"):
            if isinstance(event, Token):
                print(event.text, end="")

`AsyncClient` has the same calls, awaited. Both are thin transports over one
sans-IO core (`core.py`): the protocol logic exists once.
"""

from .aio import AsyncClient, AsyncTurn
from .blocking import Client, Turn
from .connection import Connection, Curve, session_options
from .core import Killed, Opened, Pong, Signalled
from .errors import (
    AccessDenied,
    BadRequest,
    Busy,
    ClientError,
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

__all__ = [
    "AccessDenied",
    "ApprovalRequest",
    "ApprovalTimeout",
    "AsyncClient",
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
    "Event",
    "InternalError",
    "Killed",
    "NoSuchSession",
    "NotRunning",
    "NothingToApprove",
    "Opened",
    "Output",
    "Overloaded",
    "Pong",
    "ProtocolError",
    "Queued",
    "Reply",
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
