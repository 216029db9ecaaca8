"""`Idempotency-Key` on non-streaming chat completions and responses, as
Hermes's API server honours it.

A client that did not get its answer (a timeout, a dropped connection)
sends the same request again with the same `Idempotency-Key`; a second
turn would make the agent act twice. So:

- A repeat with the same key and the same fingerprint (a hash of the body
  fields Hermes hashes: `CHAT_FIELDS`, `RESPONSES_FIELDS`) within `TTL`
  seconds gets the first answer again, byte for byte (the same `id`),
  without a turn.
- A repeat while the first is still running waits for it and gets its
  answer, error included: one turn for both. If the first's client hung
  up, it answered nobody; the waiters then go on as if it had never been
  sent (one of them sends the turn again, under the same turn id, so it
  joins the turn, left running for it, or reads its end).
- Only successful answers (200) are kept: an error, or a request whose
  client hung up, is forgotten once the requests waiting on it have it.
- At most `LIMIT` answers of each bearer key are kept, the oldest dropped
  first: one front end's many requests never push out another's answers.
- The same key with a different fingerprint is, as in Hermes, not an
  error: it is a new request, runs its own turn, and its answer replaces
  the one kept under that key.

Unlike Hermes, whose cache is one for the whole server, keys are scoped to
the bearer key that sent them: a front end never gets an answer made for
another, whatever Idempotency-Key it guesses. The scope is a hash of the
presented key itself, not its name, so a key revoked and made again under
the same name does not see the old one's answers either. Everything here
is in memory: a restarted endpoint remembers nothing, but the request's
turn id (retries.py) does, so a repeat after a restart reads the first
turn's answer from the supervisor instead of running it again.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

HEADER = "Idempotency-Key"
TTL = 300.0  # seconds an answer is given again, as in Hermes
LIMIT = 1000  # answers kept at most, as in Hermes
HUNG_UP = 499  # nginx's "client closed request": a handler whose client went away

# The body fields Hermes's API server hashes for each route.
CHAT_FIELDS = ("model", "messages", "tools", "tool_choice", "stream")
RESPONSES_FIELDS = (
    "input",
    "instructions",
    "previous_response_id",
    "conversation",
    "model",
    "tools",
)


def fingerprint(body: dict[str, Any], fields: Sequence[str]) -> str:
    """The hash of `fields` of a request body (an absent field counts as
    null), with object keys sorted so that the same JSON in another key
    order is the same request."""
    subset = {name: body.get(name) for name in fields}
    text = json.dumps(subset, sort_keys=True, separators=(",", ":"))  # ASCII only
    return hashlib.sha256(text.encode()).hexdigest()


def scope_of(request: Request) -> str:
    """Whose keys these are: a hash of the request's bearer key (which
    `Api.check_auth` has accepted by the time a handler runs)."""
    token = request.headers.get("Authorization", "").partition(" ")[2].strip()
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()


@dataclass(frozen=True)
class Answer:
    """A whole answer, kept as bytes so that it can be sent again as it was
    (a Response's headers are a list that middleware edits in place)."""

    status: int
    body: bytes
    headers: tuple[tuple[bytes, bytes], ...]

    @classmethod
    def of(cls, response: Response) -> Answer | None:
        """The answer of a response with a body; None for a stream."""
        body = getattr(response, "body", None)
        if not isinstance(body, bytes):
            return None
        return cls(response.status_code, body, tuple(response.raw_headers))

    def response(self) -> Response:
        response = Response(self.body, status_code=self.status)
        response.raw_headers = list(self.headers)
        return response


@dataclass(frozen=True)
class Kept:
    fingerprint: str
    at: float
    answer: Answer


# What a request that waited on another's turn takes from it: that answer,
# that error, or None (its client hung up: try again).
Outcome = Answer | Exception | None


class IdempotencyCache:
    """Answers by (scope, Idempotency-Key), and the turns still running."""

    def __init__(
        self, ttl: float = TTL, limit: int = LIMIT, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl = ttl
        self.limit = limit
        self.clock = clock
        # By scope, then key: each scope's own `limit`, so that one front
        # end's many requests never push out another's answers.
        self._kept: dict[str, OrderedDict[str, Kept]] = {}
        self._running: dict[tuple[str, str, str], asyncio.Future[Outcome]] = {}

    def __len__(self) -> int:
        return sum(len(kept) for kept in self._kept.values())

    async def run(
        self,
        request: Request,
        body: dict[str, Any],
        fields: Sequence[str],
        compute: Callable[[], Awaitable[Response]],
    ) -> Response:
        """`compute()`'s answer, or the answer of the same request made
        before with the same Idempotency-Key; without the header, just
        `compute()`. Only for answers that are not streams."""
        key = request.headers.get(HEADER, "")
        if not key:
            return await compute()
        return await self.answer(scope_of(request), key, fingerprint(body, fields), compute)

    async def answer(
        self,
        scope: str,
        key: str,
        digest: str,
        compute: Callable[[], Awaitable[Response]],
    ) -> Response:
        """See `run`; `digest` is the request's `fingerprint`."""
        running_key = (scope, key, digest)
        while True:
            kept = self._lookup((scope, key), digest)
            if kept is not None:
                return kept.response()
            running = self._running.get(running_key)
            if running is None:
                break
            # shield: a waiter that is cancelled must not cancel the future
            # the others wait on.
            theirs = await asyncio.shield(running)
            if isinstance(theirs, Answer):
                return theirs.response()
            if isinstance(theirs, Exception):
                raise theirs
            # The first one's client hung up: look again (one of the waiters runs it).
        done: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self._running[running_key] = done
        outcome: Outcome = None
        try:
            response = await compute()
            answer = Answer.of(response)
            if answer is not None and answer.status != HUNG_UP:
                outcome = answer
                if answer.status == 200:
                    self._keep((scope, key), digest, answer)
            return response
        except Exception as exc:  # an error answer (ApiError, ClientError): theirs too
            outcome = exc
            raise
        finally:
            # Also when cancelled: then the outcome stays None and waiters retry.
            del self._running[running_key]
            done.set_result(outcome)

    def _lookup(self, at: tuple[str, str], digest: str) -> Answer | None:
        scope, key = at
        theirs = self._kept.get(scope)
        kept = theirs.get(key) if theirs is not None else None
        if theirs is None or kept is None:
            return None
        if self.clock() - kept.at > self.ttl:
            del theirs[key]
            return None
        return kept.answer if kept.fingerprint == digest else None

    def _keep(self, at: tuple[str, str], digest: str, answer: Answer) -> None:
        scope, key = at
        now = self.clock()
        theirs = self._kept.setdefault(scope, OrderedDict())
        theirs.pop(key, None)  # a replaced answer moves to the end: it is the newest
        theirs[key] = Kept(digest, now, answer)
        # Oldest first: expired ones (of every scope), then any over the limit.
        for kept in list(self._kept.values()):
            while kept:
                first = next(iter(kept.values()))
                if now - first.at <= self.ttl and (kept is not theirs or len(kept) <= self.limit):
                    break
                kept.popitem(last=False)
        self._kept = {scope: kept for scope, kept in self._kept.items() if kept}
