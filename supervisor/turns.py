"""Turns: the messages of a session, from its queue to their one answer.

Theory of operation
-------------------
A `send` becomes a `Turn` in its session's queue. When the session's worker
is idle, `pump` takes the next turn and `begin` hands it to the worker, then
tells the client it runs (`running`, with the worker's pid) and records it
in the session's history. The worker's events for the turn go to its client
as they come; its reply (or error) is the turn's final answer, given once by
`finish`, which also remembers it for a client that resends the same id.

Every turn ends in exactly one final answer, whatever happens to its
worker: a timeout abandons it (the client gets `turn_timeout`, the worker a
cancel, and a worker that ignores the cancel is terminated); a worker that
dies fails it; a stopped session fails what was queued. A turn's answers go
to the client that sent it, or to the one that last resent its id.

`queued_total` (every session's waiting turns) changes only here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from hermes_sup.protocol import ErrorCode, Kind, Message, error_message

from .context import Context
from .endpoints import Endpoints
from .logfmt import kv
from .session import Session, Turn
from .states import Event, State
from .table import SessionTable
from .watchers import Watchers

log = logging.getLogger("hermes_sup.supervisor")

# Answers kept so that a client resending a `send` with the same id after a
# timeout gets the same turn, never a second run of it.
DEDUP_ENTRIES = 10_000


@dataclass
class SentTurn:
    """What the supervisor remembers of a `send`, for resends with the same id."""

    session: str
    turn: Turn | None
    final: Message | None = None


class Turns:
    """Every session's queue of turns, and the answers given."""

    def __init__(
        self, ctx: Context, table: SessionTable, endpoints: Endpoints, watchers: Watchers
    ) -> None:
        self.ctx = ctx
        self.table = table
        self.endpoints = endpoints
        self.watchers = watchers
        self.sent: OrderedDict[str, SentTurn] = OrderedDict()
        self.queued_total = 0
        # End a worker that will not stop a cancelled turn (set by the
        # supervisor to the lifecycle's `terminate`, which needs Turns first).
        self.terminate: Callable[[Session, str], None] = lambda session, reason: None

    # ------------------------------------------------------------- resends

    def resend(self, client: bytes, msg: Message) -> None:
        """A `send` with an id we already took: the same turn, never a second run."""
        record = self.sent[msg.id]
        if record.final is not None:
            self.endpoints.to_client(client, record.final)
            return
        if record.turn is not None:
            record.turn.client = client  # the rest of the turn goes to the resender
        self.endpoints.to_client(
            client,
            msg.reply(Kind.EVENT, {"type": "status", "data": {"state": "duplicate"}}),
        )

    def remember(self, msg_id: str, record: SentTurn) -> None:
        self.sent[msg_id] = record
        while len(self.sent) > DEDUP_ENTRIES:
            self.sent.popitem(last=False)

    # -------------------------------------------------------------- queues

    def enqueue(self, session: Session, turn: Turn) -> None:
        session.queue.append(turn)
        self.queued_total += 1

    def requeue(self, session: Session, turn: Turn) -> None:
        """Put a turn that did not run back at the head of its queue."""
        session.queue.appendleft(turn)
        self.queued_total += 1

    def hand_over(self, session: Session) -> Turn:
        """Take the first queued turn as the one a starting worker is given
        in its spawn request (it starts it right after its hello)."""
        turn = session.queue.popleft()
        self.queued_total -= 1
        session.current = turn
        return turn

    def remove_queued(self, session: Session, turn_id: str) -> Turn | None:
        """Take a waiting turn out of its queue (a cancel before it ran)."""
        for turn in list(session.queue):
            if turn.id == turn_id:
                session.queue.remove(turn)
                self.queued_total -= 1
                return turn
        return None

    def fail_queue(self, session: Session, code: ErrorCode, text: str) -> None:
        """End every waiting turn of a session with one error."""
        while session.queue:
            turn = session.queue.popleft()
            self.queued_total -= 1
            self.finish(
                turn, session, error_message(code.value, text, re=turn.id, session=session.key)
            )

    # ---------------------------------------------------------- run, answer

    def pump(self, session: Session) -> None:
        """Hand the next queued turn to an idle worker."""
        if session.state is not State.IDLE or session.current is not None or not session.queue:
            return
        turn = session.queue.popleft()
        self.queued_total -= 1
        session.current = turn
        self.begin(session, turn, handed=False)

    def begin(self, session: Session, turn: Turn, handed: bool) -> None:
        """The turn runs now: tell its client, and its worker unless the
        worker already has it (`handed`: it came in the spawn request)."""
        turn.started_at = time.monotonic()
        # An idle worker may have been silent longer than a busy one may be:
        # the busy clock starts with the turn.
        session.last_heartbeat = max(session.last_heartbeat, turn.started_at)
        metrics = self.ctx.metrics
        if metrics is not None:
            metrics.routing_seconds.observe(turn.started_at - turn.queued_at)
        self.table.transition(session, Event.TURN)
        # The worker first: its turn is the critical path; the client's
        # acknowledgement and the history are made while the worker runs it.
        if not handed:
            self.endpoints.to_worker(
                session, Message(Kind.TURN, {"text": turn.text}, session=session.key, id=turn.id)
            )
        elif session.cancel_on_hello == turn.id:
            self.endpoints.to_worker(
                session, Message(Kind.CANCEL, {"turn": turn.id}, session=session.key)
            )
        session.cancel_on_hello = None
        self.endpoints.to_client(
            turn.client,
            Message(
                Kind.EVENT,
                {"type": "status", "data": {"state": "running", "pid": session.pid}},
                session=session.key,
                re=turn.id,
            ),
        )
        self.watchers.publish(
            session, "turn", {"text": turn.text}, turn=turn.id, bound=16 + 4 * len(turn.text)
        )
        own = self.ctx.settings_for(session)
        if own.turn_timeout is not None:
            asyncio.get_running_loop().call_later(
                own.turn_timeout, self._on_turn_timeout, session, turn
            )

    def on_answer(self, session: Session, msg: Message, payload: bytes) -> bool:
        """An event or the final answer of the session's running turn, from
        its worker (already checked to be this session's). True if the turn
        ended."""
        turn = session.current
        if turn is None or msg.re != turn.id:
            log.warning(kv("stray_worker_message", session=session.key, kind=msg.kind.value))
            return False
        # The worker's envelope names this session and this turn, so its
        # payload goes to the client as it is, re-signed.
        if msg.kind is Kind.EVENT:
            if not turn.abandoned:
                self.endpoints.to_client(turn.client, msg, payload)
            self.watchers.publish(
                session, msg.body["type"], msg.body.get("data"), turn=turn.id, bound=len(payload)
            )
            return False
        if msg.kind not in (Kind.REPLY, Kind.ERROR):
            log.warning(kv("unexpected_worker_message", session=session.key, kind=msg.kind.value))
            return False
        if turn.abandoned:
            pass  # its client already had a turn_timeout error
        elif session.state is State.STOPPING:
            # The worker was told to stop and cut this turn short: say so.
            self.finish(
                turn,
                session,
                error_message(
                    session.kill_code or ErrorCode.SESSION_KILLED.value,
                    f"the session was stopped during this turn: {session.kill_reason}",
                    re=turn.id,
                    session=session.key,
                ),
            )
        else:
            self.finish(turn, session, msg, payload)
        session.current = None
        session.turns += 1
        self.table.transition(session, Event.DONE)
        self.pump(session)
        return True

    def finish(
        self, turn: Turn, session: Session, final: Message, payload: bytes | None = None
    ) -> None:
        """Give a turn its one final answer (and remember it for resends)."""
        record = self.sent.get(turn.id)
        if record is not None:
            record.final = final
            record.turn = None
        self.endpoints.to_client(turn.client, final, payload)
        self.watchers.publish(
            session,
            "reply" if final.kind is Kind.REPLY else "error",
            final.body,
            turn=turn.id,
            bound=None if payload is None else len(payload),
        )
        metrics = self.ctx.metrics
        if metrics is not None:
            outcome = "reply" if final.kind is Kind.REPLY else str(final.body.get("code"))
            metrics.turns.labels(outcome).inc()
            if turn.started_at is not None:
                metrics.turn_seconds.observe(time.monotonic() - turn.started_at)

    def cancelled_unstarted(self, session: Session, turn: Turn) -> None:
        """End a turn that was cancelled before any worker ran it."""
        self.finish(
            turn,
            session,
            error_message(
                ErrorCode.TURN_FAILED.value,
                "cancelled before it started",
                re=turn.id,
                session=session.key,
            ),
        )

    def cancel(self, session: Session, target: str | None) -> str | None:
        """Cancel the running turn (if `target` is None or names it) or a
        queued one; the id of the turn cancelled, or None."""
        if session.current is not None and target in (None, session.current.id):
            cancelled = session.current.id
            if session.state is State.STARTING:
                # Handed over in the spawn request; the worker cannot hear
                # us before its hello, so the cancel goes right after it.
                session.cancel_on_hello = cancelled
            else:
                self.endpoints.to_worker(
                    session, Message(Kind.CANCEL, {"turn": cancelled}, session=session.key)
                )
            return cancelled
        if target is not None:
            turn = self.remove_queued(session, target)
            if turn is not None:
                self.cancelled_unstarted(session, turn)
                return turn.id
        return None

    # ------------------------------------------------------------ timeouts

    def _on_turn_timeout(self, session: Session, turn: Turn) -> None:
        if session.current is not turn or turn.abandoned:
            return
        own = self.ctx.settings_for(session)
        limit = own.turn_timeout
        turn.abandoned = True
        self.finish(
            turn,
            session,
            error_message(
                ErrorCode.TURN_TIMEOUT.value,
                f"the turn ran over the {limit:g}s turn timeout and was cancelled",
                re=turn.id,
                session=session.key,
            ),
        )
        self.endpoints.to_worker(
            session, Message(Kind.CANCEL, {"turn": turn.id}, session=session.key)
        )
        generation = session.generation
        # A runtime that ignores the cancel loses its worker.
        asyncio.get_running_loop().call_later(
            own.cancel_grace, self._check_cancelled, session, turn, generation
        )

    def _check_cancelled(self, session: Session, turn: Turn, generation: int) -> None:
        if session.current is turn and session.generation == generation:
            self.terminate(
                session,
                f"its turn ran over the {self.ctx.settings_for(session).turn_timeout:g}s "
                "turn timeout "
                "and did not stop when cancelled",
            )
