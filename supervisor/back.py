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
"""

from __future__ import annotations

import logging
import time

from hermes_sup.protocol import Kind, RemoteProtocolError, decode

from .context import Context
from .endpoints import Endpoints
from .lifecycle import Lifecycle
from .logfmt import kv
from .pool import WorkerPool
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
        try:
            msg = decode(frames[1:], session.token, self.endpoints.limits)
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
            if len(pool.spares) < self.ctx.settings.spare_workers:
                pool.fill_spares()  # after a turn, not on a new session's way to its reply
