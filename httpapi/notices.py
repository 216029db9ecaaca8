"""GET /v1/notices and POST /v1/notices/ack: what a key's sessions say
outside their turns, at least once.

A session's agent may speak after its turn ended: a background process it
started with `notify_on_complete` finished, a cron job ran. The worker sends
that as a notice (PROTOCOL.md, "Notices"); the endpoint keeps each on its
key's shelf until the key acknowledges it (notice_book.py). The stream hands
a key its own sessions' notices as SSE events, `id: <cursor>` and
`data: {"id", "cursor", "session_key", "client_key", "notice"}`: first the
ones kept after the cursor it names (`?after=N`, or the `Last-Event-ID` a
reconnecting SSE client sends; without either, every one kept), then each
as it comes. A messaging gateway keeps one open, starts the turn the notice
calls for in the session's chat (which chat: it decides from `client_key`,
the session id it named the session by, never from the notice) and then
acknowledges the cursor, so a notice that came while it was down, or that
it had not handled when it went down, is handed to it again.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .api import Api
from .errors import ApiError
from .notice_book import NoticeBook, Shelf
from .sessions import tenant_of
from .stream import SSE_HEADERS
from .turns import EventStream

KEEPALIVE = 15.0  # seconds between keepalive comments on a quiet stream
MAX_STREAMS = 4  # notice streams of one key open at once
OPEN: Counter[str] = Counter()  # open streams, by key namespace


class Notices:
    """The notice routes of one endpoint, over its book."""

    def __init__(self, api: Api, book: NoticeBook) -> None:
        self.api = api
        self.book = book

    async def stream(self, request: Request) -> Response:
        """The key's sessions' notices after a cursor, then as they come
        (429 past MAX_STREAMS of one key open at once)."""
        tenant = tenant_of(request)
        after = _cursor(request.query_params.get("after"), "after")
        if after is None:
            after = _cursor(request.headers.get("Last-Event-ID"), "Last-Event-ID")
        if OPEN[tenant.prefix] >= MAX_STREAMS:
            raise ApiError(
                429, f"at most {MAX_STREAMS} notice streams of one key at once", "too_many_streams"
            )
        shelf = self.book.shelf(tenant.prefix)
        return EventStream(
            _counted(shelf, after or 0), media_type="text/event-stream", headers=SSE_HEADERS
        )

    async def ack(self, request: Request) -> Response:
        """Forget the key's notices up to the cursor the body names."""
        body = await self.api.read_json(request)
        cursor = body.get("cursor")
        if isinstance(cursor, bool) or not isinstance(cursor, int) or cursor < 0:
            raise ApiError(
                400, "'cursor' must be a notice's cursor: a whole number, 0 or more",
                "invalid_cursor", headers=None,
            )  # fmt: skip
        shelf = self.book.shelf(tenant_of(request).prefix)
        acked = shelf.ack(cursor)
        return JSONResponse({"acked": acked, "kept": len(shelf.entries)})


def _cursor(raw: str | None, where: str) -> int | None:
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ApiError(400, f"{where} must be a notice's cursor (0 or more)", "invalid_cursor")
    return value


async def _counted(shelf: Shelf, after: int) -> AsyncIterator[bytes]:
    OPEN[shelf.prefix] += 1  # counted while its body runs: one never started holds none
    try:
        async for chunk in _notices(shelf, after):
            yield chunk
    finally:
        OPEN[shelf.prefix] -= 1
        if OPEN[shelf.prefix] <= 0:
            del OPEN[shelf.prefix]


async def _notices(shelf: Shelf, after: int) -> AsyncIterator[bytes]:
    if after >= shelf.next_cursor:
        after = 0  # a cursor never given: the shelf was lost since, so all it has now
    yield b": notices\n\n"
    while True:
        changed = shelf.changed  # taken before reading: a notice after it sets it
        for entry in shelf.after(after):
            yield f"id: {entry.cursor}\ndata: {json.dumps(entry.line())}\n\n".encode()
            after = entry.cursor
        try:
            await asyncio.wait_for(changed.wait(), KEEPALIVE)
        except TimeoutError:
            yield b": keepalive\n\n"
