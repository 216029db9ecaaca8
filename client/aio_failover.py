"""`AsyncRouters`: the asyncio form of `Routers` (failover.py), over
`AsyncClient`: one cluster's routers used one at a time, a request that
finds the one in use gone sent again through the next, a turn under its
one id."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from .aio import AsyncClient
from .connection import Connection
from .errors import ClientError
from .events import Reply
from .failover import ROUND_PAUSE, fails_over

T = TypeVar("T")


class AsyncRouters:
    """One cluster's routers from asyncio (see `Routers`)."""

    def __init__(
        self,
        connections: Sequence[Connection | Callable[[], Connection]],
        *,
        timeout: float = 10.0,
        rounds: int = 2,
    ) -> None:
        if not connections:
            raise ValueError("give at least one router")
        self.connections = list(connections)
        self.timeout = timeout
        self.rounds = rounds
        self.current = 0
        self.failovers = 0
        self._client: AsyncClient | None = None

    @classmethod
    def local(cls, state_dirs: Sequence[Path | str], **kw: Any) -> AsyncRouters:
        """Routers on this host, by their state directories."""
        return cls([partial(Connection.local, d) for d in state_dirs], **kw)

    @classmethod
    def from_files(cls, paths: Sequence[Path | str], **kw: Any) -> AsyncRouters:
        """Remote routers, by their connection files."""
        return cls([Connection.from_file(p) for p in paths], **kw)

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
            conn = self.connections[self.current]
            self._client = AsyncClient(
                connection=conn if isinstance(conn, Connection) else conn(),
                timeout=self.timeout,
            )
        return self._client

    async def call(self, fn: Callable[[AsyncClient], Awaitable[T]]) -> T:
        """`await fn(client)` through the router in use, again through the
        next while routers cannot be reached. `fn` must be safe to repeat."""
        last: ClientError | None = None
        for attempt in range(self.rounds * len(self.connections)):
            if attempt and attempt % len(self.connections) == 0:
                await asyncio.sleep(ROUND_PAUSE)
            try:
                return await fn(self.client())
            except ClientError as exc:
                if not fails_over(exc):
                    raise
                last = exc
            await self.close()
            self.current = (self.current + 1) % len(self.connections)
            self.failovers += 1
        assert last is not None
        raise last

    async def run(self, session: str, text: str, *, turn_id: str | None = None, **kw: Any) -> Reply:
        """Run one turn and return its reply; one turn id through every resend."""
        turn = turn_id or uuid.uuid4().hex

        async def once(client: AsyncClient) -> Reply:
            return await (await client.send(session, text, turn_id=turn, **kw)).collect()

        return await self.call(once)
