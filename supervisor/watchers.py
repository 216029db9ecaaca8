"""Watchers: clients that asked to see what happens in a session (or in all
of them), and the history a new watcher can replay.

Every event of a session is recorded in its history (large data is noted by
size, not kept) and sent to each watcher of it; a watcher that is gone is
forgotten, one that lags is told what it missed (door/fronts.py). Log followers (`logs --follow`) are kept per session
and fed the worker's output lines as they are logged, with their stamps.

Watches and log follows are capped together: MAX_WATCHERS in all, and
MAX_PER_CLIENT for one client connection, so that one client can neither
take every slot nor have each log line sent to it thousands of times. A
router (`hermes-sup route`) is one connection for all the front ends behind
it: it is held to MAX_WATCHERS alone, and holds each of them to
MAX_PER_CLIENT itself (cluster/routing.py). `per_client_limit` says which
limit a client has (the front sets it: it knows whose key a request came
with).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from hermes_sup.protocol import (
    MAX_WATCHES_PER_CLIENT,
    ErrorCode,
    Kind,
    Message,
    RemoteProtocolError,
    check_session_key,
)

from .endpoints import Endpoints
from .session import Session

# Watches and log follows open at once, of every client, and of one (the
# latter is PROTOCOL.md's, kept in hermes_sup.protocol for routers too).
MAX_WATCHERS = 1024
MAX_PER_CLIENT = MAX_WATCHES_PER_CLIENT
# Event data larger than this is not kept in a session's replay history.
HISTORY_DATA_LIMIT = 8192
MAX_WATCH_TYPES = 32


def approx_size(data: Any) -> int:
    """About how many bytes `data` holds: its msgpack size (C speed; far
    cheaper than len(repr(data)))."""
    if isinstance(data, (str, bytes)):
        return len(data)
    try:
        return len(msgpack.packb(data))
    except (TypeError, ValueError, OverflowError):
        return len(repr(data))


@dataclass
class Watcher:
    """A client that asked to see state changes (of one session, or all)."""

    client: bytes
    id: str
    session: str | None
    # The event types it asked for (`types`); empty: all of them.
    types: frozenset[str] = frozenset()


class Watchers:
    """Every watcher, by the id of its `watch` request, and every log follow."""

    def __init__(self, endpoints: Endpoints) -> None:
        self.endpoints = endpoints
        self.by_id: dict[str, Watcher] = {}
        # Log follows by the id of their `logs` request: the session followed.
        self.follows: dict[str, Session] = {}
        # Watches and follows open, per client connection, and how many one
        # may have (asked while its request is being handled).
        self.per_client: Counter[bytes] = Counter()
        self.per_client_limit: Callable[[bytes], int] = lambda client: MAX_PER_CLIENT

    def check_room(self, client: bytes) -> None:
        """Raise `busy` if `client` may not start one more watch or follow."""
        total = len(self.by_id) + len(self.follows)
        if total >= MAX_WATCHERS:
            raise RemoteProtocolError(
                ErrorCode.BUSY,
                f"too many watchers: the supervisor already has {total} watches and log "
                f"follows open (limit {MAX_WATCHERS}); try again when some have ended",
            )
        held = self.per_client[client]
        # Asked only past the usual limit: for a TCP client it reads the keys.
        limit = MAX_PER_CLIENT if held < MAX_PER_CLIENT else self.per_client_limit(client)
        if held >= limit:
            raise RemoteProtocolError(
                ErrorCode.BUSY,
                f"this client already has {self.per_client[client]} watches and log follows "
                f"open (limit {limit} per client); end one (unwatch) first",
            )

    def _release(self, client: bytes) -> None:
        left = self.per_client[client] - 1
        if left > 0:
            self.per_client[client] = left
        else:
            del self.per_client[client]

    def publish(
        self,
        session: Session,
        event_type: str,
        data: Any,
        turn: str | None = None,
        bound: int | None = None,
    ) -> None:
        """Record an event in the session's history and send it to every
        watcher of the session; forget watchers that are gone. `bound` is an
        upper bound on the size of `data` when one is known for free (the
        payload it came in), which spares measuring it."""
        body: dict[str, Any] = {"type": event_type, "data": data}
        if turn is not None:
            body["turn"] = turn
        kept = body
        size = bound if bound is not None and bound <= HISTORY_DATA_LIMIT else approx_size(data)
        if size > HISTORY_DATA_LIMIT:
            kept = {**body, "data": f"({size} bytes not kept)"}
        session.history.append((event_type, kept))
        for watcher in list(self.by_id.values()):
            if watcher.session not in (None, session.key):
                continue
            if watcher.types and event_type not in watcher.types:
                continue
            msg = Message(Kind.EVENT, body, session=session.key, re=watcher.id)
            if not self.endpoints.to_client(watcher.client, msg):
                self._end_watch(watcher.id)

    def watch(self, client: bytes, msg: Message, session: Session | None) -> None:
        """Start a watch (of `msg.session`, or of every session), replaying
        up to `replay` events of the session's history first."""
        if msg.session is not None:
            check_session_key(msg.session)
        types = msg.body.get("types") or []
        if not all(isinstance(t, str) for t in types) or len(types) > MAX_WATCH_TYPES:
            raise RemoteProtocolError(
                ErrorCode.BAD_FIELD,
                f"watch 'types' must be a list of at most {MAX_WATCH_TYPES} event type names",
            )
        self.check_room(client)
        self.by_id[msg.id] = Watcher(client, msg.id, msg.session, frozenset(types))
        self.per_client[client] += 1
        to_client = self.endpoints.to_client
        to_client(client, msg.reply(Kind.EVENT, {"type": "watching", "data": None}))
        replay = msg.body.get("replay", 0)
        if replay > 0 and session is not None:
            for _event_type, body in list(session.history)[-replay:]:
                to_client(
                    client,
                    Message(Kind.EVENT, {**body, "replayed": True}, session=session.key, re=msg.id),
                )

    def follow(self, client: bytes, follow_id: str, session: Session) -> None:
        """Send `client` the session's new log lines from now on, under the
        id of its `logs` request (`busy` if it has no room: see check_room)."""
        self.check_room(client)
        session.log_followers[follow_id] = client
        self.follows[follow_id] = session
        self.per_client[client] += 1

    def unwatch(self, client: bytes, msg: Message) -> None:
        """End a watch or a log follow that this client started."""
        watch_id = msg.body["watch"]
        watcher = self.by_id.get(watch_id)
        if watcher is not None and watcher.client == client:
            self._end_watch(watch_id)
        session = self.follows.get(watch_id)
        if session is not None and session.log_followers.get(watch_id) == client:
            self._end_follow(session, watch_id)
        self.endpoints.to_client(client, msg.reply(Kind.EVENT, {"type": "unwatched", "data": None}))

    def _end_watch(self, watch_id: str) -> None:
        watcher = self.by_id.pop(watch_id, None)
        if watcher is not None:
            self._release(watcher.client)

    def _end_follow(self, session: Session, follow_id: str) -> None:
        client = session.log_followers.pop(follow_id, None)
        self.follows.pop(follow_id, None)
        if client is not None:
            self._release(client)

    def forget_follows(self, session: Session) -> None:
        """End every log follow of a session that is going away (purged)."""
        for follow_id in list(session.log_followers):
            self._end_follow(session, follow_id)

    def log_lines(self, session: Session, lines: list[str]) -> None:
        """Send a worker's new output lines to the session's log followers,
        each with `ts`, the stamp it was stored with (logs.py); the client
        shows it, or not (`logs -t`), and ends its follow at its `until`."""
        ts = session.log.last_stamp() if session.log is not None else None
        for follow_id, client in list(session.log_followers.items()):
            for line in lines:
                msg = Message(
                    Kind.EVENT,
                    {"type": "log", "data": line, "ts": ts},
                    session=session.key,
                    re=follow_id,
                )
                if not self.endpoints.to_client(client, msg):
                    self._end_follow(session, follow_id)
                    break
