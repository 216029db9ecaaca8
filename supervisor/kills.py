"""Stopping a session's worker and everything it started.

A kill stops a worker and everything it started: a polite `stop`, then
SIGTERM to its process group, then SIGKILL, with the process tree taken
before the first signal (once a parent dies, its children's links are
gone). The supervisor's own reasons (a limit, a hang) go straight to
SIGKILL (`terminate`), and a supervisor told twice to shut down kills
every worker at once (`force_kill_all`).

Polite stops in a shutdown or a drain are staggered: at most
`STOPS_AT_ONCE` workers are between their `stop` and their exit at any
moment. Each stopping worker runs its own exit path (a runtime saving its
state, Python tearing down), and thousands stopped at once made the host's
run queue thousands long, the supervisor among them. Only then: while new
sessions are admitted, a stopping worker no longer counts against
`max_sessions` but still holds its descriptors, so stops parked behind
others let new workers in past the descriptor limit (EMFILE at about 6,700
sessions hibernating 2 s after one turn each, 40 new ones a second).
Forced kills are never staggered: SIGKILL costs the worker nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time

import psutil

from hermes_sup.local.logfmt import kv
from hermes_sup.protocol import ErrorCode, Kind, Message

from .context import Context
from .endpoints import Endpoints
from .pool import WorkerPool
from .process import WorkerProcess, kill_processes
from .session import Session
from .states import Event, State
from .table import SessionTable
from .turns import Turns

log = logging.getLogger("hermes_sup.supervisor")

# Workers stopping politely at one time (see the module docstring).
STOPS_AT_ONCE = max(8, 4 * (os.cpu_count() or 1))


class Killer:
    """Stops workers: asked, then SIGTERM, then SIGKILL."""

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
        self._stopping = asyncio.Semaphore(STOPS_AT_ONCE)

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
        # Staggered only while no new session can take the slots they free
        # (see the module docstring).
        stagger = not (force or self.ctx.forced) and (not self.ctx.accepting or self.ctx.draining)
        async with self._stopping if stagger else contextlib.nullcontext():
            how, tree = await self._stop(session, proc, s.stop_timeout, s.term_timeout, force)
        killed = kill_processes(tree)
        await session.exited.wait()
        if killed:
            log.info(kv("descendants_killed", session=session.key, count=killed))
        log.info(kv("killed", session=session.key, pid=proc.pid, how=how, reason=reason))
        return proc.pid, how

    async def _stop(
        self,
        session: Session,
        proc: WorkerProcess,
        stop_timeout: float,
        term_timeout: float,
        force: bool,
    ) -> tuple[str, list[psutil.Process]]:
        """Ask, then SIGTERM, then SIGKILL; return how it ended and every
        process of its tree seen on the way."""
        # Snapshot the whole tree before the first signal: once a parent dies,
        # its children's parent links are gone.
        tree = proc.descendants()
        how = "stopped"
        if not (force or self.ctx.forced) and self.endpoints.to_worker(
            session, Message(Kind.STOP, {}, session=session.key)
        ):
            await self._wait_exit(session, stop_timeout)
        if not session.exited.is_set():
            tree += proc.descendants()
            how = "terminated"
            proc.signal_group(signal.SIGTERM)
            proc.terminate()
            if not (force or self.ctx.forced):
                await self._wait_exit(session, term_timeout)
        if not session.exited.is_set():
            tree += proc.descendants()
            how = "killed"
            proc.signal_group(signal.SIGKILL)
            proc.kill()
        return how, tree

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
