"""Health: workers that hang, sessions idle too long, and workers over their
limits, checked a few times a second from the supervisor's tick.

Theory of operation: hung means hung
------------------------------------
A worker beats every `heartbeat_interval` while it has a turn and every
`idle_heartbeat_interval` while idle; its limit is `heartbeat_timeout` (an
idle one's is three missed idle beats, if that is longer). Silence past the
limit is only evidence, and three things can make it false:

- Beats that arrived but were not read yet. Before judging a worker silent,
  everything waiting on the workers' socket is read (`read_workers`).
- The supervisor's own absence. When a tick comes far later than scheduled
  (`GAP`: the monotonic clock jumped over a SIGSTOP, a paused VM, a machine
  stalled by load), the supervisor heard nothing for that while, and in a
  paused VM its workers sent nothing either. The gap does not count as
  silence: every session's silence clock is moved on by it (never past
  now), and the gap is logged once. Silence before the gap still counts, so
  a worker already hung is still caught, and a supervisor whose ticks are
  late again and again still catches hangs, only later.
- A worker that is busy or starved, not stuck. At the limit its /proc stat
  is read: CPU time (utime+stime of all its threads) since the sample taken
  at half the limit, and each thread's run state. If its CPU time grew, or
  a thread is runnable (R: waiting for a CPU), it is slow: the deadline
  moves on by one more limit and the sample is taken again. This happens at
  most `PROGRESS_GRACE` times in one silence, so a worker spinning without
  heartbeats forever is still replaced, at (1 + PROGRESS_GRACE) times its
  limit (as a liveness probe's failure threshold would). A stopped worker
  (T, t), one that is sleeping with no CPU progress (a deadlock, a lost
  wakeup, a stuck syscall), or one whose stat cannot be read is hung at
  once, as before.

Hung: SIGABRT (so its log gets a traceback from faulthandler), then SIGKILL
after `abort_grace`. Workers are signalled, and their /proc read, by their
pid as the supervisor sees it (`session.proc`), sealed or not.

An idle session past `idle_timeout` (10 minutes by default) hibernates:
its worker is stopped politely, it is listed `hibernated`, and its next
turn wakes it on its files and history; one with a process of its own
still running (a background job) is not idle. Memory and process
limits are checked by sampling every worker's process tree in a thread (it
reads /proc), spaced so that sampling costs about 5% of the time at most.
Memory is the PSS of the tree (a shared page counts once), read only for
trees whose RSS sum is over the limit (see limits.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from hermes_sup.local.logfmt import kv

from .context import Context
from .deadlines import Deadlines
from .disk import DiskSampler, quota_support
from .lifecycle import Lifecycle
from .limits import TreeUsage, children_of, scan_trees
from .process import kill_processes
from .session import Session
from .states import State, Stop
from .table import SessionTable

log = logging.getLogger("hermes_sup.supervisor")

# An idle worker is hung after missing this many of its (slower) beats.
IDLE_BEATS_PER_TIMEOUT = 3
# Ticks are a quarter second apart: one this much later than the last means
# the supervisor itself was not running (see the module docstring).
GAP = 1.0
# Looking at a session a moment after its deadline, rather than a moment
# before, finds it due (not one float's rounding short of it).
JUDGE_SLACK = 0.001
# An idle session that could not hibernate yet (turns queued, or the
# supervisor not accepting) is looked at again this long after.
IDLE_RETRY = 1.0
# How many times a silent worker that makes progress gets one more limit.
PROGRESS_GRACE = 3
# CPU time (seconds) a silent worker must have used since its last sample to
# count as progress: more than a stray wakeup or two of an idle thread.
MIN_CPU_PROGRESS = 0.02
# Seconds between looks at the session cgroups' OOM counters (v1: an OOM
# kill in a session ends it, there being no memory.oom.group) and retries of
# groups still busy when their worker went.
CGROUP_INTERVAL = 0.5
# /proc stat states of a worker that cannot be making progress.
STOPPED_STATES = frozenset("Tt")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
MIB = 1024 * 1024


@dataclass(frozen=True)
class Sample:
    """What /proc says of a worker: CPU seconds used, its state, and
    whether any of its threads is runnable."""

    cpu: float
    state: str
    runnable: bool


@dataclass
class Watch:
    """A silent worker under watch: the heartbeat it went silent after,
    its last sample, and the extensions its progress has earned."""

    generation: int
    heartbeat: float
    sample: Sample | None
    extensions: int = 0


class Health:
    """Hang detection, idle culling and limits. `read_workers` reads
    everything waiting on the workers' socket, so that a beat that arrived
    is heard before its sender is judged."""

    def __init__(
        self,
        ctx: Context,
        table: SessionTable,
        lifecycle: Lifecycle,
        read_workers: Callable[[], object] = lambda: None,
    ) -> None:
        self.ctx = ctx
        self.table = table
        self.lifecycle = lifecycle
        self.read_workers = read_workers
        self._scanning = False
        self._next_scan = 0.0
        self._last_tick: float | None = None
        self._watches: dict[str, Watch] = {}
        self._due = Deadlines()
        self._read = False  # whether this tick has read the workers' socket
        # The awake cap: per session deferred for its background processes,
        # ((generation, turns) then, since when it is awake on them alone);
        # and those it is ending: (generation, the processes told, SIGKILLed).
        self._awake: dict[str, tuple[tuple[int, int], float]] = {}
        self._capping: dict[str, tuple[int, list[psutil.Process], bool]] = {}
        self._next_cgroups = 0.0
        # Each session's bytes on disk against its disk limit (disk.py).
        self.disk = DiskSampler(
            lambda session: ctx.settings_for(session).disk_limit_mb,  # type: ignore[arg-type]
            lambda: ctx.settings.disk_interval,
            self._over_disk,  # type: ignore[arg-type]
            enabled=lambda: bool(ctx.settings.disk_limit_mb),
            idle_since=_idle_since,  # type: ignore[arg-type]
            quiet=_alone,  # type: ignore[arg-type]
        )
        kind, why = quota_support(ctx.settings.data_dir)
        # The kernel's project quotas are not set by this version: where
        # the file system has them, that is said, and the sampler is used.
        self.disk.reason = f"{why}; project quotas are not applied by this version" if kind else why
        if ctx.settings.disk_limit_mb:
            log.info(
                kv("disk_limit", mb=ctx.settings.disk_limit_mb, enforced_by="sampler", why=why)
            )

    def begin(self, now: float) -> None:
        """The ticks start (`now` monotonic): a gap before the first is one too."""
        self._last_tick = now

    def judge_soon(self, session: Session) -> None:
        """Look at this session at the next tick: its worker became idle or
        busy (the table calls this), or its settings may have changed."""
        self._due.set(session.key, 0.0)

    def judge_all_soon(self) -> None:
        """Look at every live session at the next tick (settings reloaded)."""
        for session in self.table.judged.values():
            self.judge_soon(session)

    def tick(self, now: float, wall: float) -> None:
        """Look at the sessions whose deadline has come (`now` monotonic,
        `wall` time.time()): the cost follows what is due, not what is held."""
        last, self._last_tick = self._last_tick, now
        if last is not None and now - last > GAP:
            self._forgive_gap(now, now - last)
        self._read = False
        sessions = self.table.sessions
        for key in self._due.pop_due(now):
            session = sessions.get(key)
            if session is None or session.state not in (State.IDLE, State.BUSY):
                self._watches.pop(key, None)
                continue  # the table calls judge_soon when it has a worker again
            if session.proc is None:
                # Its hello came before the zygote's word of its pid: soon.
                self._due.set(key, now + JUDGE_SLACK)
                continue
            try:
                when = self._look_at(session, now, wall)
            except Exception:  # a bug: logged, and the others still looked at
                log.exception(kv("bug", where="health", session=key))
                when = now + IDLE_RETRY
            if when is not None:
                self._due.set(key, when)
        self._start_limits_scan(now)
        self.disk.tick(now, self.table.judged)  # type: ignore[arg-type]
        if now >= self._next_cgroups:
            self._next_cgroups = now + CGROUP_INTERVAL
            self._check_cgroups()
        if self._watches:
            self._forget_watches()

    def _look_at(self, session: Session, now: float, wall: float) -> float | None:
        """Judge one session's silence and idleness; return when to look
        at it again (monotonic), or None if it is on its way out."""
        own = self.ctx.settings_for(session)
        limit = own.heartbeat_timeout
        if session.state is State.IDLE:
            limit = max(limit, IDLE_BEATS_PER_TIMEOUT * own.idle_heartbeat_interval)
        if now - session.last_heartbeat > limit and not self._read:
            # A beat may be waiting unread: hear it before judging.
            self._read = True
            self.read_workers()
            now = time.monotonic()
        if not self._judged(session) or session.hang_signalled:
            return None
        self._judge_silence(session, now - session.last_heartbeat, limit)
        if session.hang_signalled:
            return None
        watch = self._watches.get(session.key)
        if watch is None:
            # Watched from half the limit (a sample to compare with later).
            when = session.last_heartbeat + limit / 2 + JUDGE_SLACK
        else:
            # Judged at the limit and at each extension's end; never sooner
            # than the next tick, so that there is CPU time to compare.
            when = max(now + JUDGE_SLACK, session.last_heartbeat + limit * (1 + watch.extensions))
        if own.idle_timeout is not None and session.state is State.IDLE:
            idle = wall - session.last_activity
            if idle > own.idle_timeout:
                if self.ctx.accepting and not session.queue:
                    if self._hibernate(session, idle):
                        return None
                    idle = 0.0  # deferred: its clock starts over
                    left = self._awake_left(session, wall)
                    if left is not None:
                        when = min(when, now + max(left, 0.0) + JUDGE_SLACK)
                else:
                    idle = own.idle_timeout - IDLE_RETRY  # look again in a moment
            when = min(when, now + own.idle_timeout - idle + JUDGE_SLACK)
        return when

    def _start_limits_scan(self, now: float) -> None:
        """Sample live workers' trees every `limits_interval`, when a limit
        applies to any of them."""
        if now < self._next_scan or self._scanning:
            return
        judged = self.table.judged.values()
        if self.ctx.settings.memory_limit_mb or self.ctx.settings.max_procs:
            wanted = bool(judged)
        else:
            wanted = any(
                v.settings is not None and (v.settings.memory_limit_mb or v.settings.max_procs)
                for v in judged
            )
        if wanted:
            self._next_scan = now + self.ctx.settings.limits_interval
            self.ctx.spawn(self._check_limits())

    def _check_cgroups(self) -> None:
        """Remove session groups left busy, and (v1) end every session in
        which the kernel OOM-killed a process: on v2 the kernel killed the
        whole group itself (memory.oom.group), and the exit says so."""
        groups = self.lifecycle.pool.cgroups
        if groups.hierarchy is None:
            return
        groups.retry()
        # Only groups whose OOM notice came (or that have none) are read:
        # see cgroups.py.
        if groups.hierarchy.oom_group or not groups.oom_watch_needed():
            return
        for session in list(self.table.judged.values()):
            if session.worker_id is None or session.state not in (
                State.STARTING,
                State.IDLE,
                State.BUSY,
            ):
                continue
            if not groups.oom_due(session.worker_id):
                continue
            if groups.oom_killed(session.worker_id) is None:
                continue
            reason = groups.end_reason(session.worker_id) or "was ended by the kernel: oom"
            log.warning(kv("oom_kill", session=session.key, reason=reason))
            # All of it now: what the kernel left of the session is not to
            # be trusted to stop politely, and its memory is full.
            session.kill_reason = reason
            self.ctx.spawn(self.lifecycle.killer.kill_session(session, force=True, reason=reason))

    def _hibernate(self, session: Session, idle: float) -> bool:
        """Stop an idle session's worker; it is listed `hibernated` and its
        next turn wakes it. Not while a process of its own still runs (a
        background job, a watcher): that is work, so its idle clock starts
        over (False)."""
        left = session.proc.descendants() if session.proc is not None else []
        capping = self._capping.get(session.key)
        if capping is not None and capping[0] == session.generation and capping[2]:
            left = []  # what is left was SIGKILLed by the awake cap: going
        if left:
            awake = self._awake_from(session)  # before touch() starts the idle clock over
            session.touch()
            log.info(kv("hibernate_deferred", session=session.key, processes=len(left)))
            own = self.ctx.settings_for(session)
            cap = own.max_awake_seconds
            if (
                cap is not None
                and not exempt(session.key, own.awake_exempt)
                and time.time() - awake >= cap
            ):
                self._end_background(session, left, time.time() - awake)
            return False
        self._capping.pop(session.key, None)
        self._awake.pop(session.key, None)
        session.stopping(Stop.IDLE)
        self.ctx.spawn(
            self.lifecycle.killer.kill_session(
                session, force=False, reason=f"hibernated: idle for {idle:.0f}s"
            )
        )
        return True

    def _over_disk(self, session: Session, reason: str) -> None:
        """The disk sampler found a session over its disk limit."""
        if session.state in (State.IDLE, State.BUSY) and session.proc is not None:
            log.warning(kv("disk_limit_exceeded", session=session.key, reason="disk"))
            self.lifecycle.killer.terminate(session, reason)

    # -- the awake cap ------------------------------------------------------

    def _awake_from(self, session: Session) -> float:
        """Since when (wall time) the session has stayed awake on its
        background processes alone: its last turn's end, as of its first
        deferred hibernation since that turn (a turn or a new worker
        starts the count again)."""
        mark = (session.generation, session.turns)
        known = self._awake.get(session.key)
        if known is None or known[0] != mark:
            known = self._awake[session.key] = (mark, session.last_activity)
        return known[1]

    def _awake_left(self, session: Session, wall: float) -> float | None:
        """Seconds until the awake cap acts on a deferred session (None:
        no cap for it, or it is acting already)."""
        own = self.ctx.settings_for(session)
        known = self._awake.get(session.key)
        if own.max_awake_seconds is None or known is None or session.key in self._capping:
            return None
        if exempt(session.key, own.awake_exempt):
            return None
        return known[1] + own.max_awake_seconds - wall

    def _end_background(self, session: Session, procs: list[psutil.Process], awake: float) -> None:
        """The awake cap: the session's background processes (never its
        worker) get SIGTERM now and SIGKILL after `awake_grace`; then it
        hibernates as any idle session does."""
        if session.key in self._capping:
            return  # already told
        own = self.ctx.settings_for(session)
        self._capping[session.key] = (session.generation, procs, False)
        told = kill_processes(procs, signal.SIGTERM)
        log.warning(
            kv(
                "awake_cap",
                session=session.key,
                awake=f"{awake:.0f}s",
                limit=f"{own.max_awake_seconds:g}s",
                processes=told,
                signal="SIGTERM",
                grace=f"{own.awake_grace:g}s",
            )
        )
        session.awake_capped = {
            "at": time.time(),
            "awake_seconds": round(awake, 1),
            "processes": told,
            "note": (
                f"awake {awake:.0f}s with no turn, over max_awake "
                f"({own.max_awake_seconds:g}s): its {told} background process(es) got "
                f"SIGTERM, then SIGKILL after {own.awake_grace:g}s, and it hibernated"
            ),
        }
        asyncio.get_running_loop().call_later(
            own.awake_grace, self._kill_background, session, session.generation
        )

    def _kill_background(self, session: Session, generation: int) -> None:
        """After the grace: SIGKILL what was told and is still there (and
        anything it started since, now the worker's), then hibernate."""
        capping = self._capping.get(session.key)
        if capping is None or capping[0] != generation or session.generation != generation:
            self._capping.pop(session.key, None)
            return
        if session.state is not State.IDLE or session.current is not None or session.queue:
            # A turn came meanwhile: the session is in use again, not capped.
            self._capping.pop(session.key, None)
            return
        procs = list(capping[1])
        if session.proc is not None:
            procs += session.proc.descendants()
        killed = kill_processes(procs, signal.SIGKILL)
        log.warning(kv("awake_cap_killed", session=session.key, processes=killed))
        self._capping[session.key] = (generation, [], True)
        idle = time.time() - session.last_activity
        if self.ctx.accepting:
            self._hibernate(session, idle)
        else:
            self._capping.pop(session.key, None)

    @staticmethod
    def _judged(session: Session) -> bool:
        """Whether a session's worker is expected to beat."""
        return session.state in (State.IDLE, State.BUSY) and session.proc is not None

    def _forgive_gap(self, now: float, gap: float) -> None:
        """The supervisor was not running for `gap` seconds: that is no
        session's silence (see the module docstring)."""
        live = [x for x in self.table.judged.values() if self._judged(x)]
        log.warning(kv("gap", seconds=f"{gap:.1f}", sessions=len(live), silence="not counted"))
        for session in live:
            moved = min(now, session.last_heartbeat + gap)
            watch = self._watches.get(session.key)
            if watch is not None and watch.heartbeat == session.last_heartbeat:
                watch.heartbeat = moved  # the same silence, still watched
            session.last_heartbeat = moved

    def _judge_silence(self, session: Session, silent: float, limit: float) -> None:
        """Watch a worker silent for half its limit; past the limit (and
        each extension), hung unless it made progress (module docstring)."""
        watch = self._watches.get(session.key)
        if silent <= limit / 2:
            if watch is not None:
                del self._watches[session.key]
            return
        assert session.proc is not None
        if (
            watch is None
            or watch.generation != session.generation
            or watch.heartbeat != session.last_heartbeat
        ):
            # Silent since a newer beat (or a new worker): start watching
            # afresh, and judge no sooner than the next tick, so that there
            # is CPU time to compare with.
            watch = Watch(session.generation, session.last_heartbeat, sample(session.proc.pid))
            self._watches[session.key] = watch
            return
        if silent <= limit * (1 + watch.extensions):
            return
        now = sample(session.proc.pid)
        before = watch.sample
        progress = (
            now is not None
            and now.state not in STOPPED_STATES
            and (now.runnable or (before is not None and now.cpu - before.cpu >= MIN_CPU_PROGRESS))
        )
        if progress and watch.extensions < PROGRESS_GRACE:
            assert now is not None
            watch.extensions += 1
            watch.sample = now
            cpu = now.cpu - before.cpu if before is not None else 0.0
            log.warning(
                kv(
                    "slow",
                    session=session.key,
                    pid=session.proc.pid,
                    silent=f"{silent:.1f}s",
                    cpu=f"{cpu:.2f}s",
                    state=now.state + ("+runnable" if now.runnable else ""),
                    extension=f"{watch.extensions}/{PROGRESS_GRACE}",
                )
            )
            return
        del self._watches[session.key]
        self._on_hang(session, silent, busy=progress)

    def _forget_watches(self) -> None:
        """Drop the watches of sessions that are gone (a new worker of a
        session starts afresh by its generation)."""
        sessions = self.table.sessions
        for key in [k for k in self._watches if k not in sessions]:
            del self._watches[key]

    def _on_hang(self, session: Session, silent: float, busy: bool = False) -> None:
        """No heartbeat: SIGABRT for a traceback in the session log, then SIGKILL."""
        assert session.proc is not None
        session.hang_signalled = True
        extra = {"busy": "cpu"} if busy else {}
        log.error(
            kv("hung", session=session.key, pid=session.proc.pid, silent=f"{silent:.1f}s", **extra)
        )
        why = f"busy on CPU, {PROGRESS_GRACE} extensions spent" if busy else "no progress either"
        session.kill_reason = (
            f"was hung (no heartbeat for {silent:.0f}s, {why}; SIGABRT for a traceback in "
            "its log, then SIGKILL)"
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
        recycle the sessions over their memory or process limit. A worker
        in a cgroup of its own is not sampled: its group holds both limits
        in the kernel (memory.max, pids.max; cgroups.py), and reading every
        tree every few seconds was an idle supervisor's largest cost."""
        groups = self.lifecycle.pool.cgroups
        workers = {
            sess.proc.pid: sess
            for sess in list(self.table.judged.values())
            if sess.proc is not None
            and sess.proc.returncode is None
            and sess.state in (State.IDLE, State.BUSY)
            and not groups.holds(sess.worker_id)
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


def _idle_since(session: Session) -> float | None:
    """When an idle session last had activity; None if it is not idle."""
    return session.last_activity if session.state is State.IDLE else None


def _alone(session: Session) -> bool:
    """Whether a session's worker has no process of its own under it now."""
    return session.proc is not None and not children_of(session.proc.pid)


def exempt(key: str, patterns: tuple[str, ...]) -> bool:
    """Whether a session key is exempt from the awake cap: named, or
    matching a `PREFIX*`."""
    return any(key.startswith(p[:-1]) if p.endswith("*") else key == p for p in patterns)


def sample(pid: int) -> Sample | None:
    """Read a worker's CPU time and run states from /proc; None if it is
    gone or unreadable. utime and stime in its stat are the sums over its
    threads; the state there is its main thread's, so each thread's is read
    too, for one that is runnable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
        runnable = False
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                    if f.read().rpartition(b")")[2].split()[0] == b"R":
                        runnable = True
                        break
            except OSError:
                continue  # a thread that just ended
    except (OSError, IndexError):
        return None
    try:
        # After the command: state, ppid, ... utime is the 12th, stime the 13th.
        cpu = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
        return Sample(cpu, fields[0].decode(), runnable)
    except (IndexError, ValueError):
        return None
