"""Protocol errors and their stable codes.

As in h11, one base class splits in two: a *local* error means this side
misused the protocol (a bug here), a *remote* error means the peer sent
something bad (answer it with an `error` message and keep serving).
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    """Stable error codes carried in `error` messages. Never renumber or reuse."""

    # The frames themselves are wrong.
    BAD_FRAMES = "bad_frames"
    UNSUPPORTED_VERSION = "unsupported_version"
    TOO_LARGE = "too_large"
    BAD_SIGNATURE = "bad_signature"
    REPLAYED = "replayed"
    EXPIRED = "expired"
    MALFORMED = "malformed"
    BAD_FIELD = "bad_field"
    UNKNOWN_KIND = "unknown_kind"
    # The request is well formed but cannot be served.
    BAD_SESSION_KEY = "bad_session_key"
    NO_SUCH_SESSION = "no_such_session"
    SESSION_CONFLICT = "session_conflict"
    SPAWN_FAILED = "spawn_failed"
    SESSION_FAILED = "session_failed"
    OVERLOADED = "overloaded"
    TURN_TIMEOUT = "turn_timeout"
    NOTHING_TO_APPROVE = "nothing_to_approve"
    BAD_CONFIG = "bad_config"
    WORKER_DIED = "worker_died"
    SESSION_KILLED = "session_killed"
    TURN_FAILED = "turn_failed"
    BUSY = "busy"
    SHUTTING_DOWN = "shutting_down"
    INTERNAL = "internal"
    # Many nodes (PROTOCOL.md, "Nodes"): the session is served by another
    # supervisor (its lease is held there) or this one takes no new sessions
    # (draining); and a router's answer for a turn whose node died.
    MOVED = "moved"
    NODE_LOST = "node_lost"
    # (from a router) the session's history is in a data directory that no
    # live node serves now (a node's own, while it is away): it is not
    # started anew elsewhere, which would give the key two histories.
    HOME_UNAVAILABLE = "home_unavailable"
    # A turn that started and whose supervisor stopped before it ended (the
    # turn journal, supervisor/journal.py): it is never run again.
    INTERRUPTED = "interrupted"
    # The turn was not run: its start could not be recorded in the turn
    # journal, or the data disk is below the supervisor's reserve. Its id
    # stays unspent: sending it again is safe.
    DISK_FULL = "disk_full"


class ProtocolError(Exception):
    """Base of every protocol error; carries a stable code and a readable message."""

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        msg_id: str | None = None,
        detail: dict[str, object] | None = None,
    ) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message
        # The id of the offending message when it could be read, so a reply can cite it.
        self.msg_id = msg_id
        # Fields for programs the error body carries beside code and message
        # (`moved`: the node that holds the session), or None.
        self.detail = detail


class LocalProtocolError(ProtocolError):
    """We tried to build or send something the protocol does not allow."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something the protocol does not allow."""
