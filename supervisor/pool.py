"""The worker pool: the processes behind the sessions.

Theory of operation
-------------------
Workers are forked by the zygote (spawner.py), a process that has no threads
and no zmq context, so a fork is cheap and clean. A worker is the
supervisor's own child from the moment it is cloned, but the supervisor
learns its pid only when the zygote answers: until then the spawn is
counted in `spawning`, and an orphan cull waits, so that a just-cloned
worker is never taken for an orphan. An exit reaped before the zygote's
answer is kept in `unclaimed_exits` for the spawn to claim.

Spare workers (spare_workers.py) are forked ahead and wait; a new session
takes a ready one and sends it its spawn request (`assign`). The pool keeps
their number, replaces those that die (with back-off), and kills them at
shutdown.

The pool indexes workers by routing id and by pid, and claims each reaped
pid for its session or spare; what an exit means for a session is the
lifecycle's to decide (lifecycle.py). Processes re-parented to the
supervisor that are no worker's (what a dead worker left behind) are culled.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections.abc import Callable
from typing import Any

import psutil
import zmq

from hermes_sup.door import privatedir
from hermes_sup.local.logfmt import kv
from hermes_sup.protocol import (
    Kind,
    LocalProtocolError,
    Message,
    RemoteProtocolError,
    decode,
    describe_exit,
    encode,
)
from hermes_sup.seal.paths import SealedPaths

from .cgroups import SessionGroups
from .context import Context
from .endpoints import Endpoints
from .environment import worker_env
from .limits import children_of, tree_pids
from .logs import PipeReader
from .model_gate import worker_agent_config
from .process import WorkerProcess, kill_processes
from .records import WorkerRecords
from .sealing import HostUids, Sealing, uid_for
from .session import Session
from .spare_workers import Spare, SparePool
from .spawner import Zygote, ZygoteError
from .watchers import Watchers

log = logging.getLogger("hermes_sup.supervisor")
# How long a zygote that preloads Hermes for sealed sessions may go without
# a word (it reports progress every 2 s; the whole preload was seen taking
# 3 - 5 s quiet, over 30 s at a load of 28 on 2 cores).
ZYGOTE_HERMES_TIMEOUT = 300.0

MAX_UNCLAIMED_EXITS = 4096


def new_identity() -> tuple[bytes, bytes]:
    """A signing token and a routing id for a worker to be forked."""
    return secrets.token_bytes(32), b"w" + secrets.token_bytes(15)


class WorkerPool:
    """The zygote, the spare workers, and every worker by routing id and pid."""

    def __init__(
        self,
        ctx: Context,
        endpoints: Endpoints,
        records: WorkerRecords,
        watchers: Watchers,
    ) -> None:
        self.ctx = ctx
        self.endpoints = endpoints
        self.records = records
        self.watchers = watchers
        self.zygote: Zygote | None = None
        self.spares = SparePool()
        self.by_worker_id: dict[bytes, Session] = {}
        self.by_pid: dict[int, Session] = {}
        self.unclaimed_exits: dict[int, int] = {}
        # Spawns between the request to the zygote and the registration of
        # the new pid: the worker is already our child but not yet known.
        self.spawning = 0
        self._cull_pending = False
        # Whether workers are sealed (set at start by the server, see
        # sealing.py), and as root the uid each live session runs as.
        self.sealing = Sealing()
        self.sealed_uids: dict[str, int] = {}
        self.host_uids: HostUids | None = None  # opened with the first
        # A kernel control group per worker, where the host gives us one
        # (set up at start by the server, see cgroups.py).
        self.cgroups = SessionGroups()
        # The sealed Hermes preload: how far it is while the zygote starts
        # ({done, of, seconds}), then what it did ({modules, recorded,
        # seconds, missing}), for `status`; None when there is none. Whoever
        # starts the pool may hear of its progress too (the server: systemd,
        # and `status` before the control socket is up).
        self.preload: dict[str, Any] | None = None
        self.on_preload_progress: Callable[[dict[str, Any]], None] = lambda report: None

    # ------------------------------------------------------------- zygote

    def start_zygote(self) -> None:
        settings = self.ctx.settings
        home = settings.data_dir / "zygote-home"
        privatedir.ensure_private_dir(home)
        env = dict(self.ctx.base_env)
        # The zygote's own HERMES_HOME stays empty: anything preloaded that
        # captured a path at import would show up there, not in a session.
        env["HERMES_HOME"] = str(home)
        if "PYTHONPATH" in self.ctx.environ:
            env["PYTHONPATH"] = self.ctx.environ["PYTHONPATH"]
        cwd = str(settings.data_dir)
        mode = self.sealing.mode
        if mode is not None:
            # Sealed: it imports under the fixed paths P, W, U, which every
            # worker finds its own session's directories mounted over.
            paths = SealedPaths.for_data_dir(settings.data_dir.absolute())
            env["HERMES_HOME"] = str(paths.home)
            env["TERMINAL_CWD"] = str(paths.workspace)
            env["HOME"] = str(paths.user)
            cwd = str(paths.workspace)
        hermes = settings.runtime == "hermes" or "hermes" in settings.runtimes
        self.zygote = Zygote(
            settings.preload,
            env,
            cwd=cwd,
            sealed=mode,
            data_dir=str(settings.data_dir.absolute()),
            hermes=hermes,
            cgroup_dirs=self.cgroups.made_dirs(),
        )
        # Hermes preloaded (sealed) is some 1,800 modules: seconds on a quiet
        # machine, minutes on a loaded one; anything else is quick.
        sealed_hermes = mode is not None and hermes
        if sealed_hermes:
            log.info(kv("zygote_preloading", what="hermes", sealed=mode))

        def heard(report: dict[str, Any]) -> None:
            self.preload = report
            log.info(
                kv(
                    "zygote_preloading",
                    what="hermes",
                    modules=f"{report.get('done')}/{report.get('of')}",
                    seconds=f"{report.get('seconds', 0):.1f}",
                )
            )
            self.on_preload_progress(report)

        ready = self.zygote.start(
            timeout=ZYGOTE_HERMES_TIMEOUT if sealed_hermes else 30.0,
            on_progress=heard if sealed_hermes else None,
        )
        done = ready.get("sealed_preload")
        self.preload = dict(done) if isinstance(done, dict) else None
        self.sealing.pid_namespaces = bool(ready.get("pid_namespaces"))
        if ready.get("failed"):
            for mod, why in ready["failed"].items():
                log.error(kv("preload_failed", module=mod, error=why))
        log.info(
            kv(
                "zygote_ready",
                pid=ready.get("pid"),
                preloaded=",".join(ready.get("loaded", [])),
                seconds=f"{ready.get('seconds', 0):.3f}",
                sealed=mode or "no",
                hermes_preloaded=bool(ready.get("sealed_preload")),
            )
        )

    def on_zygote_exit(self, status: int) -> None:
        assert self.zygote is not None
        self.zygote.fail_pending("the zygote died")
        if not self.ctx.accepting:
            return
        code = os.waitstatus_to_exitcode(status)
        log.error(kv("zygote_died", status=code))
        self.zygote.detach(asyncio.get_running_loop())
        self.zygote.close()
        self.start_zygote()
        self.zygote.attach(asyncio.get_running_loop())

    # ------------------------------------------------------------ workers

    def spawn_request(self, session: Session) -> dict[str, Any]:
        """What the zygote (or a spare) is told to start `session`'s worker with."""
        s = self.ctx.settings
        env = worker_env(
            self.ctx.base_env,
            s.env,
            session.options,
            session.key,
            session.home,
            session.workspace,
            session.tmp,
            session.user,
        )
        rlimits = {}
        if s.max_open_files:
            rlimits["nofile"] = s.max_open_files
        if s.cpu_seconds:
            rlimits["cpu"] = s.cpu_seconds
        if s.file_size_limit_mb:
            rlimits["fsize"] = s.file_size_limit_mb * 1024 * 1024
        if s.max_procs and self.sealing.mode is not None and not self.cgroups.active:
            # Sealed, a session's processes are its own uid's (root) or its
            # own user namespace's: the kernel counts them per session, and
            # a fork over the limit fails at once. (Unsealed, every session
            # shares our uid, and the sampler's count is the only limit.)
            # With cgroups, the session's pids.max counts them instead.
            rlimits["nproc"] = s.max_procs
        seal = self.sealing.plan(s, session, self._sealed_uid(session))
        return {
            "key": session.key,
            "title": session.key if len(session.key) <= 48 else session.key[:45] + "...",
            "token": session.token,
            "worker_id": session.worker_id,
            "endpoint": self.endpoints.worker,
            "supervisor_pid": os.getpid(),
            "env": env,
            "workspace": str(session.workspace),
            "home": str(session.home),
            "tmp": str(session.tmp),
            "user": str(session.user),
            "runtime": session.options.runtime or s.runtime,
            # With a network of its own, the model's key stays here: the
            # worker calls the supervisor's model endpoint (model_gate.py).
            "runtime_config": worker_agent_config(s.runtime_config, session.options.agent, seal),
            "options": session.options.to_wire(),
            # Several beats per timeout, so one late beat is never a hang.
            "heartbeat": min(s.heartbeat_interval, s.heartbeat_timeout / 4),
            "idle_heartbeat": s.idle_heartbeat_interval,
            "rlimits": rlimits,
            # The clients' frame limit: the worker sends a too_large stand-in
            # for an answer or event over it, instead of one nobody can read.
            "max_frame_size": s.max_frame_size,
            # The window in which the worker merges a turn's stream deltas
            # into one event (worker/coalesce.py); 0 is off.
            "coalesce_ms": s.stream_coalesce_ms,
            # How it seals itself (None: unsealed); see sealing.py.
            "seal": seal,
        }

    def _sealed_uid(self, session: Session) -> int | None:
        """As root and sealed, the uid the session's worker runs as: the one
        it had (its files are that uid's), else one no live session holds."""
        if self.sealing.mode != "root":
            return None
        uid = self.sealed_uids.get(session.key)
        if uid is None:
            if self.host_uids is None:
                self.host_uids = HostUids.open()
            uid = uid_for(session.key, set(self.sealed_uids.values()), self.host_uids)
            self.sealed_uids[session.key] = uid
        return uid

    def release_uid(self, session: Session) -> None:
        """The session's worker is gone: its uid may serve another session
        (of ours, or of another supervisor on the host)."""
        uid = self.sealed_uids.pop(session.key, None)
        if uid is not None and self.host_uids is not None:
            self.host_uids.release(uid)

    def identify(self, session: Session, token: bytes, worker_id: bytes) -> None:
        """Give the session's next worker its token and routing id."""
        if session.worker_id is not None:
            self.by_worker_id.pop(session.worker_id, None)
        session.token, session.worker_id = token, worker_id
        self.by_worker_id[worker_id] = session

    def forget_worker(self, session: Session) -> None:
        """The session's worker is gone: its routing id and token go too."""
        if session.worker_id is not None:
            self.by_worker_id.pop(session.worker_id, None)
        session.worker_id = None
        session.token = None

    def session_of(self, worker_id: bytes) -> Session | None:
        return self.by_worker_id.get(worker_id)

    def fork(self, request: dict[str, Any]) -> asyncio.Future[tuple[int, int | None]]:
        """Ask the zygote for a worker. Counted as spawning from now until
        `forked()`: the worker is our child as soon as it is cloned, and
        until it is registered an orphan cull must not take it for one."""
        assert self.zygote is not None
        self.spawning += 1
        return self.zygote.spawn(request)

    def forked(self) -> None:
        """A spawn counted by `fork` is registered (or failed)."""
        self.spawning -= 1

    def adopt(self, session: Session, proc: WorkerProcess, out_fd: int | None) -> int | None:
        """Make a forked (or assigned spare) process the session's worker.
        Returns its exit status if it was reaped before we knew its pid."""
        session.proc = proc
        self.by_pid[proc.pid] = session
        if out_fd is not None and session.log is not None:
            own = self.ctx.settings_for(session)
            session.log.limit_rate(own.log_rate_limit, own.log_rate_burst)
            reader = PipeReader(
                out_fd,
                session.log,
                session.key,
                lambda lines: self.watchers.log_lines(session, lines),
                # Lines are decoded only for someone following the log.
                want_lines=lambda: bool(session.log_followers),
            )
            session.pipe = reader
            reader.start(asyncio.get_running_loop(), lambda: self.pipe_closed(session, reader))
        self._record(proc.pid, session.key, proc.create_time)
        log.info(kv("spawned", session=session.key, pid=proc.pid))
        if self.ctx.metrics is not None:
            self.ctx.metrics.spawns.inc()
        return self.unclaimed_exits.pop(proc.pid, None)

    def _record(self, pid: int, key: str, create_time: float | None) -> None:
        """Record a worker for a later supervisor's clean-up. Only that reads
        it: the worker runs on without one (a full disk must not fail its
        start half-way)."""
        try:
            self.records.add(pid, key, create_time)
        except OSError as exc:
            log.warning(kv("worker_record_failed", pid=pid, error=exc.strerror or exc))

    def pipe_closed(self, session: Session, reader: PipeReader) -> None:
        """A worker's output pipe reached its end (the worker and every
        descendant that held it are gone)."""
        if session.pipe is reader:
            session.pipe = None

    def claim_exit(self, pid: int, status: int) -> Session | None:
        """A child was reaped: the session whose worker it was (with its
        output logged and its exit recorded), or None if it was a spare
        (handled here), or not known yet (kept for its spawn to claim)."""
        spare = self.spares.by_pid.get(pid)
        if spare is not None:
            self._spare_exited(spare, status)
            return None
        session = self.by_pid.pop(pid, None)
        if session is None or session.proc is None or session.proc.pid != pid:
            # An orphan of a dead worker, or a worker whose pid the zygote has
            # not told us yet: keep its status for the spawn to claim.
            if len(self.unclaimed_exits) >= MAX_UNCLAIMED_EXITS:
                self.unclaimed_exits.pop(next(iter(self.unclaimed_exits)))
            self.unclaimed_exits[pid] = status
            return None
        self.records.remove(pid)
        self.release_uid(session)
        if session.pipe is not None:
            # Every line the worker wrote before it died is logged before its
            # death is handled (and reported); never raises (see logs.py).
            session.pipe.drain_at_exit()
        session.proc.set_exited(status)
        return session

    # ------------------------------------------------------------- spares

    def take_spare(self) -> Spare | None:
        """A ready spare worker for a new session, out of the pool."""
        return self.spares.take()

    def fill_spares(self) -> None:
        """Fork spare workers up to `spare_workers` (see spare_workers.py)."""
        pool = self.spares
        if not self.ctx.accepting or self.zygote is None or time.monotonic() < pool.retry_at:
            return
        wanted = self.ctx.settings.spare_workers
        while len(pool) < wanted:
            spare = Spare()
            pool.add(spare)
            request = {
                "spare": True,
                "worker_id": spare.worker_id,
                "token": spare.token,
                "endpoint": self.endpoints.worker,
                "supervisor_pid": os.getpid(),
                # Sealed: it enters its namespace at start (single-threaded),
                # and mounts its session's directories once assigned.
                "seal": self.sealing.spare_plan(self.ctx.settings),
                # Born into the cgroup its session will have: moving a
                # process costs the kernel an RCU grace period (ms), paid
                # here, ahead of need, not when a session is waiting.
                "cgroup": self.cgroups.make(spare.worker_id, self.ctx.settings),
            }
            # As for a worker: culls wait until it is known.
            self.ctx.spawn(self._register_spare(spare, self.fork(request)))
        while len(pool) > wanted:  # fewer since a reload
            extra = next(iter(pool.by_id.values()))
            pool.retire(extra)
            if extra.proc is not None:
                extra.proc.kill()  # it holds nothing; reaped as any child

    def spares_wanted(self) -> bool:
        """Fewer spares than configured (or more, after a reload)."""
        return len(self.spares) != self.ctx.settings.spare_workers

    async def _register_spare(
        self, spare: Spare, forked: asyncio.Future[tuple[int, int | None]]
    ) -> None:
        try:
            try:
                pid, out_fd = await forked
            except ZygoteError as exc:
                self.spares.discard(spare)
                self.cgroups.release(spare.worker_id)
                self.spares.retry_at = time.monotonic() + 1.0  # not on every tick
                log.warning(kv("spare_not_forked", error=exc))
                return
            proc = WorkerProcess(pid)
            self.spares.forked(spare, proc, out_fd)
            self._record(pid, "(spare)", proc.create_time)
            if spare.worker_id not in self.spares.by_id or not self.ctx.accepting:
                proc.kill()  # trimmed or shutting down while it was forked
            status = self.unclaimed_exits.pop(pid, None)
            if status is not None:
                self.claim_exit(pid, status)
        finally:
            self.forked()

    def on_spare(self, spare: Spare, frames: list[bytes]) -> None:
        """A spare speaks once: `spare`, when it is connected and waiting."""
        try:
            msg = decode(frames, spare.token, self.endpoints.limits)
        except RemoteProtocolError as exc:
            log.warning(kv("bad_spare_message", error=exc))
            return
        if msg.kind is Kind.SPARE:
            spare.ready = True

    def assign(self, session: Session, spare: Spare, request: dict[str, Any]) -> bool:
        """Give a new session a ready spare worker: send it the spawn request
        it would have been forked with. False if it is gone (then fork one)."""
        assert spare.proc is not None
        # The spare was born in a group of its own (fill_spares), which
        # becomes the session's: its limits are the session's from now, and
        # it is in it before it hears of the session (moved now only if its
        # own write failed).
        if self.cgroups.make(spare.worker_id, self.ctx.settings_for(session)):
            self.cgroups.place(spare.worker_id, spare.proc.pid)
        # Everything but the token, which the spare has had since its fork.
        body = {"request": {k: v for k, v in request.items() if k != "token"}}
        try:
            frames = encode(Message(Kind.ASSIGN, body), spare.token, self.endpoints.worker_limits)
            self.endpoints.back.send([spare.worker_id, *frames])
        except (zmq.ZMQError, LocalProtocolError) as exc:
            # Gone, or a request too large for a message (the zygote takes it
            # in parts): a fork of its own serves the session instead.
            log.warning(kv("spare_unreachable", pid=spare.proc.pid, error=exc))
            # Out of the pool already; its exit is still ours to clean up.
            self.spares.by_pid[spare.proc.pid] = spare
            spare.proc.kill()
            return False
        return True

    def _spare_exited(self, spare: Spare, status: int) -> None:
        assert spare.proc is not None
        pid = spare.proc.pid
        spare.proc.set_exited(status)
        self.records.remove(pid)
        output = b""
        if spare.out_fd is not None:
            os.set_blocking(spare.out_fd, False)
            try:
                output = os.read(spare.out_fd, 65536)
            except OSError:
                pass
            os.close(spare.out_fd)
        self.cgroups.release(spare.worker_id)
        pool, s = self.spares, self.ctx.settings
        if spare.worker_id not in pool.by_id:
            pool.discard(spare)  # retired by us
            return
        delay = pool.died(spare, s.min_uptime, s.backoff_base, s.backoff_cap)
        if self.ctx.accepting:
            why = describe_exit(spare.proc.exit_code, spare.proc.exit_signal)
            text = output.decode("utf-8", "replace").strip()[-2000:]
            log.warning(kv("spare_exited", pid=pid, why=why, output=text or "(none)"))
            asyncio.get_running_loop().call_later(delay, self.fill_spares)

    def kill_spares(self) -> None:
        """Spares hold nothing: SIGKILL them (reaped as any child)."""
        for spare in list(self.spares.by_id.values()):
            if spare.proc is not None and spare.proc.returncode is None:
                spare.proc.kill()

    # ------------------------------------------------------------ orphans

    def schedule_orphan_cull(self) -> None:
        if not self._cull_pending:
            self._cull_pending = True
            asyncio.get_running_loop().call_later(0.05, self._cull_orphans)

    def _cull_orphans(self) -> None:
        """Kill processes re-parented to us that are not workers: descendants
        left behind by a worker that died. Nothing a session started outlives it."""
        self._cull_pending = False
        if self.spawning:
            self.schedule_orphan_cull()  # a new worker may be adopted but not yet known
            return
        known = set(self.by_pid) | set(self.spares.by_pid)
        if self.zygote is not None and self.zygote.pid is not None:
            known.add(self.zygote.pid)
        # Our children by the kernel's lists (limits.py): psutil's children()
        # reads every process on the host, and this runs after every exit,
        # so that a shutdown of N workers cost N times the host.
        orphans = [pid for pid in children_of(os.getpid()) if pid not in known]
        for pid in orphans:
            tree = []
            for member in tree_pids(pid):
                try:
                    tree.append(psutil.Process(member))  # its create time, for the kill
                except psutil.Error:
                    continue  # gone meanwhile
            hit = kill_processes(tree)
            if hit:
                log.warning(kv("orphans_killed", pid=pid, count=hit))
