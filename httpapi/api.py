"""The endpoint's shared state and request handling: settings, keys, the
supervisor client (made on first use, and again after it failed, so the
endpoint may start before its supervisor), tenancy (whose key a request
carries, which session a client's id names) and opening a turn.

Every route part (chat.py, responses.py, runs.py, notices.py) is handed an
`Api` by the composition root (app.py); this module imports none of them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import Response

from hermes_sup.client import AsyncClient, ClientError, SessionConflict, Starting
from hermes_sup.local.version import version

from .bodies import parse_body
from .continuity import Continuations
from .errors import ApiError, from_client_error
from .guard import BodyDeadline
from .idempotency import IdempotencyCache
from .keys import KeyStore, Tenant
from .logsafe import kv
from .retries import Retries
from .sessions import SessionRef, header_id, label_of, ref_for
from .turns import OpenTurn, open_turn

log = logging.getLogger("hermes_sup.httpapi")

AGENT_INFO_TTL = 60.0  # seconds /health trusts what it last heard the workers run
# A turn sent while the supervisor starts (the sealed Hermes preload: seconds
# to a minute) waits this long for it, looking again every START_POLL.
START_WAIT = 60.0
START_POLL = 0.5


class Settings(Protocol):
    """What the parts read of the endpoint's settings (app.py's `ApiSettings`
    is the declaration; this is the view of it the parts depend on, so that
    none of them imports the composition root)."""

    @property
    def model(self) -> str: ...
    @property
    def max_body(self) -> int: ...
    @property
    def body_timeout(self) -> float: ...
    @property
    def min_body_rate(self) -> int: ...
    @property
    def stall_timeout(self) -> float: ...
    @property
    def keepalive(self) -> float: ...
    @property
    def chat_keepalive(self) -> float: ...
    @property
    def stream_queue(self) -> int: ...
    @property
    def run_events(self) -> int: ...
    @property
    def run_ttl(self) -> float: ...
    @property
    def max_runs(self) -> int: ...
    @property
    def max_responses(self) -> int: ...
    @property
    def retry_grace(self) -> float: ...
    @property
    def cors_origins(self) -> tuple[str, ...]: ...


class Api:
    """The app's shared state: settings, keys, the supervisor client, the
    turns this endpoint pumps, and what makes retries and continued
    conversations find their session."""

    def __init__(
        self, settings: Settings, keys: KeyStore, connect: Callable[[], AsyncClient]
    ) -> None:
        self.settings = settings
        self.keys = keys
        self._connect = connect
        self._client: AsyncClient | None = None
        self.tasks: set[asyncio.Task[Any]] = set()  # turn pumps
        self.idempotency = IdempotencyCache()
        self.retries = Retries(settings.retry_grace)
        self.continuations = Continuations()
        self._mapped: set[str] = set()
        self._labelled: set[str] = set()  # sessions given their label by this process
        self._agent_info: tuple[int, float, dict[str, Any]] = (0, 0.0, {})

    async def agent_info(self, supervisor_pid: int) -> dict[str, Any]:
        """What the workers run, for /health: asked of the supervisor once
        a minute, and again when it is another one (restarted)."""
        now = time.monotonic()
        pid, at, info = self._agent_info
        if pid != supervisor_pid or now - at > AGENT_INFO_TTL:
            status = await self.client().status()
            agent = status.get("hermes_agent")
            sealed = status.get("sealed") or {}
            info = {
                "version": agent or version(),
                "hermes_agent": agent,
                "hermes_sup": version(),
                "runtime": status.get("runtime"),
                # Whether sessions are a boundary (docs/security.md),
                # and the supervisor's warning when they are not.
                "sealed": sealed.get("mode"),
                "warning": sealed.get("warning"),
            }
            self._agent_info = (supervisor_pid, now, info)
        return info

    def client(self) -> AsyncClient:
        """The supervisor client, made now if it is not yet (or could not be)."""
        if self._client is None:
            try:
                self._client = self._connect()
            except ClientError as exc:
                raise from_client_error(exc) from None
        return self._client

    async def started_client(self) -> AsyncClient:
        """The client, once the supervisor has started: a turn sent while it
        starts (the sealed Hermes preload) waits for it, up to START_WAIT,
        and is answered then; past that, 503 `starting` with Retry-After."""
        deadline = time.monotonic() + START_WAIT
        said = False
        while self._client is None:
            try:
                self._client = self._connect()
            except Starting as exc:
                if time.monotonic() >= deadline:
                    raise from_client_error(exc) from None
                if not said:  # once a request, not once a poll
                    log.info(kv("http_waiting_for_start", detail=str(exc)))
                    said = True
                await asyncio.sleep(START_POLL)
            except ClientError as exc:
                raise from_client_error(exc) from None
        return self._client

    async def close(self) -> None:
        """Cancel the turns still pumped and close the supervisor client."""
        self.retries.close()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.close()

    # ------------------------------------------------------------ requests

    def check_auth(self, request: Request) -> Tenant:
        """The tenant whose key the request carries; 401 if none matches."""
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        tenant = self.keys.check(token.strip()) if scheme.lower() == "bearer" and token else None
        if tenant is None:
            log.warning(kv("http_auth_refused", peer=_peer(request), path=request.url.path))
            raise ApiError(401, "Invalid API key", "invalid_api_key")
        return tenant

    async def read_json(self, request: Request) -> dict[str, Any]:
        """The body as a JSON object: 413 when too large, 408 when it does not
        arrive in time, 400 when it is not JSON we take (bodies.py)."""
        limit = self.settings.max_body
        length = request.headers.get("Content-Length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                raise ApiError(
                    400, "Invalid Content-Length header.", "invalid_content_length"
                ) from None
            if declared > limit:
                raise ApiError(
                    413, f"Request body too large (limit {limit} bytes).", "body_too_large"
                )
        body = bytearray()
        # A body that trickles in is given up on, as a request's head is
        # (guard.py): past the body timeout, or once it falls below the
        # minimum rate. A bare timer: asyncio.timeout costs every request more.
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        deadline = BodyDeadline(
            self.settings.body_timeout, self.settings.min_body_rate, loop.time()
        )
        late = False
        timer: asyncio.TimerHandle

        def too_late() -> None:
            nonlocal late, timer
            if loop.time() < deadline.due():  # bytes came since it was armed
                timer = loop.call_at(deadline.due(), too_late)
                return
            late = True
            task.cancel()

        timer = loop.call_at(deadline.due(), too_late)
        try:
            async for piece in request.stream():  # chunked bodies carry no length
                body += piece
                deadline.add(len(piece))
                if len(body) > limit:
                    raise ApiError(
                        413, f"Request body too large (limit {limit} bytes).", "body_too_large"
                    )
        except asyncio.CancelledError:
            if not late:
                raise
            task.uncancel()
            raise _too_late(deadline, loop.time()) from None
        finally:
            timer.cancel()
        return parse_body(bytes(body))

    def ref(self, tenant: Tenant, original: str) -> SessionRef:
        """The session a client's id names for `tenant` (sessions.py), with
        the mapping logged once."""
        ref = ref_for(tenant, original)
        if ref.mapped and ref.key not in self._mapped:
            if len(self._mapped) > 100_000:
                self._mapped.clear()
            self._mapped.add(ref.key)
            log.info(kv("http_session_key", session=ref.key, id=original))
        return ref

    def header_ref(self, request: Request, tenant: Tenant) -> SessionRef | None:
        """The session the request's session headers name, if any."""
        named = header_id(request.headers)
        return None if named is None else self.ref(tenant, named)

    def model_of(self, body: dict[str, Any]) -> str:
        """The model a request names (echoed back), else ours."""
        model = body.get("model")
        return model if isinstance(model, str) and model else self.settings.model

    async def whole_answer(
        self,
        request: Request,
        body: dict[str, Any],
        fields: Sequence[str],
        first: str | None,
        answer: Callable[[], Awaitable[Response]],
    ) -> Response:
        """A whole (not streamed) answer, kept for a repeat with its
        Idempotency-Key (idempotency.py). A try that failed frees its turn id
        for a retry (retries.py), unless the turn still runs (409)."""

        async def tried() -> Response:
            try:
                return await answer()
            except (ApiError, ClientError) as exc:
                if not (isinstance(exc, ApiError) and exc.status == 409):
                    self.retries.failed(first)
                raise

        return await self.idempotency.run(request, body, fields, tried)

    async def open_turn(
        self,
        ref: SessionRef,
        text: str,
        context: dict[str, Any] | None = None,
        turn_id: str | None = None,
    ) -> OpenTurn:
        """Start the session's turn, or with `turn_id` (a retry's,
        retries.py) join it or read its answer. The first turn this endpoint
        sends to a session whose key is a mapped id names that id as the
        session's `label`, so `hermes-sup list` shows what the client called it."""
        client = await self.started_client()
        if turn_id is None:
            return await self._open(client, ref, text, context, None)
        self.retries.claim(ref.key, turn_id)
        try:
            opened = await self._open(client, ref, text, context, turn_id)
        except BaseException:
            self.retries.release(client, ref.key, turn_id, ended=True)
            raise

        def done(ended: bool) -> None:
            self.retries.release(client, ref.key, turn_id, ended)

        opened.on_done = done
        return opened

    async def _open(
        self,
        client: AsyncClient,
        ref: SessionRef,
        text: str,
        context: dict[str, Any] | None,
        turn_id: str | None,
    ) -> OpenTurn:
        # Should this endpoint die, the supervisor cancels the turn once it
        # has been gone this long, unless a restarted one takes it back.
        grace = self.settings.retry_grace
        if not ref.mapped or ref.key in self._labelled:
            return await open_turn(
                client, ref.key, text, context, turn_id=turn_id, orphan_grace=grace
            )
        try:
            opened = await open_turn(
                client,
                ref.key,
                text,
                context,
                options={"label": label_of(ref.original)},
                turn_id=turn_id,
                orphan_grace=grace,
            )
        except SessionConflict as exc:
            # The session runs with options of its own (an operator opened
            # it): it keeps them, and its turn goes on without a label.
            log.info(kv("http_session_label_skipped", session=ref.key, error=exc))
            opened = await open_turn(
                client, ref.key, text, context, turn_id=turn_id, orphan_grace=grace
            )
        if len(self._labelled) > 100_000:
            self._labelled.clear()
        self._labelled.add(ref.key)
        return opened


def _too_late(deadline: BodyDeadline, now: float) -> ApiError:
    """The 408 for a body cut for its rate or its timeout."""
    if deadline.too_slow(now):
        return ApiError(
            408,
            f"The request body arrived at {deadline.rate(now):.0f} bytes/s, under the "
            f"minimum of {deadline.min_rate} bytes/s",
            "body_too_slow",
        )
    return ApiError(
        408, f"The request body did not arrive within {deadline.timeout:g} s", "body_timeout"
    )


def _peer(request: Request) -> str:
    return f"{request.client.host}:{request.client.port}" if request.client else "-"
