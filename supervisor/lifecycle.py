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

A kill stops a worker and everything it started: a polite `stop`, then
SIGTERM to its process group, then SIGKILL, with the process tree taken
before the first signal (once a parent dies, its children's links are gone).

Admission also takes the session's lease (table.claim) before a worker may
start, and refuses with `moved` on a draining node: a draining node lets
its running turns (and those queued behind them) finish and stops each
session as it goes idle (`drain`). A session whose lease was taken over by
another node has its worker stopped at once, its turns answered `moved`.
"""

from __future__ import annotations

import asyncio
import logging
import signal
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
from .metrics import exit_category
from .pool import WorkerPool, new_identity
from .process import WorkerProcess, kill_processes
from .sealing import SESSIONS_GID
from .session import Session
from .spawner import ZygoteError
from .states import Event, State, backoff_delay, exit_event
from .table import SessionTable
from .turns import Turns
from .worktrees import (
    GitRunner,
    WorktreeError,
    Worktrees,
    commit_problem,
    home_is_empty,
    placeholder_values,
    seed_home,
    worktree_ready,
)

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
        # git runs as our child: the pool holds its orphan cull meanwhile and
        # hands over the exit status if the supervisor's reaper took it.
        self.worktrees = Worktrees(
            GitRunner(
                ctx.environ,
                self._hold_cull,
                pool.forked,
                lambda pid: self.pool.unclaimed_exits.pop(pid, None),
            )
        )
        # Repositories already checked for whether sealed sessions can commit.
        self._commit_checked: set[str] = set()
        # A lease names where this node is reached (its TCP endpoint, once bound).
        table.leases.endpoint = lambda: getattr(endpoints, "tcp", None)
        table.on_lease_lost = self._lease_lost
        table.on_drained_idle = self._stop_when_idle

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
            self.table.claim(session)

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
            self.kill_session(
                victim,
                force=False,
                reason=f"evicted to make room (max_sessions {self.ctx.max_sessions})",
            )
        )

    # -------------------------------------------------------------- start

    def start_worker(self, session: Session) -> None:
        """Start a worker for the session (admitted: its lease is held)."""
        self.table.claim(session)  # held already, but never a worker without it
        if session.retry_timer is not None:
            session.retry_timer.cancel()
            session.retry_timer = None
        session.generation += 1
        pool = self.pool
        # A worktree to make or a home to seed first: the worker starts
        # once they are there (_prepare_and_fork), not before.
        template = self._template_to_seed(session)
        prepare = template is not None or (
            session.repo is not None and not worktree_ready(session.workspace)
        )
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
        self.table.transition(session, Event.SPAWN)
        request = pool.spawn_request(session)
        # The supervisor seeds the home (worktrees.seed_home), with the
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
            request["turn"] = {"id": turn.id, "text": turn.text}
        if prepare:
            self.table.save_new(session)  # the directory the worktree goes in
            self.ctx.spawn(self._prepare_and_fork(session, session.generation, request, template))
            return
        self.table.refresh_peers(session)
        # Asked now, not when the task first runs: the fork starts sooner.
        if spare is not None:
            if pool.assign(session, spare, request):
                assert spare.proc is not None
                self._adopt(session, spare.proc, spare.out_fd)
            else:
                spare = None  # gone meanwhile: fork one, under a routing id of its own
                token, worker_id = new_identity()
                pool.identify(session, token, worker_id)
                request.update(token=token, worker_id=worker_id)
        if spare is None:
            forked = pool.fork(request)
            self.ctx.spawn(self._register(session, session.generation, forked))
        self.table.save_new(session)

    def _template_to_seed(self, session: Session) -> Path | None:
        """The template its home is to be copied from, if it has one and
        its home is still empty (a new session)."""
        template = self.ctx.settings.runtime_config.get("template_home")
        if not template or not home_is_empty(session.home):
            return None
        return Path(template)

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
            if session.repo is not None and session.branch is not None:
                await self.worktrees.ensure(session.repo, session.workspace, session.branch)
                self._check_commits(session.repo)
            if template is not None:
                values = placeholder_values(session.key, session.options.session_env)
                await asyncio.to_thread(seed_home, template, session.home, values)
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
            if self.pool.assign(session, spare, request):
                assert spare.proc is not None
                status = self._adopt(session, spare.proc, spare.out_fd)
                if status is not None:
                    self.on_exit(spare.proc.pid, status)
                return
            token, worker_id = new_identity()
            self.pool.identify(session, token, worker_id)
            request.update(token=token, worker_id=worker_id)
        await self._register(session, generation, self.pool.fork(request))

    def _check_commits(self, repo: str) -> None:
        """Say once per repository if sealed sessions could not commit to it."""
        if self.pool.sealing.mode != "root" or repo in self._commit_checked:
            return
        self._commit_checked.add(repo)
        problem = commit_problem(repo, SESSIONS_GID)
        if problem is not None:
            log.warning(kv("repo_not_writable_by_sessions", repo=repo, hint=problem))

    async def purge(self, session: Session, delete_branch: bool) -> str:
        """Delete a stopped session's data (kill --purge): first its
        worktree (git worktree remove, prune; its branch only if asked),
        then the rest. A note on what stayed, for the reply."""
        note = ""
        if session.key in self.table.purging:
            return " (by another kill, still removing its worktree)"
        if session.repo is not None and session.branch is not None:
            self.table.purging.add(session.key)
            try:
                problems = await self.worktrees.remove(
                    session.repo, session.workspace, session.branch, delete_branch
                )
            finally:
                self.table.purging.discard(session.key)
            if problems:
                note = " (" + "; ".join(problems) + ")"
            elif not delete_branch:
                note = f", branch {session.branch} kept"
            else:
                note = f", branch {session.branch} deleted"
        if self.table.get(session.key) is session:
            note += self.table.purge(session)
        return note

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
            self.terminate(
                session,
                f"did not say hello within {self.ctx.settings_for(session).start_timeout:g}s of its start",
            )

    def on_hello(self, session: Session, msg: Message) -> None:
        """The worker proved its token: the session is ready for turns."""
        if session.state is not State.STARTING:
            return
        session.hello_pid = int(msg.body["pid"])
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
        reason = session.kill_reason or describe_exit(
            session.proc.exit_code, session.proc.exit_signal
        )
        self.worker_gone(session, reason, exit_code=session.proc.exit_code)

    def worker_gone(self, session: Session, reason: str, exit_code: int | None) -> None:
        """The session's worker is no more: decide the session's next state
        and answer whoever was waiting on it."""
        s = self.ctx.settings_for(session)
        was = session.state
        pid = session.proc.pid if session.proc is not None else None
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
            self.start_worker(session)  # messages are waiting: start a fresh worker
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
        except RemoteProtocolError as exc:
            self.turns.fail_queue(session, exc.code, exc.message)
            return
        self.start_worker(session)

    # ------------------------------------------------------- leases, drain

    def _lease_lost(self, session: Session, why: str) -> None:
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
                self.kill_session(session, force=True, reason=reason, code=ErrorCode.MOVED)
            )
            return
        session.kill_reason, session.kill_code = reason, ErrorCode.MOVED.value
        self.table.transition(session, Event.KILL, reason)
        self.kill_now(session, session.generation)

    def _stop_when_idle(self, session: Session) -> None:
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
                self.kill_session(
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

    # --------------------------------------------------------------- kill

    async def kill_session(
        self,
        session: Session,
        force: bool,
        reason: str = "killed by request",
        code: ErrorCode = ErrorCode.SESSION_KILLED,
    ) -> tuple[int | None, str]:
        """Stop a session's worker and everything it started; return (pid, how).
        Also clears a backed-off or failed session."""
        if session.state in (State.BACKOFF, State.FAILED):
            self.turns.fail_queue(session, code, f"the session was stopped: {reason}")
            self.table.transition(session, Event.CLEAR, reason)
            session.fast_failures = 0
            if session.retry_timer is not None:
                session.retry_timer.cancel()
                session.retry_timer = None
            return None, "cleared"
        if session.state is State.EXITED:
            return None, "not running"
        if session.state is State.STOPPING:
            await session.exited.wait()
            return (session.proc.pid if session.proc else None), "was already stopping"
        session.kill_reason = reason
        session.kill_code = code.value
        self.table.transition(session, Event.KILL, reason)
        self.turns.fail_queue(
            session, code, f"the session was stopped before this turn ran: {reason}"
        )
        s = self.ctx.settings_for(session)
        # A worker still being forked has no pid yet; wait for it (bounded).
        deadline = time.monotonic() + s.start_timeout
        while session.proc is None and not session.exited.is_set():
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.005)
        proc = session.proc
        if proc is None:
            await session.exited.wait()
            return None, "never started"
        # Snapshot the whole tree before the first signal: once a parent dies,
        # its children's parent links are gone.
        tree = proc.descendants()
        how = "stopped"
        if not (force or self.ctx.forced) and self.endpoints.to_worker(
            session, Message(Kind.STOP, {}, session=session.key)
        ):
            await self._wait_exit(session, s.stop_timeout)
        if not session.exited.is_set():
            tree += proc.descendants()
            how = "terminated"
            proc.signal_group(signal.SIGTERM)
            proc.terminate()
            if not (force or self.ctx.forced):
                await self._wait_exit(session, s.term_timeout)
        if not session.exited.is_set():
            tree += proc.descendants()
            how = "killed"
            proc.signal_group(signal.SIGKILL)
            proc.kill()
        killed = kill_processes(tree)
        await session.exited.wait()
        if killed:
            log.info(kv("descendants_killed", session=session.key, count=killed))
        log.info(kv("killed", session=session.key, pid=proc.pid, how=how, reason=reason))
        return proc.pid, how

    async def _wait_exit(self, session: Session, timeout: float) -> None:
        try:
            await asyncio.wait_for(session.exited.wait(), timeout)
        except TimeoutError:
            pass

    def terminate(self, session: Session, reason: str) -> None:
        """End a worker for a reason of the supervisor's own (a limit, a hang)."""
        if session.proc is None or session.proc.returncode is not None:
            return
        log.warning(kv("terminating", session=session.key, pid=session.proc.pid, reason=reason))
        session.kill_reason = reason
        self.kill_now(session, session.generation)

    def kill_now(self, session: Session, generation: int) -> None:
        """SIGKILL the worker of this generation and its whole tree."""
        proc = session.proc
        if session.generation != generation or proc is None or proc.returncode is not None:
            return
        tree = proc.descendants()
        proc.signal_group(signal.SIGKILL)
        proc.kill()
        kill_processes(tree)

    def force_kill_all(self) -> None:
        """Told twice to shut down: SIGKILL every worker now."""
        self.ctx.forced = True
        self.pool.kill_spares()
        for session in self.table.sessions.values():
            if session.proc is not None and session.proc.returncode is None:
                session.kill_reason = "the supervisor was told twice to shut down"
                session.kill_code = ErrorCode.SHUTTING_DOWN.value
                session.proc.signal_group(signal.SIGKILL)
                session.proc.kill()
