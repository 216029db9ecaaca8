"""Turns: the messages of a session, from its queue to their one answer.

Theory of operation
-------------------
A `send` becomes a `Turn` in its session's queue. When the session's worker
is idle, `pump` takes the next turn and `begin` hands it to the worker, then
tells the client it runs (`running`, with the worker's pid, unless its
`send` said `ack: false`) and records it in the session's history. The worker's events for the turn go to its client
as they come; its reply (or error) is the turn's final answer, given once by
`finish`, which also remembers it for a client that resends the same id.

Every turn ends in exactly one final answer, whatever happens to its
worker: a timeout abandons it (the client gets `turn_timeout`, the worker a
cancel, and a worker that ignores the cancel is terminated); a worker that
dies fails it; a stopped session fails what was queued. A turn's answers go
to the client that sent it.

A resend (a `send` whose id was already taken) is the same turn, never a
second run, and only its own client may make it; the sends are remembered,
and their final answers kept within a byte budget, by `sends`
(resends.py).

What survives the supervisor is the session's turn journal (journal.py):
each turn's start is written before it runs and its final answer when it
ends, so a repeat of its id after a restart, or on another node, is
answered from there and never runs it again.

`queued_total` (every session's waiting turns) changes only here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from hermes_sup.local.logfmt import kv
from hermes_sup.protocol import ErrorCode, Kind, Message, error_message

from .context import Context
from .disk import DiskReserve
from .endpoints import Endpoints
from .journal import TurnJournal, turn_state
from .leases import holder_of
from .orphans import Orphans
from .resends import SentTurns
from .session import Session, Turn, session_path
from .states import Event, State
from .table import SessionTable
from .watchers import Watchers, approx_size

log = logging.getLogger("hermes_sup.supervisor")


def disk_full_message(turn_id: str, session: str, reason: str) -> Message:
    """`disk_full` for a turn that was not run because its start could not
    be recorded."""
    return error_message(
        ErrorCode.DISK_FULL.value,
        f"turn {turn_id!r} was not run: its start could not be recorded in the session's "
        f"turn journal ({reason}); nothing of it ran, and sending it again (same id) once "
        "the data disk has room runs it once",
        re=turn_id,
        session=session,
    )


APPROVAL_EVENTS = frozenset({"approval", "approval_timeout"})
# A worker's event outside a turn (PROTOCOL.md, "Notices"), and its limit.
NOTICE = "notice"
MAX_NOTICE_BYTES = 64 * 1024


def track_approval(session: Session, event_type: str, data: Any) -> None:
    """Keep the running turn's waiting approval requests, by the id its
    worker gave each (see Session.approvals): a request adds one, a
    timeout removes it (the oldest, when it names none)."""
    approval = data.get("id") if isinstance(data, dict) else None
    approval = approval if isinstance(approval, str) else ""
    if event_type == "approval":
        session.approvals.append(approval)
    elif approval in session.approvals:
        session.approvals.remove(approval)
    elif session.approvals and not approval:
        session.approvals.pop(0)


class Turns:
    """Every session's queue of turns, and the answers given."""

    def __init__(
        self,
        ctx: Context,
        table: SessionTable,
        endpoints: Endpoints,
        watchers: Watchers,
        terminate: Callable[[Session, str], None],
    ) -> None:
        self.ctx = ctx
        self.table = table
        self.endpoints = endpoints
        self.watchers = watchers
        # Sends remembered, and their final answers kept, for resends.
        self.sends = SentTurns(endpoints)
        self.queued_total = 0
        # Turns whose client asked for no `running` acknowledgement (a `send`
        # with `ack: false`), by id, until they begin or end.
        self.unacked: set[str] = set()
        # End a worker that will not stop a cancelled turn: the lifecycle's.
        self.terminate = terminate
        # Running turns whose client asked for an orphan grace (orphans.py).
        self.orphans = Orphans(endpoints)
        # What became of each turn, in its session's directory (journal.py).
        self.journal = TurnJournal(
            ctx.node, table.ownership.still_ours, shared=table.ownership.shared
        )
        # Free space against the supervisor's reserve, before each new turn.
        self.reserve = DiskReserve(
            lambda: (ctx.settings.data_dir, ctx.settings.state_dir),
            lambda: ctx.settings.disk_reserve_mb or 0,
        )
        # How each session's disk bound is enforced: set by the sampler.
        self.disk_limit: Callable[[], dict[str, Any]] = lambda: {"enforced_by": None}
        # Lets an id be used again (the front's replay guard sets it): for
        # a turn refused before it ran.
        self.forget_id: Callable[[str], None] = lambda turn_id: None

    def disk_status(self) -> dict[str, Any]:
        """`status`'s disk section: the reserve and, once the disk sampler
        is set (health.py), how the per-session bound is enforced."""
        out: dict[str, Any] = {"reserve": self.reserve.describe()}
        out["limit"] = self.disk_limit()
        return out

    def status(self, key: str, turn_id: str) -> dict[str, Any]:
        """What became of a turn (a `turn_state` body): from memory if it
        was sent here, else from the session's journal on disk, which may
        be another node's (a turn started there and not ended is `running`
        while that node holds the lease, `interrupted` once no one does)."""
        node = self.ctx.node
        record = self.sends.get(turn_id)
        if record is not None and record.session == key:
            session = self.table.get(key)
            if record.turn is not None:
                running = session is not None and session.current is record.turn
                return {"turn": turn_id, "state": "running" if running else "queued", "node": node}
            final = record.final
            outcome: dict[str, Any] = (
                {"kind": final.kind.value, "body": final.body}
                if final is not None
                else {"kind": None, "size": record.size}
            )
            return {"turn": turn_id, "state": "ended", "node": node, "outcome": outcome}
        session = self.table.get(key)
        directory = (
            session.dir if session is not None else session_path(self.ctx.settings.data_dir, key)
        )
        if session is not None and session.lease is not None:
            holder: str | None = node
        else:
            holder = holder_of(directory)
        state, entry, since = turn_state(directory, turn_id, holder)
        body: dict[str, Any] = {"turn": turn_id, "state": state, "node": None, "since": since}
        if entry is not None:
            body.update(node=entry.node, started=entry.started, ended=entry.ended)
            if state == "running":
                body["node"] = holder
            if entry.ended is not None:
                body["outcome"] = (
                    {"kind": entry.kind, "body": entry.body}
                    if entry.body is not None
                    else {"kind": entry.kind, "size": entry.size}
                )
        return body

    # -------------------------------------------------------------- queues

    def note_send(self, msg: Message) -> None:
        """What a `send` asks of its turn besides running it: `ack: false`
        is no `running` event when it starts (PROTOCOL.md). A client that
        needs no proof of life between its send and the turn's first event
        saves a message and a signature a turn; by default (`ack` absent or
        true) every turn gets one. Called for each new `send` as it is
        enqueued."""
        if msg.body.get("ack") is False:
            self.unacked.add(msg.id)

    def enqueue(self, session: Session, turn: Turn) -> None:
        session.queue.append(turn)
        self.queued_total += 1

    def requeue(self, session: Session, turn: Turn) -> None:
        """Put a turn that did not run back at the head of its queue."""
        session.queue.appendleft(turn)
        self.queued_total += 1

    def hand_over(self, session: Session) -> Turn | None:
        """Take the first queued turn as the one a starting worker is given
        in its spawn request (it starts it right after its hello). None if
        its start could not be journaled: it stays queued, and is refused
        (`disk_full`) when the worker is ready, unless there is room by then."""
        turn = session.queue[0]
        if self.journal.started(session, turn.id) is not None:
            return None
        session.queue.popleft()
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

    def fail_queue(
        self, session: Session, code: ErrorCode, text: str, detail: dict[str, Any] | None = None
    ) -> None:
        """End every waiting turn of a session with one error (`detail`: its
        fields for programs, as `moved`'s holder)."""
        while session.queue:
            turn = session.queue.popleft()
            self.queued_total -= 1
            self.finish(
                turn,
                session,
                error_message(code.value, text, re=turn.id, session=session.key, detail=detail),
            )

    # ---------------------------------------------------------- run, answer

    def pump(self, session: Session) -> None:
        """Hand the next queued turn to an idle worker."""
        # A turn refused at its start leaves the worker idle: the next one.
        while session.state is State.IDLE and session.current is None and session.queue:
            turn = session.queue.popleft()
            self.queued_total -= 1
            session.current = turn
            if self.begin(session, turn, handed=False):
                return

    def begin(self, session: Session, turn: Turn, handed: bool) -> bool:
        """The turn runs now: tell its client, and its worker unless the
        worker already has it (`handed`: it came in the spawn request).
        False if it was refused instead, its start not journaled."""
        turn.started_at = time.monotonic()
        # An idle worker may have been silent longer than a busy one may be:
        # the busy clock starts with the turn.
        session.last_heartbeat = max(session.last_heartbeat, turn.started_at)
        metrics = self.ctx.metrics
        if metrics is not None:
            metrics.routing_seconds.observe(turn.started_at - turn.queued_at)
        self.table.transition(session, Event.TURN)
        # A turn writes into the session's files (its state.db): one taken
        # over meanwhile loses its worker here, and the turn is `moved`.
        self.table.ownership.fenced(session)
        if not handed:
            failed = self.journal.started(session, turn.id)  # after the fence
            if failed is not None:
                self._refuse_unjournaled(session, turn, failed)
                return False
        session.approvals.clear()  # any left were an earlier turn's
        # The worker first: its turn is the critical path; the client's
        # acknowledgement and the history are made while the worker runs it.
        if not handed:
            # Who else works on its repository, as of this turn (see
            # worktrees.py); a handed turn's was written before its fork.
            self.table.refresh_peers(session, checked=True)  # fenced above
            body: dict[str, Any] = {"text": turn.text}
            if turn.context:
                body["context"] = turn.context
            self.endpoints.to_worker(
                session, Message(Kind.TURN, body, session=session.key, id=turn.id)
            )
        elif session.cancel_on_hello == turn.id:
            self.endpoints.to_worker(
                session, Message(Kind.CANCEL, {"turn": turn.id}, session=session.key)
            )
        session.cancel_on_hello = None
        if turn.id in self.unacked:
            self.unacked.discard(turn.id)
        elif not self.endpoints.to_client(
            turn.client,
            Message(
                Kind.EVENT,
                {"type": "status", "data": {"state": "running", "pid": session.pid}},
                session=session.key,
                re=turn.id,
            ),
        ):
            self.orphans.undelivered(session, turn)
        self.orphans.begin(session, turn)
        self.watchers.publish(
            session, "turn", {"text": turn.text}, turn=turn.id, bound=16 + 4 * len(turn.text)
        )
        own = self.ctx.settings_for(session)
        if own.turn_timeout is not None:
            asyncio.get_running_loop().call_later(
                own.turn_timeout, self._on_turn_timeout, session, turn
            )
        return True

    def _refuse_unjournaled(self, session: Session, turn: Turn, error: OSError) -> None:
        """A turn whose start the journal could not record is not run: run
        unrecorded, a resend after a restart would run it again. Its client
        gets `disk_full`, and its id is forgotten (here and by the replay
        guard), so a retry with the same id is a first run."""
        session.current = None
        if session.state is State.BUSY:
            self.table.transition(session, Event.DONE)
        reason = error.strerror or str(error)
        log.warning(kv("turn_refused_disk_full", session=session.key, turn=turn.id, error=reason))
        self.refuse(turn, session, disk_full_message(turn.id, session.key, reason))

    def refuse(self, turn: Turn, session: Session, final: Message) -> None:
        """End a turn that never ran with an error, leaving its id unspent:
        nothing is kept for resends nor journaled (a retry runs it once)."""
        self.unacked.discard(turn.id)
        self.sends.forget(turn)
        self.forget_id(turn.id)
        self.endpoints.to_client(turn.client, final)
        self.watchers.publish(session, "error", final.body, turn=turn.id)
        metrics = self.ctx.metrics
        if metrics is not None:
            metrics.turns.labels(str(final.body.get("code"))).inc()

    def on_answer(self, session: Session, msg: Message, payload: bytes) -> bool:
        """An event or the final answer of the session's running turn, from
        its worker (already checked to be this session's). True if the turn
        ended."""
        turn = session.current
        if msg.kind is Kind.EVENT and msg.re is None and msg.body.get("type") == NOTICE:
            # Something the session's agent says on its own, outside any
            # turn (a background process ended): for the session's watchers.
            if len(payload) <= MAX_NOTICE_BYTES:
                self.watchers.publish(session, NOTICE, msg.body.get("data"), bound=len(payload))
            else:
                log.warning(kv("notice_too_large", session=session.key, bytes=len(payload)))
            return False
        if turn is None or msg.re != turn.id:
            log.warning(kv("stray_worker_message", session=session.key, kind=msg.kind.value))
            return False
        # The worker's envelope names this session and this turn, so its
        # payload goes to the client as it is, re-signed.
        if msg.kind is Kind.EVENT:
            if not turn.abandoned and not self.endpoints.to_client(turn.client, msg, payload):
                self.orphans.undelivered(session, turn)
            event_type = msg.body["type"]
            if event_type in APPROVAL_EVENTS:
                track_approval(session, event_type, msg.body.get("data"))
            self.watchers.publish(
                session, event_type, msg.body.get("data"), turn=turn.id, bound=len(payload)
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
        self.unacked.discard(turn.id)  # one that ended before it began
        size = len(payload) if payload is not None else approx_size(final.body)
        record = self.sends.get(turn.id)
        if record is not None:
            self.sends.keep_final(turn.id, record, final, size)
        self.endpoints.to_client(turn.client, final, payload)
        # Recorded after the client has it: a supervisor that dies between
        # the two leaves the turn `interrupted`, its answer already given.
        self.journal.ended(session, final, size)
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
