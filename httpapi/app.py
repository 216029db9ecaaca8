"""The ASGI app: Hermes's API-server routes, each request a client call.

This is the endpoint's composition root: `create_app(settings, keys,
connect)` makes the shared `Api` (api.py: one `AsyncClient` made by
`connect` on first use, so the endpoint may start before its supervisor)
and each route part, hands each what it uses, and lays out the route
table. Every route but the health checks needs a bearer key from `keys`,
compared in constant time. Browser origins are checked before anything
else (origins.py). Every answer carries Hermes's security headers
(security_headers.py), a bug's 500 too.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.types import ASGIApp

from hermes_sup.client import AsyncClient

from . import origins
from .api import Api
from .chat import Chat
from .errors import EXCEPTION_HANDLERS
from .info import Info
from .keys import KeyStore
from .notice_book import NoticeBook
from .notices import Notices
from .responses import Responses
from .runs import Runs
from .security_headers import SecurityHeaders
from .sessions import TENANT
from .settings import ApiSettings as ApiSettings  # httpapi.ApiSettings is read from here
from .web import web_app

Handler = Callable[[Request], Awaitable[Response]]

NOTICES_DIR = "notices"


class Endpoint(Starlette):
    """Starlette, with the security headers outside its own error handling
    (a handler's bug is answered there), so no answer goes without them."""

    def build_middleware_stack(self) -> ASGIApp:
        return SecurityHeaders(super().build_middleware_stack())


def create_app(
    settings: ApiSettings, keys: KeyStore, connect: Callable[[], AsyncClient]
) -> Starlette:
    """The endpoint as an ASGI app (serve it with uvicorn, or any ASGI server)."""
    api = Api(settings, keys, connect)
    info = Info(api)
    chat = Chat(api)
    responses = Responses(api)
    runs = Runs(api, responses.find)  # a run may continue a stored response
    book = NoticeBook(keys.dir.parent / NOTICES_DIR)  # beside the keys, in the data dir
    notices = Notices(api, book)

    def authed(handler: Handler) -> Handler:
        async def wrapped(request: Request) -> Response:
            request.scope[TENANT] = api.check_auth(request)
            return await handler(request)

        return wrapped

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        book.start(api.client)  # notices are kept from the start, streamed or not
        yield
        await book.close()
        await api.close()

    routes: list[BaseRoute] = [
        Route("/health", info.health),
        Route("/v1/health", info.health),
        Route("/v1/models", authed(info.models)),
        Route("/v1/capabilities", authed(info.capabilities)),
        Route("/v1/chat/completions", authed(chat.create), methods=["POST"]),
        Route("/v1/responses", authed(responses.create), methods=["POST"]),
        Route("/v1/responses/{response_id}", authed(responses.get), methods=["GET"]),
        Route("/v1/responses/{response_id}", authed(responses.delete), methods=["DELETE"]),
        Route("/v1/runs", authed(runs.create), methods=["POST"]),
        Route("/v1/runs/{run_id}", authed(runs.status)),
        Route("/v1/runs/{run_id}/events", authed(runs.events)),
        Route("/v1/runs/{run_id}/approval", authed(runs.approval), methods=["POST"]),
        Route("/v1/runs/{run_id}/stop", authed(runs.stop), methods=["POST"]),
        Route("/v1/runs/{run_id}/media/{media_id}", authed(runs.media)),
        Route("/v1/notices", authed(notices.stream)),
        Route("/v1/notices/ack", authed(notices.ack), methods=["POST"]),
    ]
    if settings.web_dir is not None:
        routes.append(Mount("/", app=web_app(settings.web_dir), name="web"))
    app = Endpoint(
        routes=routes,
        middleware=origins.middleware(settings.cors_origins),
        lifespan=lifespan,
        exception_handlers=EXCEPTION_HANDLERS,
    )
    app.state.api = api
    return app
