"""Orphaned turns: a running turn whose client went away and did not come
back within the grace its `send` asked for is cancelled.

Theory of operation
-------------------
A front end that sends a turn for someone else (the HTTP endpoint, for a
browser's stream) may die, or lose the person, mid-turn. Left alone, the
turn runs to its end unseen: an agent acting for nobody. A `send` may
therefore carry `orphan_grace` (seconds): once the supervisor finds the
turn's connection gone, the turn gets that long for its client to come
back, by resending it (the same turn id, from a new connection: the turn
moves to it, turns.py); if none does, the turn is cancelled, as `cancel`
would (its end, usually a `cancelled` reply, is recorded in the session's
turn journal, so a later retry learns it).

A connection is found gone when a message to it cannot be delivered: one
of the turn's own events, or, for a turn that streams nothing, a `status`
event `{state: "running", pid}` sent every half grace (at most every
PROBE_EVERY seconds) to turns that asked for a grace. Nothing is sent, and
no timer runs, for a turn without one.
"""

from __future__ import annotations

import asyncio
import logging
import time

from hermes_sup.local.logfmt import kv
from hermes_sup.protocol import Kind, Message

from .endpoints import Endpoints
from .session import Session, Turn
from .states import State

log = logging.getLogger("hermes_sup.supervisor")

PROBE_EVERY = 5.0  # at most this long between probes of a quiet turn's client
MAX_GRACE = 3600.0


class Orphans:
    """The running turns that asked for an orphan grace."""

    def __init__(self, endpoints: Endpoints) -> None:
        self.endpoints = endpoints

    def begin(self, session: Session, turn: Turn) -> None:
        """The turn runs now: probe its client while it does."""
        if turn.orphan_grace is not None:
            self._schedule(session, turn)

    def undelivered(self, session: Session, turn: Turn) -> None:
        """A message to the turn's client could not be delivered: it is gone."""
        if turn.orphan_grace is None or turn.orphaned_at is not None:
            return
        turn.orphaned_at = time.monotonic()
        gone = turn.client
        log.info(kv("turn_client_gone", session=session.key, turn=turn.id, grace=turn.orphan_grace))
        asyncio.get_running_loop().call_later(turn.orphan_grace, self._expire, session, turn, gone)

    def _schedule(self, session: Session, turn: Turn) -> None:
        assert turn.orphan_grace is not None
        every = min(max(turn.orphan_grace / 2, 0.1), PROBE_EVERY)
        asyncio.get_running_loop().call_later(every, self._probe, session, turn)

    def _probe(self, session: Session, turn: Turn) -> None:
        if session.current is not turn or turn.orphaned_at is not None:
            return  # ended, or already found gone
        alive = self.endpoints.to_client(
            turn.client,
            Message(
                Kind.EVENT,
                {"type": "status", "data": {"state": "running", "pid": session.pid}},
                session=session.key,
                re=turn.id,
            ),
        )
        if alive:
            self._schedule(session, turn)
        else:
            self.undelivered(session, turn)

    def _expire(self, session: Session, turn: Turn, gone: bytes) -> None:
        """The grace is over: cancel the turn unless a client took it back."""
        if session.current is not turn or turn.client != gone or turn.abandoned:
            if session.current is turn:
                turn.orphaned_at = None  # taken back: probe the new client
                self._schedule(session, turn)
            return
        log.warning(
            kv(
                "turn_orphaned",
                session=session.key,
                turn=turn.id,
                grace=turn.orphan_grace,
                outcome="cancelled",
            )
        )
        if session.state is State.STARTING:
            session.cancel_on_hello = turn.id
        else:
            self.endpoints.to_worker(
                session, Message(Kind.CANCEL, {"turn": turn.id}, session=session.key)
            )
