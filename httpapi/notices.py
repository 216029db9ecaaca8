"""GET /v1/notices: what a key's sessions say outside their turns.

A session's agent may speak after its turn ended: a background process it
started with `notify_on_complete` finished. The worker sends that as a
notice (PROTOCOL.md, "Notices"); this stream hands a key the notices of its
own sessions, as SSE `data: {"session_key", "notice"}` lines, from the moment
it connects (none are stored for later). A messaging gateway keeps one open
and starts the turn the notice calls for in the session's chat: which chat
that is, the gateway decides from the session key, never from the notice.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from hermes_sup.client import ClientError

from .api import Api
from .errors import ApiError
from .logsafe import kv
from .sessions import tenant_of
from .stream import SSE_HEADERS
from .turns import EventStream

log = logging.getLogger("hermes_sup.httpapi")

NOTICE = "notice"
KEEPALIVE = 15.0  # seconds between keepalive comments on a quiet stream
MAX_STREAMS = 4  # notice streams of one key open at once
OPEN: Counter[str] = Counter()  # open streams, by key namespace


async def notices(api: Api, request: Request) -> Response:
    """The key's sessions' notices, as they come (429 past MAX_STREAMS of
    one key open at once: each holds one of the endpoint's watches, which
    every key shares)."""
    tenant = tenant_of(request)
    if OPEN[tenant.prefix] >= MAX_STREAMS:
        raise ApiError(
            429, f"at most {MAX_STREAMS} notice streams of one key at once", "too_many_streams"
        )
    return EventStream(
        _stream(api, tenant.prefix), media_type="text/event-stream", headers=SSE_HEADERS
    )


async def _stream(api: Api, prefix: str) -> AsyncIterator[bytes]:
    OPEN[prefix] += 1  # counted while its body runs: one never started holds none
    try:
        async for chunk in _notices(api, prefix):
            yield chunk
    finally:
        OPEN[prefix] -= 1
        if OPEN[prefix] <= 0:
            del OPEN[prefix]


async def _notices(api: Api, prefix: str) -> AsyncIterator[bytes]:
    queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=1000)

    async def read() -> None:
        try:
            async for event in api.client().watch(None, types=[NOTICE]):
                key = event.session or ""
                if event.type != NOTICE or not key.startswith(prefix):
                    continue  # another key's session
                line = json.dumps({"session_key": key, "notice": _plain(event.data)})
                try:
                    queue.put_nowait(f"data: {line}\n\n".encode())
                except asyncio.QueueFull:
                    log.warning(kv("http_notice_dropped", session=key))
        except ClientError as exc:
            log.warning(kv("http_notices_ended", error=exc))
        finally:
            if not queue.full():
                queue.put_nowait(None)  # the stream ends (the supervisor went away)

    reader = asyncio.get_running_loop().create_task(read())
    try:
        yield b": notices\n\n"
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), KEEPALIVE)
            except TimeoutError:
                yield b": keepalive\n\n"
                continue
            if item is None:
                return
            yield item
    finally:
        reader.cancel()


def _plain(value: Any) -> Any:
    """JSON-safe: bytes a worker put in a notice are not sent on."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)
