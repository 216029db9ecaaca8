"""One turn streamed as server-sent events: the loop chat completions and
the Responses API share.

The turn's pump (turns.py) fills a QueueSink; this reads it, sends a
keepalive comment when nothing came for a while, hands each item to the
API's writer (writers.py) and sends what it returns, all that has arrived
by then in one write. If the reader leaves before the end, the turn is
abandoned (its pump cancels it).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from hermes_sup.client import Dropped

from .logsafe import kv
from .turns import IDLE, Pump, QueueSink, next_item
from .writers import SseEvent, TurnWriter

log = logging.getLogger("hermes_sup.httpapi")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
KEEPALIVE = b": keepalive\n\n"


def sse_data(obj: Any) -> bytes:
    """One unnamed server-sent event carrying `obj` as JSON."""
    return f"data: {json.dumps(obj)}\n\n".encode()


def _encode(events: list[SseEvent]) -> bytes:
    return b"".join(event.encode() for event in events)


async def stream(
    pump: Pump,
    sink: QueueSink,
    writer: TurnWriter[SseEvent],
    keepalive: float,
    on_end: Callable[[], None] | None = None,
    on_abandon: Callable[[], None] | None = None,
) -> AsyncIterator[bytes]:
    """The SSE body of one turn. `on_end` runs once the writer wrote the
    turn's end; `on_abandon` when the reader left before it."""
    queue = sink.queue

    def write(item: Any) -> bytes:
        if isinstance(item, Dropped):
            log.warning(kv("http_stream_dropped", stream=sink.what, count=item.count))
        return _encode(writer(item))

    try:
        yield _encode(writer.start())
        while not writer.finished:
            item = await next_item(queue, keepalive)
            if item is IDLE:
                yield KEEPALIVE
                continue
            out = [write(item)]
            while not writer.finished and not queue.empty():
                out.append(write(queue.get_nowait()))
            if writer.finished and on_end is not None:
                on_end()  # before the last write: a client that saw it may ask at once
            data = b"".join(out)
            if data:
                yield data
    finally:
        if not writer.finished:
            pump.abandon()  # the client went away mid-stream: cancel its turn
            if on_abandon is not None:
                on_abandon()
