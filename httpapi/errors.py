"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}`
with the HTTP status a client acts on, and the mapping from the client
library's typed errors (the supervisor's stable codes) to those statuses."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from hermes_sup.client import (
    AccessDenied,
    BadRequest,
    Busy,
    ClientError,
    NothingToApprove,
    NotRunning,
    Overloaded,
    SessionConflict,
    SessionFailed,
    SessionKilled,
    ShuttingDown,
    Starting,
    SupervisorError,
    Timeout,
    TurnTimeout,
    WorkerDied,
)

from .logsafe import kv

log = logging.getLogger("hermes_sup.httpapi")

INVALID = "invalid_request_error"
SERVER = "server_error"
RATE = "rate_limit_error"


class ApiError(Exception):
    """An error answer: raise it anywhere in a handler."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        err_type: str = INVALID,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.err_type = err_type
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON body, as the OpenAI API and Hermes's API server shape it."""
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": None,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def unavailable(message: str, code: str, retry_after: int) -> ApiError:
    """503 with Retry-After: try again later, nothing was done."""
    return ApiError(503, message, code, SERVER, {"Retry-After": str(retry_after)})


def from_client_error(exc: ClientError) -> ApiError:
    """The HTTP answer for an error the supervisor (or the client) reported."""
    message = exc.message if isinstance(exc, SupervisorError) else str(exc)
    if isinstance(exc, Overloaded):
        return unavailable(message, "overloaded", 1)
    if isinstance(exc, Busy):
        return ApiError(429, message, "busy", RATE, {"Retry-After": "1"})
    if isinstance(exc, ShuttingDown):
        return unavailable(message, "shutting_down", 5)
    if isinstance(exc, SessionFailed):
        return unavailable(message, "session_failed", 30)
    if isinstance(exc, Starting):  # a NotRunning that will run: say how far it is
        return unavailable(message, "starting", 5)
    if isinstance(exc, NotRunning):
        return unavailable(
            f"the hermes-sup supervisor is not available: {message}", "no_supervisor", 5
        )
    if isinstance(exc, Timeout):
        return unavailable(f"the hermes-sup supervisor did not answer: {message}", "timeout", 5)
    if isinstance(exc, AccessDenied):
        return ApiError(
            502, f"the supervisor refused this endpoint: {message}", "access_denied", SERVER
        )
    if isinstance(exc, SessionConflict):
        return ApiError(409, message, "session_conflict")
    if isinstance(exc, NothingToApprove):
        return ApiError(409, message, "approval_not_pending")
    if isinstance(exc, BadRequest):
        return ApiError(400, message, exc.code or "bad_request")
    if isinstance(exc, TurnTimeout):
        return ApiError(504, message, "turn_timeout", SERVER)
    if isinstance(exc, (WorkerDied, SessionKilled)):
        return ApiError(502, message, exc.code, SERVER)
    if isinstance(exc, SupervisorError) and exc.code == "replayed":
        # The turn id of an Idempotency-Key already used for a request the
        # supervisor saw differently: the client's reuse, not our failure.
        return ApiError(422, message, "replayed")
    if isinstance(exc, SupervisorError) and exc.code == "disk_full":
        # Not run, its id unspent: safe to retry once the disk has room.
        return unavailable(message, "disk_full", 30)
    if isinstance(exc, SupervisorError) and exc.code in ("interrupted", "too_large", "expired"):
        # A retry's turn ran once already and this is all that is known of
        # its end: a server-side failure, not to be retried into a second run.
        return ApiError(502, message, exc.code, SERVER)
    if isinstance(exc, SupervisorError) and exc.code == "turn_failed":
        return ApiError(502, message, "agent_error", SERVER)
    code = exc.code if isinstance(exc, SupervisorError) else "internal"
    return ApiError(500, message, code or "internal", SERVER)


async def _on_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


async def _on_client_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ClientError)
    return from_client_error(exc).response()


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return ApiError(exc.status_code, str(exc.detail), code).response()


async def _on_bug(request: Request, exc: Exception) -> Response:
    # Anything else is a bug of ours: logged with its traceback, and the
    # client told no more than that.
    log.error(kv("bug", where=request.url.path), exc_info=exc)
    return ApiError(
        500, "internal error in hermes-sup's HTTP endpoint", "internal", "server_error"
    ).response()


# Every error a handler raises, as the OpenAI-shaped answer it gets.
EXCEPTION_HANDLERS: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
    ApiError: _on_api_error,
    ClientError: _on_client_error,
    HTTPException: _on_http_error,
    Exception: _on_bug,
}
