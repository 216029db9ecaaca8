"""Watchers: clients that asked to see what happens in a session (or in all
of them), and the history a new watcher can replay.

Every event of a session is recorded in its history (large data is noted by
size, not kept) and sent to each watcher of it; a watcher that is gone or
too slow is forgotten. Log followers (`logs --follow`) are kept per session
and fed the worker's output lines as they are logged.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgpack

from hermes_sup.protocol import ErrorCode, Kind, Message, RemoteProtocolError, check_session_key

from .endpoints import Endpoints
from .session import Session

MAX_WATCHERS = 1024
# Event data larger than this is not kept in a session's replay history.
HISTORY_DATA_LIMIT = 8192


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


class Watchers:
    """Every watcher, by the id of its `watch` request."""

    def __init__(self, endpoints: Endpoints) -> None:
        self.endpoints = endpoints
        self.by_id: dict[str, Watcher] = {}

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
            msg = Message(Kind.EVENT, body, session=session.key, re=watcher.id)
            if not self.endpoints.to_client(watcher.client, msg):
                self.by_id.pop(watcher.id, None)

    def watch(self, client: bytes, msg: Message, session: Session | None) -> None:
        """Start a watch (of `msg.session`, or of every session), replaying
        up to `replay` events of the session's history first."""
        if msg.session is not None:
            check_session_key(msg.session)
        if len(self.by_id) >= MAX_WATCHERS:
            raise RemoteProtocolError(ErrorCode.BUSY, f"too many watchers (limit {MAX_WATCHERS})")
        self.by_id[msg.id] = Watcher(client, msg.id, msg.session)
        to_client = self.endpoints.to_client
        to_client(client, msg.reply(Kind.EVENT, {"type": "watching", "data": None}))
        replay = msg.body.get("replay", 0)
        if replay > 0 and session is not None:
            for _event_type, body in list(session.history)[-replay:]:
                to_client(
                    client,
                    Message(Kind.EVENT, {**body, "replayed": True}, session=session.key, re=msg.id),
                )

    def unwatch(self, client: bytes, msg: Message, sessions: Iterable[Session]) -> None:
        """End a watch or a log follow that this client started."""
        watch_id = msg.body["watch"]
        watcher = self.by_id.get(watch_id)
        if watcher is not None and watcher.client == client:
            del self.by_id[watch_id]
        for session in sessions:
            if session.log_followers.get(watch_id) == client:
                del session.log_followers[watch_id]
        self.endpoints.to_client(client, msg.reply(Kind.EVENT, {"type": "unwatched", "data": None}))

    def log_lines(self, session: Session, lines: list[str]) -> None:
        """Send a worker's new output lines to the session's log followers."""
        for watch_id, client in list(session.log_followers.items()):
            for line in lines:
                msg = Message(
                    Kind.EVENT, {"type": "log", "data": line}, session=session.key, re=watch_id
                )
                if not self.endpoints.to_client(client, msg):
                    session.log_followers.pop(watch_id, None)
                    break
