"""One turn, read in its own task: the bridge between a turn's events and
whatever the HTTP side does with them.

Every turn the endpoint starts is read by a `Pump`, an asyncio task of its
own, never by the task writing the HTTP response. So a client that stops
reading blocks only its own pump (its events wait in a bounded queue, see
`QueueSink`), never the client library's one socket reader that every
other session's events come through. A pump that cannot hand on an event
for `stall_timeout` seconds, or whose reader went away (`abandon`), cancels
its turn in the supervisor: a turn is never left running for nobody.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

from hermes_sup.client import AsyncClient, AsyncTurn, ClientError, Event, Reply
from hermes_sup.local.logfmt import kv

log = logging.getLogger("hermes_sup.httpapi")

# What a pump hands on: each event of the turn, then its Reply or the error
# that ended it.
Item: TypeAlias = "Event | ClientError"
Sink = Callable[[Item], Awaitable[bool]]  # False: nobody takes events any more


@dataclass
class OpenTurn:
    """A turn the supervisor has accepted: its first answer already read."""

    client: AsyncClient
    key: str
    turn: AsyncTurn
    events: AsyncGenerator[Event, None]
    first: Event

    @property
    def id(self) -> str:
        return self.turn.id


async def open_turn(
    client: AsyncClient,
    key: str,
    text: str,
    context: dict[str, Any] | None = None,
    options: dict[str, Any] | None = None,
) -> OpenTurn:
    """Send a turn (with its front end's context, if any, and session
    options) and read its first answer (queued or running, said at once), so
    that a refusal (overloaded, busy, failed session) raises here, before
    the HTTP response has started."""
    turn = await client.send(key, text, context=context or None, options=options)
    events: AsyncGenerator[Event, None] = turn.__aiter__()
    try:
        first = await events.__anext__()
    except BaseException:
        await events.aclose()
        raise
    return OpenTurn(client, key, turn, events, first)


class Pump:
    """Reads one turn to its end in its own task and hands every item to `sink`."""

    def __init__(
        self,
        opened: OpenTurn,
        sink: Sink,
        tasks: set[asyncio.Task[Any]],
        on_event: Callable[[Event], Awaitable[None]] | None = None,
    ) -> None:
        self.opened = opened
        self.sink = sink
        self.on_event = on_event
        self.ended = False  # the turn's Reply or final error was read
        self.task = asyncio.get_running_loop().create_task(self._run())
        tasks.add(self.task)  # the loop keeps only weak references to tasks
        self.task.add_done_callback(tasks.discard)

    def abandon(self) -> None:
        """Nobody reads this turn any more: stop it (safe from any finally)."""
        if not self.task.done():
            self.task.cancel()

    async def wait(self) -> None:
        """Until the pump has finished (the turn ended or was cancelled)."""
        await asyncio.shield(self.task)

    async def _run(self) -> None:
        o = self.opened
        try:
            event: Event = o.first
            while True:
                if self.on_event is not None:
                    await self.on_event(event)
                if isinstance(event, Reply):
                    self.ended = True
                if not await self.sink(event) or self.ended:
                    return
                event = await o.events.__anext__()
        except ClientError as exc:
            self.ended = True
            await self.sink(exc)
        except StopAsyncIteration:
            self.ended = True  # cannot happen: a turn ends with its Reply or an error
        finally:
            if not self.ended:
                await self._cancel_turn()
            await o.events.aclose()

    async def _cancel_turn(self) -> None:
        o = self.opened
        try:
            await o.client.cancel(o.key, o.id, timeout=5.0)
            log.info(kv("http_turn_cancelled", session=o.key, turn=o.id))
        except ClientError as exc:
            log.warning(kv("http_turn_cancel_failed", session=o.key, turn=o.id, error=exc))


END = object()  # closes a QueueSink's reader when the sink gives up
IDLE = object()  # what `next_item` returns when nothing came in time


async def next_item(queue: asyncio.Queue[Any], wait: float) -> Any:
    """The queue's next item, or IDLE after `wait` seconds without one (for
    a keepalive). Without a task per item, as `wait_for` would make."""
    if not queue.empty():
        return queue.get_nowait()
    try:
        async with asyncio.timeout(wait):
            return await queue.get()
    except TimeoutError:
        return IDLE


class QueueSink:
    """A bounded queue between a pump and one HTTP response. The pump waits
    at most `stall_timeout` for room; then the reader is taken for gone and
    the turn is cancelled (the response ends when the reader next reads)."""

    def __init__(self, maxsize: int, stall_timeout: float, what: str) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue(maxsize)
        self.stall_timeout = stall_timeout
        self.what = what
        self.stalled = False

    async def __call__(self, item: Item) -> bool:
        if not self.queue.full():
            self.queue.put_nowait(item)  # the usual case: no timer, no task
            return True
        try:
            async with asyncio.timeout(self.stall_timeout):
                await self.queue.put(item)
            return True
        except TimeoutError:
            self.stalled = True
            log.warning(kv("http_client_stalled", stream=self.what, seconds=self.stall_timeout))
            # What it did not read is dropped: should it read again, it learns
            # at once that the stream was given up, and memory stays bounded.
            while not self.queue.empty():
                self.queue.get_nowait()
            self.queue.put_nowait(END)
            return False
