"""A fair share of the endpoint's connections for each bearer key.

guard.py keeps connections that never send a request from holding the
endpoint; this keeps one key's requests from doing so. Without it, one valid
key could open as many requests as the endpoint has connection slots (slow
bodies, streams nobody reads) and every other key, and `/health`, got 503.
Every request that carries a bearer key is counted against that key (by a
digest of the token: an invalid one is answered 401 at once by the app and
holds nothing), before the app sees it:

- A key may have `requests` open at once; one more is answered 429.
- A key may hold `connections`; a new connection of a key at its cap makes
  room by closing that key's longest idle one, or is answered 429 when all of
  them have a request open.
- The last `reserve` connection slots (a quarter of a cap smaller than
  four reserves) are kept for keys with nothing open
  and for requests without a key (`/health`): a key that already has a
  request open is answered 429 once the open requests of all keys reach the
  endpoint's connection cap less the reserve.

A 429 carries `Retry-After` and closes its connection without reading the
request's body, so a refused flood frees its slots at once. A request's
body that arrives slower than the endpoint's minimum rate is cut by the app
(api.py, guard.py's `BodyDeadline`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, Protocol

from .errors import RATE, ApiError
from .logsafe import kv

log = logging.getLogger("hermes_sup.httpapi")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

KEY_REQUESTS = 256  # requests one key may have open at once
KEY_CONNECTIONS = 512  # connections one key may hold
RESERVE = 64  # connection slots only keys with nothing open may take
RETRY_AFTER = "1"  # seconds: a slot frees as soon as one of the key's requests ends


class Connection(Protocol):
    """What a share needs of a connection (guard.py's protocol)."""

    idle_since: float

    def is_busy(self) -> bool: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class ShareLimits:
    """How much of the endpoint one key may hold."""

    requests: int = KEY_REQUESTS
    connections: int = KEY_CONNECTIONS
    reserve: int = RESERVE


class Shares:
    """Each key's open requests and connections, against `limits` and the
    endpoint's connection cap."""

    def __init__(
        self,
        limits: ShareLimits,
        cap: int,
        name_of: Callable[[str], str | None] | None = None,
    ) -> None:
        self.limits = limits
        # Below the cap by the reserve (a quarter of a small cap at most),
        # and never below one request.
        self.shared = max(1, cap - min(limits.reserve, cap // 4))
        self.name_of = name_of
        self.open: Counter[bytes] = Counter()  # requests open, by key digest
        self.total = 0  # requests open, of every key
        # Connections by key digest, in the order they first carried one
        # of its requests (a dict as an ordered set).
        self.held: dict[bytes, dict[Connection, None]] = {}
        self.key_of_connection: dict[Connection, bytes] = {}
        self.refusing: set[bytes] = set()  # keys whose last request was refused

    def admit(self, conn: Connection, key: bytes, token: str) -> ApiError | None:
        """Count a request of `key` on `conn` as open; or the 429 that refuses it."""
        limits = self.limits
        if self.open[key] >= limits.requests:
            why = f"this key has {limits.requests} requests open at once, its share"
            return self._refuse(key, token, why)
        if self.open[key] and self.total >= self.shared:
            why = (
                "the endpoint's other connection slots are kept for keys with no request "
                "open; this key has one"
            )
            return self._refuse(key, token, why)
        if not self._hold(conn, key):
            why = f"this key holds {limits.connections} connections, each with a request open"
            return self._refuse(key, token, why)
        self.open[key] += 1
        self.total += 1
        self.refusing.discard(key)
        return None

    def release(self, key: bytes) -> None:
        """A request of `key` admitted before has ended."""
        self.total -= 1
        self.open[key] -= 1
        if self.open[key] <= 0:
            del self.open[key]

    def drop(self, conn: Connection) -> None:
        """`conn` is closed: it holds no slot of its key any more."""
        key = self.key_of_connection.pop(conn, None)
        if key is None:
            return
        conns = self.held.get(key)
        if conns is not None:
            conns.pop(conn, None)
            if not conns:
                del self.held[key]

    def _hold(self, conn: Connection, key: bytes) -> bool:
        """Count `conn` as one of `key`'s connections: False when the key
        holds its cap of busy ones (an idle one is closed to make room)."""
        if self.key_of_connection.get(conn) == key:
            return True
        self.drop(conn)  # a keep-alive connection now carrying another key
        conns = self.held.setdefault(key, {})
        if len(conns) >= self.limits.connections:
            idle = [c for c in conns if c is not conn and not c.is_busy()]
            if not idle:
                if not conns:
                    del self.held[key]
                return False
            oldest = min(idle, key=lambda c: c.idle_since)
            self.drop(oldest)
            oldest.close()  # its client reconnects, as after a keep-alive timeout
        conns[conn] = None
        self.key_of_connection[conn] = key
        return True

    def _refuse(self, key: bytes, token: str, why: str) -> ApiError:
        if key not in self.refusing:  # once a run of refusals: a flood logs one line
            self.refusing.add(key)
            name = self.name_of(token) if self.name_of is not None else None
            log.warning(kv("http_key_share_full", key=name or "-", why=why))
        message = f"{why}; try again when one ends"
        return ApiError(429, message, "key_share_full", RATE, {"Retry-After": RETRY_AFTER})


def key_digest(scope: Scope) -> tuple[bytes, str] | None:
    """The request's bearer key as (digest, token), or None without one."""
    for name, value in scope.get("headers") or ():
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            token = token.strip()
            if scheme.lower() != "bearer" or not token:
                return None
            return hashlib.blake2b(token.encode(), digest_size=16).digest(), token
    return None


def shared(app: App, shares: Shares, conn: Connection) -> App:
    """`app` for the requests of one connection, each counted in its key's share."""

    async def counted(scope: Scope, receive: Receive, send: Send) -> None:
        found = key_digest(scope) if scope["type"] == "http" else None
        if found is None:
            await app(scope, receive, send)
            return
        key, token = found
        refused = shares.admit(conn, key, token)
        if refused is not None:
            await send_refusal(send, refused)
            return
        try:
            await app(scope, receive, send)
        finally:
            shares.release(key)

    return counted


async def send_refusal(send: Send, error: ApiError) -> None:
    """`error` as the request's answer, closing the connection: its body,
    never read, is not waited for."""
    body = json.dumps(error.body()).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
        *((name.lower().encode(), value.encode()) for name, value in error.headers.items()),
    ]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
