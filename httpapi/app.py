"""The ASGI app: Hermes's API-server routes, each request a client call.

`create_app(settings, keys, connect)` builds a Starlette app around one
`AsyncClient` (made by `connect`, on first use and again after it failed,
so the endpoint may start before its supervisor). Every route but the
health checks needs a bearer key from `keys`, compared in constant time.
Browser origins are checked before anything else (origins.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hermes_sup.client import AsyncClient, ClientError, SessionConflict
from hermes_sup.local.version import version

from . import chat, origins
from .bodies import parse_body
from .continuity import Continuations
from .errors import ApiError, from_client_error
from .idempotency import IdempotencyCache
from .keys import KeyStore, Tenant
from .logsafe import kv
from .notices import notices
from .responses import Responses
from .retries import Retries
from .runs import Runs
from .sessions import TENANT, SessionRef, header_id, label_of, ref_for
from .settings import ApiSettings as ApiSettings  # httpapi.ApiSettings is read from here
from .turns import OpenTurn, open_turn

log = logging.getLogger("hermes_sup.httpapi")

Handler = Callable[[Request], Awaitable[Response]]

AGENT_INFO_TTL = 60.0  # seconds /health trusts what it last heard the workers run


class Api:
    """The app's shared state: settings, keys, the supervisor client, runs."""

    def __init__(
        self, settings: ApiSettings, keys: KeyStore, connect: Callable[[], AsyncClient]
    ) -> None:
        self.settings = settings
        self.keys = keys
        self._connect = connect
        self._client: AsyncClient | None = None
        self.tasks: set[asyncio.Task[Any]] = set()  # turn pumps
        self.runs = Runs(self)
        self.responses = Responses(self)
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

    async def close(self) -> None:
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
        # (guard.py). A bare timer: asyncio.timeout costs every request more.
        task = asyncio.current_task()
        assert task is not None
        late = False

        def too_late() -> None:
            nonlocal late
            late = True
            task.cancel()

        timer = asyncio.get_running_loop().call_later(self.settings.body_timeout, too_late)
        try:
            async for piece in request.stream():  # chunked bodies carry no length
                body += piece
                if len(body) > limit:
                    raise ApiError(
                        413, f"Request body too large (limit {limit} bytes).", "body_too_large"
                    )
        except asyncio.CancelledError:
            if not late:
                raise
            task.uncancel()
            raise ApiError(
                408,
                f"The request body did not arrive within {self.settings.body_timeout:g} s",
                "body_timeout",
            ) from None
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
        named = header_id(request.headers)
        return None if named is None else self.ref(tenant, named)

    def model_of(self, body: dict[str, Any]) -> str:
        """The model a request names (echoed back), else ours."""
        model = body.get("model")
        return model if isinstance(model, str) and model else self.settings.model

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
        client = self.client()
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


def _peer(request: Request) -> str:
    return f"{request.client.host}:{request.client.port}" if request.client else "-"


# ---------------------------------------------------------------- handlers


def _capabilities(api: Api, agent: dict[str, Any]) -> dict[str, Any]:
    """What this endpoint serves, in Hermes's capabilities contract: only
    what works here is advertised. `agent`: what the supervisor said of its
    workers (api.agent_info), or nothing if it did not answer."""
    endpoints = {
        "health": ("GET", "/health"),
        "models": ("GET", "/v1/models"),
        "chat_completions": ("POST", "/v1/chat/completions"),
        "responses": ("POST", "/v1/responses"),
        "runs": ("POST", "/v1/runs"),
        "run_status": ("GET", "/v1/runs/{run_id}"),
        "run_events": ("GET", "/v1/runs/{run_id}/events"),
        "run_approval": ("POST", "/v1/runs/{run_id}/approval"),
        "run_stop": ("POST", "/v1/runs/{run_id}/stop"),
    }
    return {
        "object": "hermes.api_server.capabilities",
        "platform": "hermes-agent",
        "model": api.settings.model,
        "auth": {"type": "bearer", "required": True},
        "runtime": {
            "mode": "server_agent",
            "tool_execution": "server",
            "split_runtime": False,
            "isolation": "process_per_session",
            "description": (
                "hermes-sup: each conversation is served by its own Hermes agent in its own "
                "process, with its own environment, working directory and HERMES_HOME."
            ),
            # "root"/"user": each session sealed in namespaces of its own;
            # None: unsealed, and `warning` says why and what it means.
            "sealed": agent.get("sealed"),
            "warning": agent.get("warning"),
        },
        "features": {
            "chat_completions": True,
            "chat_completions_streaming": True,
            "responses_api": True,
            "responses_streaming": True,
            "run_submission": True,
            "run_status": True,
            "run_events_sse": True,
            "run_stop": True,
            "run_approval_response": True,
            "tool_progress_events": True,
            "approval_events": True,
            "session_resources": False,
            "session_chat": False,
            "session_chat_streaming": False,
            "session_fork": False,
            "admin_config_rw": False,
            "jobs_admin": False,
            "memory_write_api": False,
            "skills_api": False,
            "audio_api": False,
            "realtime_voice": False,
            "session_continuity_header": "X-Hermes-Session-Id",
            "session_key_header": "X-Hermes-Session-Key",
            "cors": bool(api.settings.cors_origins),
        },
        "endpoints": {
            name: {"method": method, "path": path} for name, (method, path) in endpoints.items()
        },
    }


# A page served from web_dir talks only to this endpoint, runs only its own
# scripts, and is never framed by another site.
WEB_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
        b"img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; "
        b"base-uri 'none'; form-action 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]


class WebFiles(StaticFiles):
    """StaticFiles that serves no dotfile (`.env`, `.git/...`), by the path
    asked for or by where a symlink leads, and nothing outside the
    directory (StaticFiles itself resolves symlinks and `..` for that)."""

    def lookup_path(self, path: str) -> tuple[str, os.stat_result | None]:
        full_path, stat = super().lookup_path(path)
        if stat is None:
            return full_path, stat
        for directory in self.all_directories:
            try:
                parts = Path(full_path).relative_to(os.path.realpath(directory)).parts
            except ValueError:
                continue
            if any(part.startswith(".") for part in parts):
                return "", None
            return full_path, stat
        return "", None


def web_app(directory: Path) -> ASGIApp:
    """The static files of `directory` (index.html at /), with WEB_HEADERS.
    They need no key: a page holds none; the person using it gives one."""
    files = WebFiles(directory=directory, html=True)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *WEB_HEADERS]}
            await send(message)

        await files(scope, receive, send_with_headers)

    return app


def create_app(
    settings: ApiSettings, keys: KeyStore, connect: Callable[[], AsyncClient]
) -> Starlette:
    """The endpoint as an ASGI app (serve it with uvicorn, or any ASGI server)."""
    api = Api(settings, keys, connect)

    def authed(handler: Handler) -> Handler:
        async def wrapped(request: Request) -> Response:
            request.scope[TENANT] = api.check_auth(request)
            return await handler(request)

        return wrapped

    async def health(request: Request) -> Response:
        """Alive, and whether the supervisor answers (503 if not). As
        Hermes's own, `version` is the Hermes version (the hermes-agent the
        supervisor's workers load), here when there is one; `hermes_sup` is
        ours."""
        body: dict[str, Any] = {"status": "ok", "platform": "hermes-agent", "version": version()}
        try:
            pong = await api.client().ping(timeout=5.0)
            body.update(await api.agent_info(pong.pid))
        except (ClientError, ApiError) as exc:
            body["status"] = "unavailable"
            body["error"] = str(exc)
            return JSONResponse(body, 503, headers={"Retry-After": "5"})
        return JSONResponse(body)

    async def models(request: Request) -> Response:
        name = settings.model
        now = int(time.time())
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": name,
                        "object": "model",
                        "created": now,
                        "owned_by": "hermes",
                        "permission": [],
                        "root": name,
                        "parent": None,
                    }
                ],
            }
        )

    async def capabilities(request: Request) -> Response:
        try:
            pong = await api.client().ping(timeout=5.0)
            agent = await api.agent_info(pong.pid)
        except (ClientError, ApiError):
            agent = {}
        return JSONResponse(_capabilities(api, agent))

    async def completions(request: Request) -> Response:
        return await chat.chat_completions(api, request)

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return exc.response()

    async def on_client_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ClientError)
        return from_client_error(exc).response()

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return ApiError(exc.status_code, str(exc.detail), code).response()

    async def on_bug(request: Request, exc: Exception) -> Response:
        log.error(kv("bug", where=request.url.path), exc_info=exc)
        return ApiError(
            500, "internal error in hermes-sup's HTTP endpoint", "internal", "server_error"
        ).response()

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await api.close()

    routes: list[BaseRoute] = [
        Route("/health", health),
        Route("/v1/health", health),
        Route("/v1/models", authed(models)),
        Route("/v1/capabilities", authed(capabilities)),
        Route("/v1/chat/completions", authed(completions), methods=["POST"]),
        Route("/v1/responses", authed(api.responses.create), methods=["POST"]),
        Route("/v1/responses/{response_id}", authed(api.responses.get), methods=["GET"]),
        Route("/v1/responses/{response_id}", authed(api.responses.delete), methods=["DELETE"]),
        Route("/v1/runs", authed(api.runs.create), methods=["POST"]),
        Route("/v1/runs/{run_id}", authed(api.runs.status)),
        Route("/v1/runs/{run_id}/events", authed(api.runs.events)),
        Route("/v1/runs/{run_id}/approval", authed(api.runs.approval), methods=["POST"]),
        Route("/v1/runs/{run_id}/stop", authed(api.runs.stop), methods=["POST"]),
        Route("/v1/runs/{run_id}/media/{media_id}", authed(api.runs.media)),
        Route("/v1/notices", authed(partial(notices, api))),
    ]
    if settings.web_dir is not None:
        routes.append(Mount("/", app=web_app(settings.web_dir), name="web"))
    app = Starlette(
        routes=routes,
        middleware=origins.middleware(settings.cors_origins),
        lifespan=lifespan,
        exception_handlers={
            ApiError: on_api_error,
            ClientError: on_client_error,
            HTTPException: on_http_error,
            Exception: on_bug,
        },
    )
    app.state.api = api
    return app
