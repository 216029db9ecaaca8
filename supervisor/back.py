"""The back: what workers say to the supervisor.

A worker's frames are trusted only once they check out: the routing id must
be one the supervisor gave, the signature must be by that worker's own token
(handed to it through the zygote, never over a socket), and the envelope
must name the worker's own session. Anything else is logged and dropped; a
worker can never speak for another session.

A heartbeat is life, not activity. A hello makes the session ready (the
lifecycle's); everything else belongs to the running turn (the turns').
A turn's end is also when the spare pool is refilled: after a reply, not on
a new session's way to its first one.

A worker's frames are verified and unpacked once. A turn's events are most
of what workers say, and each one is then checked as `message_of` checks
it, by a shorter path (`event_of`) that accepts only well-formed events of
the worker's own session and leaves everything else to `message_of`, whose
errors say what is wrong.

A worker's message over the frame limit (`max_frame_size`) is not dropped in
silence, which would leave its turn waiting until the worker is taken for
hung. Once its signature checks out, its kind decides: an event becomes a
`too_large` event naming its type and size; a reply or error ends the turn
with a `too_large` error. Workers are told the limit and do the same
themselves, so this is for a worker that does not know it.
"""

from __future__ import annotations

import hmac
import logging
import math
import time
from typing import Any

import msgpack

from hermes_sup.local.logfmt import kv
from hermes_sup.protocol import (
    ErrorCode,
    Kind,
    Message,
    RemoteProtocolError,
    encode,
    error_message,
    sign,
)
from hermes_sup.protocol.messages import MAX_ID_LENGTH
from hermes_sup.protocol.wire import message_of, unpack, verify

from .context import Context
from .endpoints import Endpoints
from .lifecycle import Lifecycle
from .pool import WorkerPool
from .session import Session
from .turns import Turns

log = logging.getLogger("hermes_sup.supervisor")


class Back:
    """Frames from workers, checked and dispatched."""

    def __init__(
        self,
        ctx: Context,
        endpoints: Endpoints,
        pool: WorkerPool,
        turns: Turns,
        lifecycle: Lifecycle,
    ) -> None:
        self.ctx = ctx
        self.endpoints = endpoints
        self.pool = pool
        self.turns = turns
        self.lifecycle = lifecycle

    def on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 4:
            log.warning(kv("bad_worker_frames", count=len(frames)))
            return
        pool = self.pool
        session = pool.by_worker_id.get(frames[0])
        if session is None and frames[0] in pool.spares.by_id:
            pool.on_spare(pool.spares.by_id[frames[0]], frames[1:])
            return
        if session is None or session.token is None:
            log.debug(kv("unknown_worker", id=frames[0].hex()[:16]))
            return
        limits = self.endpoints.limits
        try:
            envelope = unpack(verify(frames[1:], session.token, limits))
        except RemoteProtocolError as exc:
            if exc.code is not ErrorCode.TOO_LARGE:
                log.warning(kv("bad_worker_message", session=session.key, error=exc))
            elif self._too_large(session, frames[2], frames[3]):
                self._turn_ended()
            return
        event = event_of(envelope, session.key)
        if event is not None:
            session.last_heartbeat = time.monotonic()
            session.touch()
            self.turns.on_answer(session, event, frames[3])  # an event never ends a turn
            return
        try:
            msg = message_of(envelope)
        except RemoteProtocolError as exc:
            log.warning(kv("bad_worker_message", session=session.key, error=exc))
            return
        if msg.session != session.key:
            log.warning(kv("worker_wrong_session", session=session.key, claimed=msg.session))
            return
        session.last_heartbeat = time.monotonic()
        if msg.kind is Kind.HEARTBEAT:
            return  # a heartbeat is life, not activity: it does not reset the idle clock
        session.touch()
        if msg.kind is Kind.HELLO:
            self.lifecycle.on_hello(session, msg)
            return
        if self.turns.on_answer(session, msg, frames[3]):
            self._turn_ended()

    def _turn_ended(self) -> None:
        # Spares are made after a turn, not on a new session's way to its reply.
        if len(self.pool.spares) < self.ctx.settings.spare_workers:
            self.pool.fill_spares()
        self.lifecycle.table.store.refill_spare_dirs()

    def _too_large(self, session: Session, signature: bytes, payload: bytes) -> bool:
        """A message of `session`'s worker over the frame limit: said in a
        few words to the turn's client instead (see the module docstring).
        True if that ended the turn."""
        token = session.token
        assert token is not None
        if not hmac.compare_digest(signature, sign(token, payload)):
            log.warning(kv("bad_worker_message", session=session.key, error="bad signature"))
            return False
        envelope = _envelope(payload)
        kind, re = envelope.get("kind"), envelope.get("re")
        limit = self.endpoints.limits.max_frame_size
        log.warning(
            kv(
                "worker_message_too_large",
                session=session.key,
                kind=kind,
                bytes=len(payload),
                limit=limit,
            )
        )
        turn = session.current
        if turn is None or re != turn.id or envelope.get("session") != session.key:
            return False
        session.last_heartbeat = time.monotonic()
        if kind == Kind.EVENT.value:
            body = envelope.get("body")
            event = body.get("type") if isinstance(body, dict) else None
            stand_in = Message(
                Kind.EVENT,
                {
                    "type": "too_large",
                    "data": {"event": str(event), "bytes": len(payload), "limit": limit},
                },
                session=session.key,
                re=turn.id,
            )
        elif kind in (Kind.REPLY.value, Kind.ERROR.value):
            stand_in = error_message(
                ErrorCode.TOO_LARGE.value,
                f"the turn's {kind} is {len(payload)} bytes, over the {limit}-byte frame "
                "limit (max_frame_size); it was not delivered",
                re=turn.id,
                session=session.key,
            )
        else:
            return False
        # The stand-in goes on as the worker's own would: its payload is
        # re-signed for the client (any key will do to encode it here).
        return self.turns.on_answer(session, stand_in, encode(stand_in, token)[2])


def event_of(envelope: dict[Any, Any], key: str) -> Message | None:
    """A worker's `event` for session `key`, from its verified and unpacked
    envelope, checked as `message_of` would check it, in fewer steps; None
    if it is anything else, or not quite well formed: `message_of` then says
    what is wrong. Accepts a subset of what `message_of` accepts
    (tests/test_hostile_transport.py)."""
    if envelope.get("kind") != "event" or "ttl" in envelope:
        return None
    msg_id, re, body = envelope.get("id"), envelope.get("re"), envelope.get("body")
    ts: Any = envelope.get("ts")
    if (
        envelope.get("session") != key
        or type(msg_id) is not str
        or not 0 < len(msg_id) <= MAX_ID_LENGTH
        or type(ts) not in (int, float)
        or not math.isfinite(ts)
        or type(re) is not str
        or len(re) > MAX_ID_LENGTH
        or type(body) is not dict
        or type(body.get("type")) is not str
        or ("turn" in body and type(body["turn"]) is not str)
        or ("replayed" in body and type(body["replayed"]) is not bool)
    ):
        return None
    return Message(Kind.EVENT, body, session=key, re=re, id=msg_id, ts=float(ts))


def _envelope(payload: bytes) -> dict[str, Any]:
    """The envelope of a signed payload, or {} if it is not one."""
    try:
        envelope = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception:  # msgpack raises many types for bad input
        return {}
    return envelope if isinstance(envelope, dict) else {}
