"""One turn, read in its own task: the bridge between a turn's events and
whatever the HTTP side does with them.

Every turn the endpoint starts is read by a `Pump`, an asyncio task of its
own, never by the task writing the HTTP response. So a client that stops
reading blocks only its own pump (its events wait in a bounded queue, see
`QueueSink`), never the client library's one socket reader that every
other session's events come through. A pump that cannot hand on an event
for `stall_timeout` seconds, or whose reader went away (`abandon`), cancels
its turn in the supervisor: a turn is never left running for nobody.

A non-streaming answer reads its turn inline instead (`read_turn`, into a
list that never blocks), and every response notices a client that hangs
up with one watcher task (`unless_hung_up`, `EventStream`) rather than a
pump task, a disconnect task and Starlette's anyio task group: each is a
task and wake-ups per request, which the endpoint's latency is made of.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from hermes_sup.client import (
    ApprovalRequest,
    AsyncClient,
    AsyncTurn,
    ClientError,
    Event,
    Queued,
    Reply,
    Running,
    Token,
)

from .logsafe import kv
from .said import END

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
    # Called once its reader is done, with whether it read the turn to its
    # end; a turn with one is not cancelled when its reader goes (retries.py).
    on_done: Callable[[bool], None] | None = None

    @property
    def id(self) -> str:
        return self.turn.id

    @property
    def resumed(self) -> bool:
        """Whether this is a retry of a turn that had started: a new turn's
        first answer is `queued` or `running`; a resent one's is `duplicate`
        (or the next of its events), or its final answer if it had ended."""
        return not isinstance(self.first, (Queued, Running))


async def open_turn(
    client: AsyncClient,
    key: str,
    text: str,
    context: dict[str, Any] | None = None,
    options: dict[str, Any] | None = None,
    turn_id: str | None = None,
    orphan_grace: float | None = None,
) -> OpenTurn:
    """Send a turn (with its front end's context, if any, and session
    options; under `turn_id`, a retry's, if given) and read its first answer
    (queued or running, said at once), so that a refusal (overloaded, busy,
    failed session) raises here, before the HTTP response has started."""
    turn = await client.send(
        key,
        text,
        context=context or None,
        options=options,
        turn_id=turn_id,
        orphan_grace=orphan_grace,
    )
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
        self.ended = await read_turn(self.opened, self.sink, self.on_event)


async def read_turn(
    o: OpenTurn, sink: Sink, on_event: Callable[[Event], Awaitable[None]] | None = None
) -> bool:
    """Hand every item of the turn to `sink`, to its end; whether it ended.
    If it did not (the sink gave up, or this was cancelled), the turn is
    cancelled in the supervisor, unless it waits for a retry (`on_done`)."""
    ended = False
    try:
        event: Event = o.first
        while True:
            if on_event is not None:
                await on_event(event)
            if isinstance(event, Reply):
                ended = True
            if not await sink(event) or ended:
                return ended
            event = await o.events.__anext__()
    except ClientError as exc:
        ended = True
        await sink(exc)
        return ended
    except StopAsyncIteration:
        ended = True  # cannot happen: a turn ends with its Reply or an error
        return ended
    finally:
        if not ended and o.on_done is None:
            await _cancel_turn(o)
        await o.events.aclose()
        if o.on_done is not None:
            o.on_done(ended)


async def _cancel_turn(o: OpenTurn) -> None:
    try:
        await o.client.cancel(o.key, o.id, timeout=5.0)
        log.info(kv("http_turn_cancelled", session=o.key, turn=o.id))
    except ClientError as exc:
        log.warning(kv("http_turn_cancel_failed", session=o.key, turn=o.id, error=exc))


async def _disconnected(receive: Receive) -> None:
    """Returns when the client has gone (its body was read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def unless_hung_up(receive: Receive, work: Awaitable[Any]) -> bool:
    """Await `work` in this task; if the client hangs up first, cancel it
    (its `finally` runs) and return False. True: it finished."""
    task = asyncio.current_task()
    assert task is not None
    over = hung_up = False

    def hang_up(gone: asyncio.Future[None]) -> None:
        nonlocal hung_up
        # `over`: the callback may run after `work` finished; never cancel then.
        if not over and not gone.cancelled() and gone.exception() is None:
            hung_up = True
            task.cancel()

    gone = asyncio.ensure_future(_disconnected(receive))
    gone.add_done_callback(hang_up)
    try:
        await work
        return True
    except asyncio.CancelledError:
        if not hung_up:
            raise
        task.uncancel()
        return False
    finally:
        over = True
        gone.cancel()


class EventStream(StreamingResponse):
    """A StreamingResponse that watches for a hang-up with one task (see
    the module docstring); the body's generator is cancelled then, and its
    `finally` ends the turn."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await unless_hung_up(receive, self.stream_response(send))
        if self.background is not None:
            await self.background()


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


def approval_denier(opened: OpenTurn) -> Callable[[Event], Awaitable[None]]:
    """An `on_event` for a turn whose client cannot answer approvals (chat
    completions, responses): each request is denied at once, as Hermes's
    API server leaves such a command unapproved."""

    async def deny(event: Event) -> None:
        if isinstance(event, ApprovalRequest):
            key = opened.key
            log.info(kv("http_approval_denied", session=key, command=event.command[:200]))
            try:
                await opened.client.approve(key, "deny", approval=event.id)
            except ClientError as exc:
                log.warning(kv("http_approval_deny_failed", session=key, error=exc))

    return deny


async def collect(
    receive: Receive,
    opened: OpenTurn,
    on_event: Callable[[Event], Awaitable[None]] | None,
) -> list[Any] | None:
    """Every event of a turn but its tokens (the reply holds the text),
    ending with its Reply or error; None if the client (whose ASGI
    `receive` this is) hung up first (the turn is cancelled then)."""
    items: list[Any] = []

    async def keep(item: Any) -> bool:
        if not isinstance(item, Token):
            items.append(item)
        return True

    # Read inline: a list never blocks, so no pump task is needed here.
    if not await unless_hung_up(receive, read_turn(opened, keep, on_event)):
        return None
    return items
