"""Retries by turn id: a request sent again after its answer was lost joins
the turn its first try started, or reads that turn's answer; it never runs
the turn a second time, even on an endpoint restarted since.

Theory of operation. The supervisor never runs a `send` whose id it knows
(its per-session turn journal, PROTOCOL.md "Turn ids"), and a resend from a
new connection takes over a turn whose first connection is gone. So the
endpoint only has to send a retry with the same turn id, to the same
session, as its first try:

- The turn id is derived, never stored: an HMAC keyed by the request's
  scope (idempotency.py `scope_of`, a hash of the bearer key itself) over
  the route, the `Idempotency-Key` and the body's fingerprint; 32 hex
  digits. A restarted endpoint derives the same id; another key derives
  another, so no key can join or read a turn of another's by guessing its
  Idempotency-Key; a different body with the same key is a different turn
  (as idempotency.py treats it). A run's turn id is derived the same way
  from its run id (runs.py), so its status can be asked after a restart.
- The session must be the same too: one the request names (a session
  header, `session_id`, a conversation) is; one the endpoint would make up
  (a new conversation) is derived from the turn id instead of drawn at
  random (`conversation_id`), and one a chat continued from memory
  (continuity.py) is remembered here for its retries (`remember`, `recall`).
- What a retry gets depends on where the turn is. The first answer to the
  resend says: `status queued/running` (the turn had not started, or is
  new: read as any turn), `status duplicate` or any other event (it was
  running: `resumed`, the rest of its events follow, from where the turn
  is now; what was already streamed to the first try is not sent again),
  or the final answer itself (it had ended: its recorded reply or error).
- One turn is read by one request at a time in this process (`claim`): a
  second request for a turn still being read is refused with 409, since
  the client's connection can hold one reader per turn id. A request whose
  client hung up leaves its turn running for `grace` seconds (`release`),
  so that a retry can take it over; if none comes, it is cancelled then,
  as a turn nobody reads is. A turn that failed, its client answered with
  the error, is not given again by this process: as in Hermes, a repeat
  runs anew (`attempt`, `failed`); a restarted endpoint, which does not
  know it failed, answers a repeat with the recorded error instead of
  running it twice. A request without an Idempotency-Key still
  cancels its turn at once when its client goes: that is how a front end
  stops one (hermes-webui's Stop button closes the stream).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from starlette.requests import Request

from hermes_sup.client import AsyncClient, ClientError

from .errors import ApiError
from .idempotency import HEADER, fingerprint, scope_of
from .logsafe import kv

log = logging.getLogger("hermes_sup.httpapi")

GRACE = 30.0  # seconds a turn whose client hung up waits for a retry
REMEMBERED = 10_000  # places of retried turns kept (chats continued from memory)
TURN_ID_LENGTH = 32  # hex digits: 128 bits, within the protocol's 64 characters


def derive(scope: str, *parts: str) -> str:
    """A turn id for `parts` in `scope`: the same for the same key and
    parts on any endpoint, unguessable without the bearer key."""
    mac = hmac.new(scope.encode(), "\0".join(parts).encode("utf-8", "surrogateescape"), "sha256")
    return mac.hexdigest()[:TURN_ID_LENGTH]


def turn_id_of(
    request: Request, route: str, body: dict[str, Any], fields: Sequence[str]
) -> str | None:
    """The turn id of a request with an Idempotency-Key; None without one."""
    key = request.headers.get(HEADER, "")
    if not key:
        return None
    return derive(scope_of(request), route, key, fingerprint(body, fields))


def conversation_id(turn_id: str) -> str:
    """The id of a conversation a retried chat starts: `api-` and 16 hex
    digits as `new_conversation_id`'s, but the same for each try."""
    return "api-" + derive(turn_id, "conversation")[:16]


class Retries:
    """Which turns this process reads, which wait for a retry, and where
    retried turns went."""

    def __init__(self, grace: float = GRACE) -> None:
        self.grace = grace
        self._reading: set[tuple[str, str]] = set()
        self._waiting: dict[tuple[str, str], asyncio.TimerHandle] = {}
        self._places: OrderedDict[str, Any] = OrderedDict()
        self._failed: dict[str, int] = {}  # failures seen of each turn id, by its first
        self._tasks: set[asyncio.Task[Any]] = set()

    def claim(self, session: str, turn: str) -> None:
        """This request reads the turn now: 409 if another one does; a turn
        left waiting for a retry is this one's."""
        at = (session, turn)
        if at in self._reading:
            raise ApiError(
                409,
                "A request with this Idempotency-Key is still being answered; "
                "retry once it has ended or its client has gone",
                "idempotency_in_progress",
                headers={"Retry-After": "1"},
            )
        waiting = self._waiting.pop(at, None)
        if waiting is not None:
            waiting.cancel()
        self._reading.add(at)

    def release(self, client: AsyncClient, session: str, turn: str, ended: bool) -> None:
        """The request reading the turn is done; one that did not read it to
        its end leaves it for a retry, for `grace` seconds."""
        at = (session, turn)
        self._reading.discard(at)
        if ended:
            return
        loop = asyncio.get_running_loop()
        self._waiting[at] = loop.call_later(self.grace, self._give_up, client, session, turn)
        log.info(kv("http_turn_left_for_retry", session=session, turn=turn, grace=self.grace))

    def _give_up(self, client: AsyncClient, session: str, turn: str) -> None:
        self._waiting.pop((session, turn), None)
        task = asyncio.get_running_loop().create_task(_cancel(client, session, turn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def attempt(self, turn: str | None) -> str | None:
        """The turn id a request sends now: `turn` itself, unless its turn
        failed in this process, then one derived from it per failure."""
        if turn is None:
            return None
        tries = self._failed.get(turn, 0)
        return turn if tries == 0 else derive(turn, "attempt", str(tries))

    def failed(self, turn: str | None) -> None:
        """The turn ended with an error its client was answered: as Hermes
        keeps no failed answer, a repeat runs again (under the next id)."""
        if turn is not None:
            self._failed[turn] = self._failed.get(turn, 0) + 1
            while len(self._failed) > REMEMBERED:
                del self._failed[next(iter(self._failed))]

    def remember(self, turn: str, place: Any) -> None:
        """Where a retried turn went, when that cannot be derived again."""
        self._places.pop(turn, None)
        self._places[turn] = place
        while len(self._places) > REMEMBERED:
            self._places.popitem(last=False)

    def recall(self, turn: str) -> Any:
        return self._places.get(turn)

    def close(self) -> None:
        """Stop the timers (the process is stopping: its turns stay recorded)."""
        for waiting in self._waiting.values():
            waiting.cancel()
        self._waiting.clear()


async def _cancel(client: AsyncClient, session: str, turn: str) -> None:
    try:
        await client.cancel(session, turn, timeout=5.0)
        log.info(kv("http_turn_cancelled", session=session, turn=turn, why="no retry came"))
    except ClientError as exc:
        log.warning(kv("http_turn_cancel_failed", session=session, turn=turn, error=exc))
