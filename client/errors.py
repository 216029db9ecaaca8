"""Typed client errors. Every error the supervisor sends becomes one of these,
carrying its stable `code` (see PROTOCOL.md) and its sentence for a person."""

from __future__ import annotations

from hermes_sup.protocol import ErrorCode


class ClientError(Exception):
    """Base of every error the client raises."""


class NotRunning(ClientError):
    """No supervisor answers at this address, or it went away mid-request."""


class Starting(NotRunning):
    """The supervisor is starting (the sealed Hermes preload: seconds to
    minutes) and answers once that is done; `report` says how far it is."""

    def __init__(self, message: str, report: dict[str, object]) -> None:
        super().__init__(message)
        self.report = report


class AccessDenied(ClientError):
    """This user may not use the state directory, or the supervisor refused
    this client's CURVE key."""


class Timeout(ClientError):
    """The supervisor did not answer in time."""


class SupervisorError(ClientError):
    """The supervisor answered with an `error` message."""

    code: str = ""

    def __init__(self, code: str, message: str, session: str | None = None) -> None:
        super().__init__(f"{message} [{code}]")
        self.code = code
        self.message = message
        self.session = session


class ProtocolError(SupervisorError):
    """The supervisor could not read what we sent: frames, signature, replay,
    size, or a field. A bug in the client, or the wrong key."""


class BadRequest(SupervisorError):
    """A well-formed request that names something invalid (a session key, an
    option, a kind the client may not send)."""


class NoSuchSession(SupervisorError):
    """`kill` or `cancel` of a session the supervisor does not know."""


class SessionConflict(SupervisorError):
    """New options for a session whose worker is running."""


class SessionFailed(SupervisorError):
    """The session is `failed`; the message says why and for how long."""


class Overloaded(SupervisorError):
    """Every worker slot is busy; try again shortly."""


class Busy(SupervisorError):
    """A turn queue is full; nothing was queued."""


class TurnTimeout(SupervisorError):
    """The turn ran over the supervisor's turn timeout and was cancelled."""


class WorkerDied(SupervisorError):
    """The session's worker died during the turn."""


class SessionKilled(SupervisorError):
    """The session was killed before or during the turn."""


class TurnFailed(SupervisorError):
    """The agent raised an error in the turn, or it was cancelled while queued."""


class NothingToApprove(SupervisorError):
    """`approve` for a session with no running turn."""


class ShuttingDown(SupervisorError):
    """The supervisor is stopping and takes no new turns."""


class DiskFull(SupervisorError):
    """The turn was not run: the supervisor could not record its start (its
    data disk is full, or below its reserve). Its id is unspent: send it
    again, same id, once there is room."""


class InternalError(SupervisorError):
    """A bug in hermes-sup; the supervisor logged a traceback."""


_BY_CODE: dict[str, type[SupervisorError]] = {
    ErrorCode.BAD_FRAMES: ProtocolError,
    ErrorCode.UNSUPPORTED_VERSION: ProtocolError,
    ErrorCode.TOO_LARGE: ProtocolError,
    ErrorCode.BAD_SIGNATURE: ProtocolError,
    ErrorCode.REPLAYED: ProtocolError,
    ErrorCode.EXPIRED: ProtocolError,
    ErrorCode.MALFORMED: ProtocolError,
    ErrorCode.BAD_FIELD: BadRequest,
    ErrorCode.UNKNOWN_KIND: BadRequest,
    ErrorCode.BAD_SESSION_KEY: BadRequest,
    ErrorCode.BAD_CONFIG: BadRequest,
    ErrorCode.NO_SUCH_SESSION: NoSuchSession,
    ErrorCode.SESSION_CONFLICT: SessionConflict,
    ErrorCode.SPAWN_FAILED: SessionFailed,
    ErrorCode.SESSION_FAILED: SessionFailed,
    ErrorCode.OVERLOADED: Overloaded,
    ErrorCode.BUSY: Busy,
    ErrorCode.TURN_TIMEOUT: TurnTimeout,
    ErrorCode.WORKER_DIED: WorkerDied,
    ErrorCode.SESSION_KILLED: SessionKilled,
    ErrorCode.TURN_FAILED: TurnFailed,
    ErrorCode.NOTHING_TO_APPROVE: NothingToApprove,
    ErrorCode.SHUTTING_DOWN: ShuttingDown,
    ErrorCode.INTERNAL: InternalError,
    ErrorCode.DISK_FULL: DiskFull,
}


def error_for(code: str, message: str, session: str | None = None) -> SupervisorError:
    """The typed error for a supervisor error code; an unknown code (from a
    newer supervisor) is a plain SupervisorError."""
    return _BY_CODE.get(code, SupervisorError)(code, message, session)
