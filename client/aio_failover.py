"""`AsyncRouters`: the asyncio form of `Routers` (failover.py), over
`AsyncClient`: one cluster's routers used one at a time, a request that
finds the one in use gone sent again through the next, a turn under its
one id."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from .aio import AsyncClient
from .connection import Connection
from .errors import ClientError
from .events import Reply
from .failover import ROUND_PAUSE, RouterList, fails_over

T = TypeVar("T")


class AsyncRouters(RouterList):
    """One cluster's routers from asyncio (see `Routers`)."""

    def __init__(
        self,
        connections: Sequence[Connection | Callable[[], Connection]],
        *,
        timeout: float = 10.0,
        rounds: int = 2,
    ) -> None:
        super().__init__(connections, timeout=timeout, rounds=rounds)
        self._client: AsyncClient | None = None

    async def close(self) -> None:
        """Close the connection to the router in use."""
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()

    async def __aenter__(self) -> AsyncRouters:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def client(self) -> AsyncClient:
        """A client of the router in use (NotRunning if it cannot be reached)."""
        if self._client is None:
            self._client = AsyncClient(connection=self.connection(), timeout=self.timeout)
        return self._client

    async def call(self, fn: Callable[[AsyncClient], Awaitable[T]]) -> T:
        """`await fn(client)` through the router in use, again through the
        next while routers cannot be reached. `fn` must be safe to repeat."""
        last: ClientError | None = None
        for attempt in self.attempts():
            if self.pause_before(attempt):
                await asyncio.sleep(ROUND_PAUSE)
            try:
                return await fn(self.client())
            except ClientError as exc:
                if not fails_over(exc):
                    raise
                last = exc
            await self.close()
            self.advance()
        assert last is not None
        raise last

    async def run(self, session: str, text: str, *, turn_id: str | None = None, **kw: Any) -> Reply:
        """Run one turn and return its reply; one turn id through every resend."""
        turn = turn_id or uuid.uuid4().hex

        async def once(client: AsyncClient) -> Reply:
            return await (await client.send(session, text, turn_id=turn, **kw)).collect()

        return await self.call(once)
