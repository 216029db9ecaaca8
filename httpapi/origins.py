"""Which browser origins may use the endpoint, as Hermes's API server decides.

A browser names the page a request comes from in its `Origin` header; other
clients (the openai SDK, hermes-webui's server, the gateway) send none. As
in Hermes, a request from an origin the operator did not allow is refused
with 403 before anything else reads it, so a page on another site cannot
drive the endpoint from a visitor's browser, even one that learnt a key.
Two cases Hermes does not have are let through as well: no `Origin` at all,
and the endpoint's own origin, which is what the page served with `--web`
sends with its fetches. "Own" is the `Host` the request was sent to, and
only when that is an IP address or `localhost`: a page on a DNS name of an
attacker's, made to resolve to this endpoint's address (DNS rebinding),
sends its own name as both Origin and Host, and is refused. A page served
under a DNS name of the operator's is allowed by naming its origin.

The origins allowed are `--cors-origin` (repeated), else
HERMES_SUP_HTTP_CORS_ORIGINS, else Hermes's own API_SERVER_CORS_ORIGINS
(comma-separated, `*` for any), so an operator moving from Hermes's API
server keeps their setting. This module only refuses; the CORS protocol
itself (preflights, the `Access-Control-*` headers) is Starlette's
CORSMiddleware, which `middleware()` puts inside this check.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable, Mapping

from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import ApiError
from .logsafe import kv

log = logging.getLogger("hermes_sup.httpapi")

ORIGINS_ENV = "HERMES_SUP_HTTP_CORS_ORIGINS"
HERMES_ORIGINS_ENV = "API_SERVER_CORS_ORIGINS"  # Hermes's API server's own setting

# What a browser page may send and read, as Hermes allows (plus the session
# headers, which hermes-webui sends and reads back).
METHODS = ("GET", "POST", "DELETE", "OPTIONS")
HEADERS = (
    "Authorization",
    "Content-Type",
    "Idempotency-Key",
    "X-Hermes-Session-Id",
    "X-Hermes-Session-Key",
    "X-Hermes-Events",  # asks for Hermes's own SSE frames on chat (writers.py)
)
EXPOSED = ("X-Hermes-Session-Id", "X-Hermes-Session-Key", "Idempotency-Replayed")
MAX_AGE = 600  # seconds a browser may keep a preflight's answer, as in Hermes

DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def parse_origins(values: Iterable[str]) -> tuple[str, ...]:
    """Origins from flags or comma-separated settings, blanks dropped. A
    trailing slash is dropped too: a browser never sends one, so an origin
    written with it would never match."""
    found: list[str] = []
    for value in values:
        for item in value.split(","):
            item = item.strip().rstrip("/")
            if item and item not in found:
                found.append(item)
    return tuple(found)


def origins_from_env(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The default origins: ours if set, else Hermes's."""
    ours = environ.get(ORIGINS_ENV, "")
    return parse_origins([ours if ours.strip() else environ.get(HERMES_ORIGINS_ENV, "")])


def own_origin(scope: Scope, headers: Headers) -> str | None:
    """scheme://host[:port] of the request itself (its Host header, as the
    browser addressed it), the default port left out as browsers leave it."""
    host = headers.get("host")
    if not host:
        return None
    scheme = scope.get("scheme", "http")
    host = host.lower()
    port = DEFAULT_PORTS.get(scheme)
    if port is not None and host.endswith(f":{port}"):
        host = host[: -len(f":{port}")]
    return f"{scheme}://{host}"


def named_by_address(host: str) -> bool:
    """Whether a Host header (`name[:port]`, `[v6]:port`) names an IP
    address or localhost: names no page of another site can be served
    under, whatever its DNS says."""
    name = host.lower()
    if name.startswith("["):
        name = name[1 : name.find("]")] if "]" in name else ""
    else:
        name = name.rpartition(":")[0] if name.count(":") == 1 else name
    if name == "localhost":
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class OriginCheck:
    """Pure ASGI: refuses (403) a request whose `Origin` is neither allowed
    nor the endpoint's own; everything else goes on unchanged."""

    def __init__(self, app: ASGIApp, origins: tuple[str, ...]) -> None:
        self.app = app
        self.origins = origins
        self.any = "*" in origins

    def allowed(self, origin: str, scope: Scope, headers: Headers) -> bool:
        if self.any or origin in self.origins:
            return True
        own = own_origin(scope, headers)
        return own is not None and origin.lower() == own and named_by_address(headers["host"])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        if not origin or self.allowed(origin, scope, headers):  # empty: no browser's, as Hermes
            await self.app(scope, receive, send)
            return
        shown = origin[:200]
        log.warning(kv("http_origin_refused", origin=shown, path=scope.get("path", "")))
        refusal = ApiError(
            403,
            f"requests from the browser origin {shown!r} are not allowed: allow it with "
            f"`--cors-origin {shown}` or {ORIGINS_ENV}={shown} (comma-separated; * for any)",
            "origin_not_allowed",
        )
        await refusal.response()(scope, receive, send)


def middleware(origins: tuple[str, ...]) -> list[Middleware]:
    """The origin check, outermost, then (with any origin allowed) Starlette's
    CORSMiddleware, which answers preflights without a key and adds the
    CORS headers to every answer, streams included."""
    stack = [Middleware(OriginCheck, origins=origins)]
    if origins:
        stack.append(
            Middleware(
                CORSMiddleware,
                allow_origins=origins,
                allow_methods=METHODS,
                allow_headers=HEADERS,
                expose_headers=EXPOSED,
                max_age=MAX_AGE,
            )
        )
    return stack
