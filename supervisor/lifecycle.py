"""A session's worker from start to exit: admission, start, the exit
policy, back-off and retry, and killing.

Theory of operation
-------------------
Before a session may start a worker it is admitted: a failed session is
refused until its cool-down has passed, and at `max_sessions` the least
recently used idle session is stopped to make room (or, with none idle, the
request is refused as `overloaded`).

`start_worker` gives the session a new generation, takes a ready spare
worker (or asks the zygote for a fork) and, for a runtime known to start, hands the
first queued turn over in the spawn request. The worker proves its token
with a hello; one that does not within `start_timeout` is terminated.

When a worker exits, `worker_gone` asks the restart policy in states.py
what the exit was (EXIT, FAST_EXIT or GIVE_UP), answers every turn that was
waiting on the worker, and schedules what comes next: a retry after the
back-off, the failed session's cool-down, or a fresh worker if turns are
waiting. Every timer checks the session's generation, so a timer armed for
one worker never acts on its successor.

A kill (kills.py) stops a worker and everything it started: a polite
`stop`, then SIGTERM to its process group, then SIGKILL.

Admission also takes the session's lease (ownership.claim) before a worker may
start, and refuses with `moved` on a draining node: a draining node lets
its running turns (and those queued behind them) finish and stops each
session as it goes idle (`drain`). A session whose lease was taken over by
another node has its worker stopped at once, its turns answered `moved`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from hermes_sup.local.logfmt import kv
from hermes_sup.protocol import (
    ErrorCode,
    Kind,
    Message,
    RemoteProtocolError,
    WorkerExit,
    describe_exit,
    error_message,
)

from .context import Context
from .endpoints import Endpoints
from .git import WorktreeError
from .kills import Killer
from .metrics import exit_category
from .pool import WorkerPool, new_identity
from .prepare import Preparation
from .process import WorkerProcess
from .session import Session
from .spare_workers import Spare
from .spawner import ZygoteError
from .states import Event, State, backoff_delay, exit_event
from .table import SessionTable
from .turns import Turns

log = logging.getLogger("hermes_sup.supervisor")

# Exits a worker chooses before it could have started a turn: a first turn
# handed over in its spawn request did not run, and may be tried again.
UNSTARTED_EXITS = frozenset(
    {WorkerExit.BOOT_FAILED, WorkerExit.RUNTIME_LOAD_FAILED, WorkerExit.SEAL_FAILED}
)
# Exits that will not go otherwise at the next try: give up at once.
HOPELESS_EXITS = frozenset({WorkerExit.RUNTIME_LOAD_FAILED, WorkerExit.SEAL_FAILED})
# A first turn longer than this waits for the worker's hello instead: the
# spawn request travels as one datagram, bounded by the socket's buffer.
HANDOVER_TEXT = 16 * 1024


class Lifecycle:
    """Starting, restarting and stopping sessions' workers."""

    def __init__(
        self,
        ctx: Context,
        table: SessionTable,
        turns: Turns,
        pool: WorkerPool,
        endpoints: Endpoints,
    ) -> None:
        self.ctx = ctx
        self.table = table
        self.turns = turns
        self.pool = pool
        self.endpoints = endpoints
        # The runtimes (name and config) whose workers have said hello: a
        # first turn is handed over in the spawn request only to those.
        self.runtimes_started: set[str] = set()
        # What is made for a session before its worker (worktree, home).
        self.preparation = Preparation(ctx, table, pool, self._hold_cull)
        # What stops a worker and everything it started.
        self.killer = Killer(ctx, table, turns, pool, endpoints)

    def _hold_cull(self) -> None:
        """A child of ours that is no worker (git) runs: counted as a spawn,
        so that the orphan cull waits for it (pool.forked() ends it)."""
        self.pool.spawning += 1

    # ---------------------------------------------------------- admission

    def admit(self, session: Session) -> None:
        """Refuse turns for a failed session (until its cool-down) and when
        there is no room for another worker; on a draining node, and for a
        session another node holds, `moved`. A session admitted to start a
        worker holds its lease."""
        if session.state is State.FAILED:
            left = session.retry_at - time.monotonic()
            if left > 0:
                raise RemoteProtocolError(
                    ErrorCode.SESSION_FAILED,
                    f"session {session.key!r} has failed: its worker {session.last_exit}. "
                    f"Kill it to retry now, or wait {left:.0f}s",
                )
            self.table.transition(session, Event.CLEAR, "cool-down passed")
            session.fast_failures = 0
        if session.state is State.EXITED and self.ctx.draining and session.lease is None:
            raise RemoteProtocolError(
                ErrorCode.MOVED,
                f"node {self.ctx.node} is draining and takes no new sessions; "
                f"send {session.key!r} to another node (a router does)",
                detail={"reason": "draining", "node": None, "endpoint": None},
            )
        if session.state in (State.EXITED, State.BACKOFF):
            self.make_room(session)
            self.table.ownership.claim(session)

    def make_room(self, session: Session) -> None:
        """Before a new worker: stop the least recently used idle session if
        we are at max_sessions, or refuse with `overloaded`."""
        if self.table.running < self.ctx.max_sessions:
            return  # counted at every transition: no scan of every session per spawn
        victim = self.table.least_recent_idle(excluding=session)
        if victim is None:
            raise RemoteProtocolError(
                ErrorCode.OVERLOADED,
                f"all {self.ctx.max_sessions} session slots are busy; try again shortly",
            )
        log.info(kv("evict", session=victim.key, for_session=session.key))
        self.ctx.spawn(
            self.killer.kill_session(
                victim,
                force=False,
                reason=f"evicted to make room (max_sessions {self.ctx.max_sessions})",
            )
        )

    # -------------------------------------------------------------- start

    def start_worker(self, session: Session) -> None:
        """Start a worker for the session (admitted: its lease is held)."""
        self.table.ownership.claim(session)  # held already, but never a worker without it
        if session.retry_timer is not None:
            session.retry_timer.cancel()
            session.retry_timer = None
        session.generation += 1
        pool = self.pool
        # A worktree to make or a home to seed first: the worker starts
        # once they are there (_prepare_and_fork), not before.
        template = self.preparation.template_to_seed(session)
        prepare = self.preparation.needed(session, template)
        spare = None if prepare else pool.take_spare()
        token, worker_id = (spare.token, spare.worker_id) if spare else new_identity()
        pool.identify(session, token, worker_id)
        session.proc = session.hello_pid = None
        session.exited = asyncio.Event()
        session.started_at = time.time()
        session.spawned_mono = session.last_heartbeat = time.monotonic()
        session.hang_signalled = False
        session.kill_reason = session.kill_code = None
        session.cpu_sample = None  # CPU% is per worker: start from this one
        session.settings = self.ctx.settings
        self.table.transition(session, Event.SPAWN)  # wakes it, if it was asleep
        request = pool.spawn_request(session)
        # The supervisor seeds the home (homes.seed_home), with the
        # session's own values: the runtime must not copy the template again.
        request["runtime_config"].pop("template_home", None)
        session.runtime_kind = repr((request["runtime"], sorted(request["runtime_config"].items())))
        if (
            session.queue
            and session.current is None
            and len(session.queue[0].text) <= HANDOVER_TEXT
            and not session.queue[0].context
            and session.fast_failures == 0
            and session.runtime_kind in self.runtimes_started
        ):
            # The first turn goes with the spawn request: the worker starts
            # it right after its hello, instead of waiting for the supervisor
            # to see the hello and send it (a round trip through 2 processes).
            # Only for a runtime that has started before and a session not
            # failing: a worker that then dies before its hello may have run
            # the turn, which then fails (at most once) instead of waiting
            # for a retry as it would behind a runtime that cannot start.
            turn = self.turns.hand_over(session)
            if turn is not None:  # None: not journaled, refused once the worker is ready
                request["turn"] = {"id": turn.id, "text": turn.text}
        if prepare:
            self.table.store.save_new(session)  # the directory the worktree goes in
            self.ctx.spawn(self._prepare_and_fork(session, session.generation, request, template))
            return
        self.table.refresh_peers(session)
        # Asked now, not when the task first runs: the fork starts sooner.
        self._spare_or_fork(session, request, spare)
        self.table.store.save_new(session)

    def _spare_or_fork(
        self, session: Session, request: dict[str, Any], spare: Spare | None
    ) -> None:
        """Hand the session's spawn request to `spare` (its token and routing
        id are the session's already), or, with none or one gone meanwhile,
        to a new fork under an identity of its own."""
        if spare is not None:
            if self.pool.assign(session, spare, request):
                assert spare.proc is not None
                status = self._adopt(session, spare.proc, spare.out_fd)
                if status is not None:
                    self.on_exit(spare.proc.pid, status)
                return
            token, worker_id = new_identity()
            self.pool.identify(session, token, worker_id)
            request.update(token=token, worker_id=worker_id)
        # Its cgroup, made now: the forked child enters it as its first act.
        assert session.worker_id is not None
        request["cgroup"] = self.pool.cgroups.make(
            session.worker_id, self.ctx.settings_for(session)
        )
        forked = self.pool.fork(request)
        self.ctx.spawn(self._register(session, session.generation, forked))

    async def _prepare_and_fork(
        self,
        session: Session,
        generation: int,
        request: dict[str, Any],
        template: Path | None,
    ) -> None:
        """Make what the worker needs before it starts (its worktree, its
        home from the template), then fork it; a failure fails the session
        with the reason, as a runtime that cannot load does."""
        try:
            await self.preparation.prepare(session, template)
        except (WorktreeError, OSError) as exc:
            if session.generation == generation and session.proc is None:
                reason = f"could not be started: {exc}"
                log.error(kv("prepare_failed", session=session.key, error=exc))
                self.worker_gone(session, reason, exit_code=WorkerExit.RUNTIME_LOAD_FAILED)
            return
        if session.generation != generation or session.proc is not None:
            return
        if session.state is State.STOPPING:
            # Killed while its worktree was being made: it never started.
            self.worker_gone(session, session.kill_reason or "stopped", exit_code=None)
            return
        self.table.refresh_peers(session)
        spare = self.pool.take_spare()
        if spare is not None:
            self.pool.identify(session, spare.token, spare.worker_id)
            request.update(token=spare.token, worker_id=spare.worker_id)
        self._spare_or_fork(session, request, spare)

    async def _register(
        self, session: Session, generation: int, forked: asyncio.Future[tuple[int, int | None]]
    ) -> None:
        """Register the forked worker; ends the spawn `start_worker` counted."""
        try:
            try:
                pid, out_fd = await forked
            except ZygoteError as exc:
                if session.generation == generation:
                    self.worker_gone(session, f"could not be forked: {exc}", exit_code=None)
                return
            status = self._adopt(session, WorkerProcess(pid), out_fd)
            if status is not None:
                self.on_exit(pid, status)
        finally:
            self.pool.forked()

    def _adopt(self, session: Session, proc: WorkerProcess, out_fd: int | None) -> int | None:
        """The pool takes the process as the session's worker; the start
        timeout is armed for this generation."""
        status = self.pool.adopt(session, proc, out_fd)
        asyncio.get_running_loop().call_later(
            self.ctx.settings_for(session).start_timeout,
            self._check_started,
            session,
            session.generation,
        )
        return status

    def _check_started(self, session: Session, generation: int) -> None:
        if session.generation == generation and session.state is State.STARTING:
            self.killer.terminate(
                session,
                f"did not say hello within {self.ctx.settings_for(session).start_timeout:g}s of its start",
            )

    def on_hello(self, session: Session, msg: Message) -> None:
        """The worker proved its token: the session is ready for turns."""
        if session.state is not State.STARTING:
            return
        session.hello_pid = int(msg.body["pid"])
        if session.proc is not None and session.worker_id is not None:
            # It entered its cgroup as its first act (before it could say
            # hello); checked here, and moved where its own write failed.
            # (Not at the fork's reply: a move costs the kernel an RCU grace
            # period, which would stall the loop if it raced the child's.)
            self.pool.cgroups.place(session.worker_id, session.proc.pid)
        self.table.transition(session, Event.HELLO)
        self.runtimes_started.add(session.runtime_kind)
        log.info(kv("ready", session=session.key, pid=msg.body["pid"]))
        if session.current is not None:
            # The first turn came with the spawn request; the worker
            # started it right after this hello.
            self.turns.begin(session, session.current, handed=True)
        else:
            self.turns.pump(session)

    # --------------------------------------------------------------- exit

    def on_exit(self, pid: int, status: int) -> None:
        """A child was reaped: if it was a session's worker, the session
        goes on without it."""
        session = self.pool.claim_exit(pid, status)
        if session is None:
            return
        assert session.proc is not None
        # The kernel's word first (an OOM kill, forks refused at pids.max):
        # a SIGKILL alone does not say which.
        reason = (
            session.kill_reason
            or self.pool.cgroups.end_reason(session.worker_id)
            or describe_exit(session.proc.exit_code, session.proc.exit_signal)
        )
        self.worker_gone(session, reason, exit_code=session.proc.exit_code)

    def worker_gone(self, session: Session, reason: str, exit_code: int | None) -> None:
        """The session's worker is no more: decide the session's next state
        and answer whoever was waiting on it."""
        s = self.ctx.settings_for(session)
        was = session.state
        pid = session.proc.pid if session.proc is not None else None
        # What it left in its cgroup is killed, and the group removed.
        self.pool.cgroups.release(session.worker_id)
        self.pool.forget_worker(session)
        session.exits += 1
        session.last_exit = reason
        event, session.fast_failures = exit_event(
            was,
            accepting=self.ctx.accepting,
            load_failed=exit_code in HOPELESS_EXITS,
            uptime=time.monotonic() - session.spawned_mono,
            min_uptime=s.min_uptime,
            fast_failures=session.fast_failures,
            max_fast_failures=s.max_fast_failures,
        )
        self.table.transition(session, event, reason)
        metrics = self.ctx.metrics
        if metrics is not None:
            signal_name = session.proc.exit_signal if session.proc is not None else None
            metrics.exits.labels(
                exit_category(reason, exit_code, signal_name, was is State.STOPPING)
            ).inc()
        level = logging.INFO if was is State.STOPPING else logging.WARNING
        log.log(
            level,
            kv(
                "exited",
                session=session.key,
                pid=pid,
                reason=reason,
                was=was.value,
                now=session.state.value,
            ),
        )
        self._answer_current(session, was, pid, reason, exit_code)
        session.cancel_on_hello = None  # its worker is gone, and with it the handed turn
        if session.state is State.FAILED:
            session.retry_at = time.monotonic() + s.failed_cooldown
            self.turns.fail_queue(
                session,
                ErrorCode.SESSION_FAILED,
                f"session {session.key!r} has failed: its worker {reason}"
                + (
                    f" ({session.fast_failures} fast failures in a row)"
                    if session.fast_failures > 1
                    else ""
                )
                + f"; kill it to retry now, or wait {s.failed_cooldown:g}s",
            )
        elif session.state is State.BACKOFF:
            delay = backoff_delay(session.fast_failures, s.backoff_base, s.backoff_cap)
            session.retry_at = time.monotonic() + delay
            for turn in session.queue:
                self.endpoints.to_client(
                    turn.client,
                    Message(
                        Kind.EVENT,
                        {
                            "type": "status",
                            "data": {"state": "backoff", "retry_in": delay, "reason": reason},
                        },
                        session=session.key,
                        re=turn.id,
                    ),
                )
            if session.queue:
                self.schedule_retry(session)
        session.exited.set()
        if session.state is State.EXITED and session.queue and self.ctx.accepting:
            try:
                self.start_worker(session)  # messages are waiting: start a fresh worker
            except RemoteProtocolError as exc:
                # Its lease is held elsewhere now (it was taken while the
                # worker stopped): the waiting turns go there.
                self.turns.fail_queue(session, exc.code, exc.message, exc.detail)
        self.pool.schedule_orphan_cull()

    def _answer_current(
        self, session: Session, was: State, pid: int | None, reason: str, exit_code: int | None
    ) -> None:
        """The turn the dead worker had: back to the queue if it cannot have
        run, otherwise failed (at most once, never run twice)."""
        if (
            session.current is not None
            and was is State.STARTING
            and (exit_code in UNSTARTED_EXITS or pid is None)
        ):
            # The worker was handed this turn but failed before its hello,
            # at a point that is before any turn (or was never forked): the
            # turn did not run, so it waits for the next worker like the rest.
            turn, session.current = session.current, None
            if session.cancel_on_hello == turn.id:
                self.turns.cancelled_unstarted(session, turn)  # while it waited for the hello
            else:
                self.turns.requeue(session, turn)
        if session.current is not None:
            turn, session.current = session.current, None
            if not turn.abandoned:
                if was is State.STOPPING or session.kill_code is not None:
                    code = ErrorCode(session.kill_code or ErrorCode.SESSION_KILLED.value)
                    text = f"the session was stopped during this turn: {reason}"
                else:
                    code = ErrorCode.WORKER_DIED
                    text = f"the worker of session {session.key!r} (pid {pid}) {reason} during this turn"
                self.turns.finish(
                    turn, session, error_message(code.value, text, re=turn.id, session=session.key)
                )

    def schedule_retry(self, session: Session) -> None:
        if session.retry_timer is None:
            delay = max(0.0, session.retry_at - time.monotonic())
            session.retry_timer = asyncio.get_running_loop().call_later(delay, self._retry, session)

    def _retry(self, session: Session) -> None:
        session.retry_timer = None
        if session.state is not State.BACKOFF or not session.queue or not self.ctx.accepting:
            return
        try:
            self.make_room(session)
            self.start_worker(session)  # (its lease may be held elsewhere by now)
        except RemoteProtocolError as exc:
            self.turns.fail_queue(session, exc.code, exc.message, exc.detail)

    # ------------------------------------------------------- leases, drain

    def lease_lost(self, session: Session, why: str) -> None:
        """Another node took the session over: its turns are answered
        `moved` (they may be sent there), and our worker is SIGKILLed now,
        before it can write anything more (a turn being handed to it too)."""
        if session.state not in (State.STARTING, State.IDLE, State.BUSY):
            return
        reason = f"its lease was lost: {why}"
        self.turns.fail_queue(session, ErrorCode.MOVED, f"the session moved: {reason}")
        proc = session.proc
        if proc is None or proc.returncode is not None:  # still being forked
            self.ctx.spawn(
                self.killer.kill_session(session, force=True, reason=reason, code=ErrorCode.MOVED)
            )
            return
        session.kill_reason, session.kill_code = reason, ErrorCode.MOVED.value
        self.table.transition(session, Event.KILL, reason)
        self.killer.kill_now(session, session.generation)

    def stop_when_idle(self, session: Session) -> None:
        """While draining: stop a session that went idle with nothing queued
        (soon, once the turn's answer is out), which gives its lease up."""
        asyncio.get_running_loop().call_soon(self._stop_if_idle, session)

    def _stop_if_idle(self, session: Session) -> None:
        if (
            self.ctx.draining
            and self.table.get(session.key) is session
            and session.state in (State.IDLE, State.BACKOFF, State.FAILED)
            and not session.queue
        ):
            self.ctx.spawn(
                self.killer.kill_session(
                    session,
                    force=False,
                    reason=f"node {self.ctx.node} is draining",
                    code=ErrorCode.MOVED,
                )
            )

    def drain(self, on: bool) -> None:
        """Start (or end) draining: take no new sessions, and stop every
        session that is idle now; busy ones are stopped as they go idle."""
        was, self.ctx.draining = self.ctx.draining, on
        if on != was:
            log.info(kv("drain" if on else "undrain", node=self.ctx.node))
        if on:
            for session in list(self.table.sessions.values()):
                self._stop_if_idle(session)
