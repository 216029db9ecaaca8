"""Sends remembered for resends: a `send` whose id was already taken is the
same turn, never a second run, and is answered from here.

Only the turn's own client may resend it: a resend signed with another key
(the local key, the remote one, another CURVE key) is refused. One from
another connection with the same key is a client that reconnected after
giving up, or another client that read the id from a watch; it is refused
while the turn's connection is still there. To tell, the turn's connection
is sent a `resend_refused` notice a moment later (a connection just closed
takes that long to be gone): delivered, the resend is refused;
undeliverable, the turn moves to the resender.

Final answers are kept for resends within a byte budget: a large one is
not kept (a resend of it gets `too_large`), and the oldest kept ones give
way to new ones beyond the budget. After a restart, or on another node,
the turn journal answers instead (turns.py, journal.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass

from hermes_sup.local.logfmt import kv
from hermes_sup.protocol import ErrorCode, Kind, Message, RemoteProtocolError

from .endpoints import Endpoints
from .session import Turn

log = logging.getLogger("hermes_sup.supervisor")

# Sends remembered so that a client resending a `send` with the same id after
# a timeout gets the same turn, never a second run of it; and of their final
# answers, those up to KEEP_ANSWER_LIMIT bytes, DEDUP_BYTES of them in all
# (newest first): every final answer kept for 10,000 ids held 2 MB per 2 MB
# reply for good.
DEDUP_ENTRIES = 10_000
DEDUP_BYTES = 4 * 1024 * 1024
KEEP_ANSWER_LIMIT = 64 * 1024
# How long a resend from another connection waits before the turn's own
# connection is looked for: a socket its client has just closed is still
# listed by zmq for a moment (about a millisecond here).
RESEND_SETTLE = 0.2


def signer_of(client: bytes) -> bytes:
    """Who signed a client's requests: the front socket it came in on (the
    local key, or the remote clients' key)."""
    return client[:1]


@dataclass
class SentTurn:
    """What the supervisor remembers of a `send`, for resends with the same id."""

    session: str
    turn: Turn | None
    client: bytes  # the connection its answers go to
    final: Message | None = None
    # Bytes of its final answer once it has one, kept in `final` or not.
    size: int = 0


class SentTurns:
    """The sends remembered, by id, and the final answers kept for them."""

    def __init__(self, endpoints: Endpoints) -> None:
        self.endpoints = endpoints
        self.sent: OrderedDict[str, SentTurn] = OrderedDict()
        # The sends whose final answer is kept, oldest first, and its size.
        self.kept: OrderedDict[str, int] = OrderedDict()
        self.kept_bytes = 0

    def __contains__(self, msg_id: object) -> bool:
        return msg_id in self.sent

    def get(self, msg_id: str) -> SentTurn | None:
        """What is remembered of the send `msg_id`, if anything."""
        return self.sent.get(msg_id)

    def remember(self, msg_id: str, record: SentTurn) -> None:
        """Remember a new send (the oldest beyond DEDUP_ENTRIES go)."""
        self.sent[msg_id] = record
        while len(self.sent) > DEDUP_ENTRIES:
            old_id, _ = self.sent.popitem(last=False)
            size = self.kept.pop(old_id, None)
            if size is not None:
                self.kept_bytes -= size

    def keep_final(self, msg_id: str, record: SentTurn, final: Message, size: int) -> None:
        """Keep a final answer for resends, within the byte budget."""
        record.turn = None
        record.size = size
        if size > KEEP_ANSWER_LIMIT:
            return  # a resend gets `too_large`
        record.final = final
        self.kept[msg_id] = size
        self.kept_bytes += size
        while self.kept_bytes > DEDUP_BYTES:
            old_id, old_size = self.kept.popitem(last=False)
            self.kept_bytes -= old_size
            old = self.sent.get(old_id)
            if old is not None:
                old.final = None  # a resend gets `expired`

    def forget(self, turn: Turn) -> None:
        """Forget a turn that never ran (refused): its id is unspent, and a
        retry with it is a first run."""
        record = self.sent.get(turn.id)
        if record is not None and record.turn is turn:
            del self.sent[turn.id]

    # ------------------------------------------------------------- resends

    def resend(self, client: bytes, msg: Message) -> None:
        """A `send` with an id we already took: the same turn, never a second
        run, and only for the client that sent it (RemoteProtocolError
        `replayed` otherwise)."""
        record = self.sent[msg.id]
        if msg.session != record.session:
            raise RemoteProtocolError(
                ErrorCode.REPLAYED,
                f"message id {msg.id!r} was already used by a send to another session; "
                "a resend must repeat the send it resends (a new turn needs a new id)",
                msg_id=msg.id,
            )
        if signer_of(client) != signer_of(record.client):
            raise RemoteProtocolError(
                ErrorCode.REPLAYED,
                f"message id {msg.id!r} is a send signed with another key; only the client "
                "that sent it may resend it (a new turn needs a new id)",
                msg_id=msg.id,
            )
        if client == record.client:
            self._answer_resend(client, msg, record)
        else:
            asyncio.get_running_loop().call_later(
                RESEND_SETTLE, self._resend_elsewhere, client, msg
            )

    def _resend_elsewhere(self, client: bytes, msg: Message) -> None:
        """A resend from another connection than the turn's, with the same
        key: the turn moves to it only if the turn's connection is gone."""
        record = self.sent.get(msg.id)
        if record is None:
            self.endpoints.error(
                client,
                ErrorCode.EXPIRED,
                f"send {msg.id!r} is no longer remembered (the supervisor remembers the last "
                f"{DEDUP_ENTRIES} sends); it was not run again",
                msg.id,
                msg.session,
            )
            return
        if record.client != client:
            # The probe is the notice itself: delivered means still connected.
            notice = Message(
                Kind.EVENT,
                {"type": "status", "data": {"state": "resend_refused"}},
                session=record.session,
                re=msg.id,
            )
            if self.endpoints.to_client(record.client, notice):
                log.warning(kv("resend_refused", session=record.session, turn=msg.id))
                self.endpoints.error(
                    client,
                    ErrorCode.REPLAYED,
                    f"message id {msg.id!r} is a send of another client connection, which is "
                    "still connected; only the client that sent it may resend it (a new turn "
                    "needs a new id)",
                    msg.id,
                    msg.session,
                )
                return
            record.client = client
            if record.turn is not None:
                record.turn.client = client  # the rest of the turn goes to the resender
        self._answer_resend(client, msg, record)

    def _answer_resend(self, client: bytes, msg: Message, record: SentTurn) -> None:
        """Answer a resend the turn's own client made."""
        if record.final is not None:
            self.endpoints.to_client(client, record.final)
        elif record.turn is not None:
            self.endpoints.to_client(
                client,
                msg.reply(Kind.EVENT, {"type": "status", "data": {"state": "duplicate"}}),
            )
        elif record.size > KEEP_ANSWER_LIMIT:
            self.endpoints.error(
                client,
                ErrorCode.TOO_LARGE,
                f"send {msg.id!r} has ended and its answer went to this client; at "
                f"{record.size} bytes it was too large to keep for resends (limit "
                f"{KEEP_ANSWER_LIMIT}); the turn was not run again",
                msg.id,
                msg.session,
            )
        else:
            self.endpoints.error(
                client,
                ErrorCode.EXPIRED,
                f"send {msg.id!r} has ended and its answer went to this client; it is no "
                f"longer kept for resends (the supervisor keeps the newest {DEDUP_BYTES} bytes "
                "of answers); the turn was not run again",
                msg.id,
                msg.session,
            )
