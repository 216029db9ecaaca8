"""What keeps a few connections from holding the endpoint: uvicorn's HTTP
protocol with a header timeout, a cap on connections, and answers of its
own that are OpenAI-shaped.

uvicorn closes a keep-alive connection that stays silent after a response
(`timeout_keep_alive`), but it has no limit on the time a request's head
may take: a connection that sends nothing, or one header line a minute
(slowloris), stays open for ever, and a few thousand of them take every
file descriptor the process has; then nobody, `/health` included, gets
an answer. And uvicorn's `limit_concurrency` only answers 503 to every
request once that many connections are open, so half-open ones would
still shut everyone out. Here, subclassing the protocol uvicorn would
pick itself (httptools if installed, else h11):

- A connection waiting for a request's head (a new one, or one whose last
  response has ended) is closed after `header_timeout` seconds, whether it
  sends nothing or a byte at a time. A request whose head has come may take
  as long as its answer does (a stream); its body has a time limit of its
  own (`ApiSettings.body_timeout`).
- At most `max_connections` are open: one more makes room by closing the
  connection that has waited longest for a request's head (an idle client
  reconnects as it would after the keep-alive timeout), so a new client,
  a health check, always gets in while idle connections hold the slots;
  only when every connection is busy with a request is the new one
  answered 503 and closed.
- uvicorn's own error answers (a request that is not HTTP, the 503 above)
  are OpenAI-shaped JSON, as every other error of the endpoint is.
- Each request that carries a bearer key counts against that key's share
  (shares.py): a cap on its open requests and connections, and slots kept
  for keys with nothing open and for `/health`.
- A request's body must keep up a minimum rate (`BodyDeadline`, read by
  api.py): one byte every few seconds, under the body timeout, would hold
  its connection for the whole timeout.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import logging
import resource
import time
from typing import Any

from .errors import ApiError
from .logsafe import kv
from .shares import Shares, shared

log = logging.getLogger("hermes_sup.httpapi")

HEADER_TIMEOUT = 10.0  # seconds for a request's head, from when the connection is idle
MAX_CONNECTIONS = 4096
FD_RESERVE = 64  # descriptors kept for everything but client connections
# A body's first seconds are not held to the minimum rate: a client may
# send its head before it has the body ready.
BODY_GRACE = 5.0


def default_max_connections() -> int:
    """MAX_CONNECTIONS, or fewer when the process may open fewer files."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(1, min(MAX_CONNECTIONS, soft - FD_RESERVE))


def raw_answer(error: ApiError) -> bytes:
    """A whole HTTP/1.1 answer for `error` that closes the connection."""
    body = json.dumps(error.body()).encode()
    head = [
        f"HTTP/1.1 {error.status} {_REASONS.get(error.status, 'Error')}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
        *(f"{name}: {value}" for name, value in error.headers.items()),
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


_REASONS = {400: "Bad Request", 503: "Service Unavailable"}


def connection_cap(max_connections: int | None) -> int:
    """The cap on open connections a setting of `max_connections` means."""
    return max_connections if max_connections is not None else default_max_connections()


def guarded_protocol(
    header_timeout: float = HEADER_TIMEOUT,
    max_connections: int | None = None,
    shares: Shares | None = None,
) -> type[asyncio.Protocol]:
    """The protocol class to give uvicorn.Config as `http`; with `shares`,
    each key's requests are counted in its share."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    cap = connection_cap(max_connections)
    busy_answer = raw_answer(
        ApiError(
            503,
            f"the endpoint has {cap} connections open, each with a request in progress; "
            "try again shortly",
            "too_many_connections",
            "server_error",
            {"Retry-After": "1"},
        )
    )

    class GuardedProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
        """uvicorn's protocol, guarded as the module docstring says."""

        _head_timer: asyncio.TimerHandle | None = None
        idle_since = 0.0

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if shares is not None:
                # uvicorn's own attribute, set by its __init__ (untyped there).
                self.app = shared(self.app, shares, self)  # type: ignore[has-type]

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._wait_for_head()
            if len(self.connections) > cap:
                make_room(self, cap, busy_answer)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._wait_for_head()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            if shares is not None:
                shares.drop(self)
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            self.transport.write(raw_answer(ApiError(400, msg, "invalid_http_request")))
            self.transport.close()

        def is_busy(self) -> bool:
            """Whether a request's head has come and its answer not ended."""
            cycle = self.cycle
            return cycle is not None and not cycle.response_complete

        def _wait_for_head(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self.idle_since = time.monotonic()
            self._head_timer = self.loop.call_later(header_timeout, self._head_too_slow)

        def _head_too_slow(self) -> None:
            self._head_timer = None
            if not self.is_busy() and not self.transport.is_closing():
                self.transport.close()  # its answer's end arms the timer again otherwise

        def close(self) -> None:
            """Close the connection (its share makes room)."""
            self.transport.close()

    return GuardedProtocol


def make_room(new: Any, cap: int, busy_answer: bytes) -> None:
    """One connection too many (`new`, a GuardedProtocol, is the newest):
    close the longest idle ones, or refuse `new` when none is idle."""
    open_ = [c for c in new.connections if not c.transport.is_closing()]
    excess = len(open_) - cap
    if excess <= 0:
        return
    idle = [c for c in open_ if c is not new and not c.is_busy()]
    for conn in heapq.nsmallest(excess, idle, key=lambda c: c.idle_since):
        conn.transport.close()
        excess -= 1
    if excess > 0:
        log.warning(kv("http_connection_refused", connections=len(open_), cap=cap))
        new.transport.write(busy_answer)
        new.transport.close()


class BodyDeadline:
    """When a request's body, arriving now, is too late: after `timeout`
    seconds in all, or once it falls below `min_rate` bytes a second (after
    BODY_GRACE seconds). A timer armed for the earliest such moment moves on
    as bytes come, so a body that keeps up costs one timer, not one a piece."""

    def __init__(self, timeout: float, min_rate: int, now: float) -> None:
        self.start = now
        self.timeout = timeout
        self.min_rate = min_rate
        self.received = 0

    def add(self, count: int) -> None:
        """`count` more bytes of the body came."""
        self.received += count

    def due(self) -> float:
        """The moment the body is too late, as it stands."""
        last = self.start + self.timeout
        if self.min_rate <= 0:
            return last
        return min(last, self.start + BODY_GRACE + self.received / self.min_rate)

    def too_slow(self, now: float) -> bool:
        """Whether the body is cut for its rate (rather than its timeout)."""
        return self.min_rate > 0 and now - self.start < self.timeout

    def rate(self, now: float) -> float:
        """Bytes a second so far."""
        return self.received / max(now - self.start, 1e-9)
