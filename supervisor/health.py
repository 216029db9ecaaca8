"""Health: workers that hang, sessions idle too long, and workers over their
limits, checked a few times a second from the supervisor's tick.

A worker beats every `heartbeat_interval` while it has a turn and every
`idle_heartbeat_interval` while idle; one silent for longer than its limit
is hung: SIGABRT (so its log gets a traceback from faulthandler), then
SIGKILL after `abort_grace`. An idle session past `idle_timeout` is stopped
politely. Memory and process limits are checked by sampling every worker's
process tree in a thread (it reads /proc), spaced so that sampling costs
about 5% of the time at most. Memory is the PSS of the tree (a shared page
counts once), read only for trees whose RSS sum is over the limit (see
limits.py).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time

from hermes_sup.local.logfmt import kv

from .context import Context
from .lifecycle import Lifecycle
from .limits import TreeUsage, scan_trees
from .session import Session
from .states import State
from .table import SessionTable

log = logging.getLogger("hermes_sup.supervisor")

# An idle worker is hung after missing this many of its (slower) beats.
IDLE_BEATS_PER_TIMEOUT = 3
MIB = 1024 * 1024


class Health:
    """Hang detection, idle culling and limits."""

    def __init__(self, ctx: Context, table: SessionTable, lifecycle: Lifecycle) -> None:
        self.ctx = ctx
        self.table = table
        self.lifecycle = lifecycle
        self._scanning = False
        self._next_scan = 0.0

    def tick(self, now: float, wall: float) -> None:
        """Check every session once (`now` monotonic, `wall` time.time())."""
        s = self.ctx.settings
        settings_for = self.ctx.settings_for
        for session in list(self.table.sessions.values()):
            own = settings_for(session)
            if session.state in (State.IDLE, State.BUSY) and session.proc is not None:
                silent = now - session.last_heartbeat
                limit = own.heartbeat_timeout
                if session.state is State.IDLE:
                    limit = max(limit, IDLE_BEATS_PER_TIMEOUT * own.idle_heartbeat_interval)
                if silent > limit and not session.hang_signalled:
                    self._on_hang(session, silent)
            if (
                own.idle_timeout is not None
                and self.ctx.accepting
                and session.state is State.IDLE
                and not session.queue
                and wall - session.last_activity > own.idle_timeout
            ):
                idle = wall - session.last_activity
                self.ctx.spawn(
                    self.lifecycle.killer.kill_session(
                        session, force=False, reason=f"idle for {idle:.0f}s"
                    )
                )
        if (
            now >= self._next_scan
            and not self._scanning
            and any(
                x.memory_limit_mb or x.max_procs
                for x in [s, *(v.settings for v in self.table.sessions.values() if v.settings)]
            )
        ):
            self._next_scan = now + s.limits_interval
            self.ctx.spawn(self._check_limits())

    def _on_hang(self, session: Session, silent: float) -> None:
        """No heartbeat: SIGABRT for a traceback in the session log, then SIGKILL."""
        assert session.proc is not None
        session.hang_signalled = True
        log.error(kv("hung", session=session.key, pid=session.proc.pid, silent=f"{silent:.1f}s"))
        session.kill_reason = (
            f"was hung (no heartbeat for {silent:.0f}s; SIGABRT for a traceback in its log, "
            "then SIGKILL)"
        )
        session.proc.send_signal(signal.SIGABRT)
        asyncio.get_running_loop().call_later(
            self.ctx.settings_for(session).abort_grace,
            self.lifecycle.killer.kill_now,
            session,
            session.generation,
        )

    async def _check_limits(self) -> None:
        """Sample every live worker's tree (in a thread: it reads /proc) and
        recycle the sessions over their memory or process limit."""
        workers = {
            sess.proc.pid: sess
            for sess in self.table.sessions.values()
            if sess.proc is not None
            and sess.proc.returncode is None
            and sess.state in (State.IDLE, State.BUSY)
        }
        if not workers:
            return
        # Trees over their limit by RSS get their PSS read, a second check.
        pss_over = {}
        for pid, sess in workers.items():
            limit = self.ctx.settings_for(sess).memory_limit_mb
            if limit:
                pss_over[pid] = limit * MIB
        self._scanning = True
        started = time.monotonic()
        try:
            usage: dict[int, TreeUsage] = await asyncio.get_running_loop().run_in_executor(
                None, scan_trees, list(workers), False, pss_over
            )
        finally:
            self._scanning = False
        # With thousands of processes a sample takes a while: space them so
        # that sampling never costs more than about 5% of the time.
        took = time.monotonic() - started
        self._next_scan = max(self._next_scan, time.monotonic() + took * 20)
        for pid, use in usage.items():
            session = workers[pid]
            if session.proc is None or session.proc.pid != pid:
                continue
            s = self.ctx.settings_for(session)
            if s.memory_limit_mb and use.memory > s.memory_limit_mb * MIB:
                self.lifecycle.killer.terminate(
                    session,
                    f"went over its memory limit ({use.memory / MIB:.0f} MiB PSS with its "
                    f"children > {s.memory_limit_mb} MiB) and was recycled",
                )
            elif s.max_procs and use.procs > s.max_procs:
                self.lifecycle.killer.terminate(
                    session,
                    f"went over its process limit ({use.procs} processes > "
                    f"{s.max_procs}) and was recycled",
                )
