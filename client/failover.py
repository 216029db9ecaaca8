"""A blocking client over several routers of one cluster, failing over.

Routers keep no state that placement depends on: every router sends a key
to the same node, so a front end may use any of them. `Routers` talks to
one at a time, in the order given; when the one in use cannot be reached
(not running, or no answer within the timeout) or answers `node_lost`, it
moves to the next and sends the request again:

- a turn (`run`) again under its one turn id: the node that has it joins
  it, or answers from its turn journal, or runs it if it never started;
  never twice (PROTOCOL.md, "Resending"). A router killed mid-turn costs
  the turn one resend;
- any other call (`call`) again as it is: give only calls that are safe
  to repeat (list, status, inspect, turn_status).

Any other error is the answer, and is raised as from one supervisor. After
every router was tried `rounds` times in a row without an answer, the last
error is raised.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Self, TypeVar

from .blocking import Client
from .connection import Connection
from .errors import ClientError, NotRunning, SupervisorError, Timeout
from .events import Reply

T = TypeVar("T")

# Errors after which the same request goes to the next router.
NODE_LOST = "node_lost"
# Seconds between two rounds over every router (a router being restarted).
ROUND_PAUSE = 0.5


def fails_over(exc: ClientError) -> bool:
    """Whether a request that failed so goes to the next router: the one in
    use is not running, did not answer, or lost the node it ran on."""
    if isinstance(exc, (NotRunning, Timeout)):
        return True
    return isinstance(exc, SupervisorError) and exc.code == NODE_LOST


class RouterList:
    """A cluster's routers and which one is in use: what the blocking and the
    asyncio failover clients share (no I/O here)."""

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
        self.current = 0  # the index of the router in use
        self.failovers = 0  # times a request moved to the next router

    @classmethod
    def local(cls, state_dirs: Sequence[Path | str], **kw: Any) -> Self:
        """Routers on this host, by their state directories (each read when used:
        a router not running yet is skipped until it is)."""
        return cls([partial(Connection.local, d) for d in state_dirs], **kw)

    @classmethod
    def from_files(cls, paths: Sequence[Path | str], **kw: Any) -> Self:
        """Remote routers, by their connection files (`hermes-sup keys generate`)."""
        return cls([Connection.from_file(p) for p in paths], **kw)

    def connection(self) -> Connection:
        """The connection of the router in use (a local one read now)."""
        conn = self.connections[self.current]
        return conn if isinstance(conn, Connection) else conn()

    def attempts(self) -> range:
        """The tries a request gets: `rounds` over every router."""
        return range(self.rounds * len(self.connections))

    def pause_before(self, attempt: int) -> bool:
        """Whether a round over every router ended before this try (a router
        being restarted gets ROUND_PAUSE to come back)."""
        return attempt > 0 and attempt % len(self.connections) == 0

    def advance(self) -> None:
        """Use the next router from now on."""
        self.current = (self.current + 1) % len(self.connections)
        self.failovers += 1


class Routers(RouterList):
    """One cluster's routers, used one at a time; a request that finds the
    one in use gone is sent again through the next."""

    def __init__(
        self,
        connections: Sequence[Connection | Callable[[], Connection]],
        *,
        timeout: float = 10.0,
        rounds: int = 2,
    ) -> None:
        super().__init__(connections, timeout=timeout, rounds=rounds)
        self._client: Client | None = None

    def close(self) -> None:
        """Close the connection to the router in use."""
        if self._client is not None:
            self._client.close()
            self._client = None

    def __enter__(self) -> Routers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def client(self) -> Client:
        """A client of the router in use (NotRunning if it cannot be reached)."""
        if self._client is None:
            self._client = Client(connection=self.connection(), timeout=self.timeout)
        return self._client

    def call(self, fn: Callable[[Client], T]) -> T:
        """`fn(client)` through the router in use, again through the next
        while routers cannot be reached. `fn` must be safe to repeat."""
        last: ClientError | None = None
        for attempt in self.attempts():
            if self.pause_before(attempt):
                time.sleep(ROUND_PAUSE)
            try:
                return fn(self.client())
            except ClientError as exc:
                if not fails_over(exc):
                    raise
                last = exc
            self.close()
            self.advance()
        assert last is not None
        raise last

    def run(self, session: str, text: str, *, turn_id: str | None = None, **kw: Any) -> Reply:
        """Run one turn and return its reply; the turn keeps one id through
        every resend, so it runs at most once."""
        turn = turn_id or uuid.uuid4().hex
        return self.call(lambda c: c.send(session, text, turn_id=turn, **kw).collect())
