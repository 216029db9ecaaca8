"""The supervisor: owns worker processes and routes messages between clients and them.

Theory of operation
-------------------
`Supervisor.run` prepares everything that must exist before any zmq context
or thread does (the state directory, the lock, the signing key, the subreaper
flag, the zygote) and then enters one asyncio loop.

`Supervisor` is the composition root. Each responsibility is a part that
owns its state and is given, at construction, only the parts it uses:

    context.py    the settings in force and service-wide facts
    endpoints.py  the sockets, and sending to clients and workers
    watchers.py   watchers, session histories, log followers
    table.py      sessions by key, and every state transition
    turns.py      queues, running a turn, its one final answer, timeouts
    pool.py       the zygote, spare workers, workers by id and pid, orphans
    lifecycle.py  admission, start, exit policy, back-off, retry, kill
    health.py     hangs, idle culling, limits
    lease_watch.py  leases read back continuously: a worker fenced too
    node_lease.py the node's lease with a deadline (--lease-time)
    front.py      client requests, one handler per kind
    back.py       what workers say

What stays here is the loop: signal handlers only put an event on a queue;
the main loop reaps children (dispatched to the pool and the lifecycle),
reloads on SIGHUP and shuts down on SIGTERM/SIGINT. A tick enforces
heartbeats, limits and idle time. Long operations (spawn, kill, shutdown)
are tasks, so no command waits for another. Every turn ends in exactly one
reply or error to its client, whatever happens to its worker.
"""

from __future__ import annotations

import asyncio
import gc
import ipaddress
import logging
import os
import resource
import signal
import time
from functools import partial
from typing import Any

import psutil

from hermes_sup.door import privatedir, remote
from hermes_sup.local import statedir
from hermes_sup.local.addresses import parse_listen
from hermes_sup.local.logfmt import kv
from hermes_sup.local.version import version
from hermes_sup.protocol import ErrorCode, RemoteProtocolError

from . import cgroups, configfile, model_gate, model_meter, sealing
from .back import Back
from .cgroups import lower_oom_score
from .config import DEFAULT_PASS_ENV, Settings
from .context import Context
from .endpoints import WORKER_INBOX, Endpoints
from .environment import allowlisted
from .front import Front
from .health import Health
from .lease_watch import LeaseWatch
from .lifecycle import Lifecycle
from .limits import allowed_sessions
from .metrics import Metrics, read_token
from .node_lease import NodeLease, node_expired
from .notify import Notifier
from .pool import WorkerPool
from .process import become_subreaper
from .proxy import EgressProxy, PolicySource
from .records import WorkerRecords
from .spare_dirs import SpareDirs
from .starting import StartReport
from .states import LIVE_STATES, State
from .table import SessionTable
from .turns import Turns
from .watchers import Watchers

log = logging.getLogger("hermes_sup.supervisor")

TICK = 0.25
# A full garbage collection pauses the loop for about 0.8 us per tracked
# object here: 95 ms at 2,000 sessions. Python starts one whenever the heap
# has grown by a quarter, so while sessions are being added it kept landing
# in the middle of spawns. The supervisor starts them itself on a fixed
# clock instead (young cycles are still collected as usual, by generations
# 0 and 1), and freezes what it made at start-up, which lives as long as it.
FULL_GC_INTERVAL = 300.0
GC_NEVER = 1_000_000  # gen-1 collections before Python would start a full one


def connect(table: SessionTable, turns: Turns, lifecycle: Lifecycle, endpoints: Endpoints) -> None:
    """What the session table and its ownership tell the parts that act on
    them, set here, where the parts are put together, rather than by each
    part reaching into the table (tests/fakes.py's rig calls this too)."""
    ownership = table.ownership
    # A lease names where this node is reached (its TCP endpoint, once bound).
    ownership.leases.endpoint = lambda: getattr(endpoints, "tcp", None)
    # The session's lease is ours now (its journal is read), or no longer.
    ownership.on_taken = turns.journal.taken
    ownership.on_released = turns.journal.released
    # Taken over by another node: its worker goes, its turns are `moved`.
    ownership.on_lease_lost = lifecycle.lease_lost
    # Draining: a session gone idle with nothing queued is stopped.
    table.on_drained_idle = lifecycle.stop_when_idle


class Supervisor:
    """One supervisor process serving many sessions."""

    def __init__(self, settings: Settings, environ: dict[str, str] | None = None) -> None:
        own = dict(os.environ if environ is None else environ)
        # Taken out of the environment, so nothing we start can notify systemd.
        self.notifier = Notifier(os.environ if environ is None else own)
        own.pop("NOTIFY_SOCKET", None)
        self.ctx = Context(settings, own)
        self._next_watchdog = 0.0
        self.start_report = StartReport(settings.state_dir, self.notifier)
        self._lock = privatedir.InstanceLock(settings.state_dir)
        self._events: asyncio.Queue[tuple[str, Any]] | None = None
        self._next_full_gc = time.monotonic() + FULL_GC_INTERVAL

    @property
    def settings(self) -> Settings:
        return self.ctx.settings

    def _compose(self, key: bytes) -> None:
        """Make the parts, each given only what it uses."""
        ctx, s = self.ctx, self.ctx.settings
        self.endpoints = Endpoints(s, key)
        self.watchers = Watchers(self.endpoints)
        self.table = SessionTable(ctx, self.watchers, SpareDirs(s.data_dir))
        # Lifecycle takes Turns, so Turns reaches it through a call made
        # later: a runtime that ignores a timed-out turn's cancel loses its worker.
        self.turns = Turns(
            ctx,
            self.table,
            self.endpoints,
            self.watchers,
            terminate=lambda session, reason: self.lifecycle.killer.terminate(session, reason),
        )
        self.pool = WorkerPool(ctx, self.endpoints, WorkerRecords(s.state_dir), self.watchers)
        self.lifecycle = Lifecycle(ctx, self.table, self.turns, self.pool, self.endpoints)
        # Everything the workers' socket can hold: one full inbox each.
        self.health = Health(
            ctx,
            self.table,
            self.lifecycle,
            read_workers=lambda: self.endpoints.back.read_waiting(
                WORKER_INBOX * (len(self.table) + len(self.pool.spares) + 1)
            ),
        )
        connect(self.table, self.turns, self.lifecycle, self.endpoints)
        self.table.on_judged = self.health.judge_soon  # its deadlines follow its state
        self.turns.disk_limit = self.health.disk.describe  # for `status`
        self.front = Front(
            ctx,
            self.table,
            self.turns,
            self.lifecycle,
            self.watchers,
            self.pool,
            self.endpoints,
            self.reload,
        )
        self.back = Back(ctx, self.endpoints, self.pool, self.turns, self.lifecycle)
        self.lease_watch = LeaseWatch(self.table.sessions, self.table.ownership)
        # Leases with a deadline (node_lease.py): other nodes' are read by
        # every taker; this node's own kept only with --lease-time.
        self.table.ownership.leases.expired = partial(node_expired, s.data_dir)
        self.node_lease: NodeLease | None = None
        if s.lease_time > 0:
            self.node_lease = NodeLease(
                s.data_dir, ctx.node, s.lease_time, self.table.sessions, self.table.ownership
            )
            self.front.on_router_ping = self.node_lease.heard_from_router

    # ------------------------------------------------------------------ start

    def run(self) -> int:
        """Start, serve until SIGTERM/SIGINT, shut down. Returns an exit status."""
        s = self.settings
        # What can be refused is refused before any directory is made.
        for name in (statedir.CONTROL_SOCKET, statedir.WORKER_SOCKET):
            statedir.endpoint(s.state_dir, name)  # a socket path too long for AF_UNIX
        if s.tcp:
            remote.parse_tcp(s.tcp)  # a bad address fails now, before anything starts
        privatedir.ensure_private_dir(s.state_dir)
        privatedir.ensure_private_dir(s.data_dir)
        self._lock.acquire()
        report = self.start_report
        pool: WorkerPool | None = None
        try:
            report.stage("reading the data directory")
            self._compose(privatedir.load_or_create_key(s.state_dir))
            pool = self.pool
            self.table.store.spare_dirs.reset()
            for line in pool.records.stop_leftovers():
                log.warning(kv("leftover_worker", detail=line))
            self._size_for_fd_limit()
            # Forks a probe child: before any thread or zmq context exists.
            report.stage("finding how sessions can be sealed on this host")
            pool.sealing = sealing.detect(s, self.ctx.environ)
            if pool.sealing.mode is None:
                self._check_unsealed_preload()
            # Before the zygote starts: on v2 it must start in our leaf.
            pool.cgroups.start(s)
            lower_oom_score(pool.cgroups)
            log.info(
                kv(
                    "session_limits",
                    **cgroups.amend_limits(
                        sealing.describe_limits(s, pool.sealing), s, pool.cgroups
                    ),
                )
            )
            self._warn_model_exposure()
            become_subreaper()
            self.ctx.base_env = allowlisted(self.ctx.environ, s.pass_env)
            pool.on_preload_progress = report.preload
            report.stage("starting the zygote")
            pool.start_zygote()
            report.stage("opening the control socket")
            return asyncio.run(self._main())
        finally:
            if pool is not None and pool.zygote is not None:
                pool.zygote.close()
            if pool is not None:
                pool.cgroups.stop()
            for name in (statedir.CONTROL_SOCKET, statedir.WORKER_SOCKET):
                try:
                    (s.state_dir / name).unlink()
                except FileNotFoundError:
                    pass
            report.done()
            self._lock.release()

    # ------------------------------------------------------------ model gate

    def _warn_model_exposure(self) -> None:
        """Say at start where a model key would still reach every worker."""
        s = self.settings
        extra = [n for n in s.pass_env if n not in DEFAULT_PASS_ENV and not n.endswith("*")]
        template = s.runtime_config.get("template_home")
        for said in model_gate.exposure_warnings(s.runtime_config, [*extra, *s.env], template):
            log.warning(kv("model_key_exposed", detail=said))

    def _model_upstream(self, key: str) -> model_gate.Upstream | None:
        """The model endpoint a session's calls go to: that of the settings
        its worker started under (model_gate.py)."""
        session = self.table.get(key)
        settings = self.ctx.settings if session is None else self.ctx.settings_for(session)
        return model_gate.Upstream.from_config(settings.runtime_config)

    def _model_budgets(self) -> dict[str, int]:
        # Checked when the settings were read: parsing cannot fail here.
        return model_meter.parse_budgets(self.ctx.settings.model_budgets)

    def _count_model_call(
        self, key: str | None, outcome: str, usage: model_meter.Usage, sent: int, received: int
    ) -> None:
        metrics = self.ctx.metrics
        if metrics is not None:
            tokens = (usage.input_tokens, usage.output_tokens)
            metrics.count_model_call(key, outcome, tokens, sent, received)

    def _check_unsealed_preload(self) -> None:
        """hermes-agent's own modules may be preloaded only into a sealed
        zygote: sealed = auto that turned out unsealed refuses them."""
        try:
            configfile.check_preload(self.settings.preload, "off")
        except configfile.ConfigError as exc:
            why = self.ctx.settings.sealed
            raise sealing.SealingUnavailable(
                f"{exc} (sealed = {why}, but sessions run unsealed here)"
            ) from None

    def _size_for_fd_limit(self) -> None:
        """Raise our open-file limit to the hard limit and derive max_sessions
        from it: running out of descriptors aborts libzmq, so refuse first."""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard != resource.RLIM_INFINITY and soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        # Spares hold descriptors as sessions do.
        wanted = self.settings.max_sessions
        allowed = allowed_sessions(soft, self.settings.spare_workers, wanted)
        if wanted is not None and wanted > allowed:
            log.warning(
                kv(
                    "max_sessions_lowered",
                    wanted=wanted,
                    allowed=allowed,
                    fd_limit=soft,
                    hint="raise LimitNOFILE / ulimit -n to allow more",
                )
            )
        self.ctx.max_sessions = allowed
        log.info(kv("limits", fd_limit=soft, max_sessions=allowed))

    async def _main(self) -> int:
        loop = asyncio.get_running_loop()
        self._events = asyncio.Queue()
        self.endpoints.open(loop, self.front.on_frames, self.back.on_frames)
        self.start_report.done()  # clients connect from here on
        self.egress: EgressProxy | None = None
        if self.pool.sealing.mode is not None and self.pool.sealing.network != "host":
            self.egress = self._egress_proxy()
            self.egress.open(loop)
        if self.pool.sealing.mode == "root":
            sealing.open_worker_socket(self.settings.state_dir / statedir.WORKER_SOCKET)
        zygote = self.pool.zygote
        assert zygote is not None
        zygote.attach(loop)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(sig, self._events.put_nowait, ("signal", sig))
        log.info(
            kv(
                "ready",
                pid=os.getpid(),
                control=self.endpoints.control,
                runtime=self.settings.runtime,
                version=version(),
                sealed=self.pool.sealing.mode or "no",
            )
        )
        self._reap()  # anything that died before the handler was installed
        gc.collect()
        gc.freeze()
        gc.set_threshold(*gc.get_threshold()[:2], GC_NEVER)
        self.ctx.metrics = self._start_metrics()
        model_gate.install(
            model_gate.Gate(self._model_upstream, self._model_budgets, self._count_model_call)
        )
        self.notifier.send("READY=1", f"MAINPID={os.getpid()}", "STATUS=serving, no sessions yet")
        ticker = asyncio.create_task(self._tick_loop())
        watching = asyncio.create_task(self.lease_watch.run())
        leasing = asyncio.create_task(self.node_lease.run()) if self.node_lease else None
        self.pool.fill_spares()
        try:
            await self._main_loop()
        finally:
            ticker.cancel()
            watching.cancel()
            if leasing is not None:
                leasing.cancel()
            assert self.pool.zygote is not None
            self.pool.zygote.detach(loop)
            self.endpoints.close()
            if self.egress is not None:
                self.egress.close()
            self.notifier.close()
            if self.ctx.metrics is not None:
                self.ctx.metrics.close()
        log.info(kv("stopped", pid=os.getpid()))
        return 0

    # ------------------------------------------------------------- main loop

    async def _main_loop(self) -> None:
        assert self._events is not None
        shutdown: asyncio.Task[None] | None = None
        while True:
            get = asyncio.ensure_future(self._events.get())
            waiters: set[asyncio.Future[Any]] = {get}
            if shutdown is not None:
                waiters.add(shutdown)
            done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            if shutdown is not None and shutdown in done:
                get.cancel()
                shutdown.result()
                return
            kind, arg = get.result()
            if kind == "signal" and arg == signal.SIGCHLD:
                self._reap()
            elif kind == "signal" and arg == signal.SIGHUP:
                try:
                    self.reload()
                except RemoteProtocolError:
                    pass  # refused and logged; the old settings stay in force
            elif kind == "signal":
                name = signal.Signals(arg).name
                if shutdown is None:
                    log.info(kv("shutdown", signal=name))
                    self.notifier.send("STOPPING=1", f"STATUS=shutting down ({name})")
                    shutdown = asyncio.create_task(self._shutdown())
                elif arg == signal.SIGINT and not self.ctx.forced:
                    log.warning(kv("shutdown_forced", signal=name))
                    self.lifecycle.killer.force_kill_all()

    def _reap(self) -> None:
        """Collect every child that has exited (workers, orphans, the zygote)."""
        zygote = self.pool.zygote
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if zygote is not None and pid == zygote.pid:
                self.pool.on_zygote_exit(status)
                zygote = self.pool.zygote  # a new one, if it was restarted
            else:
                self.lifecycle.on_exit(pid, status)
            if self.egress is not None:
                self.egress.worker_gone(pid)  # its listener holds its namespace

    async def _tick_loop(self) -> None:
        """Heartbeats, limits and idle time, a few times a second."""
        self.health.begin(time.monotonic())
        while True:
            await asyncio.sleep(TICK)
            try:
                self._tick()
            except Exception:
                log.exception(kv("bug", where="tick"))

    def _tick(self) -> None:
        now = time.monotonic()
        if self.pool.spares_wanted():
            self.pool.fill_spares()  # one that died young waits out its back-off; a reload may trim
        if self.notifier.enabled:
            self._notify_systemd(now)
        if now >= self._next_full_gc:
            self._next_full_gc = now + FULL_GC_INTERVAL
            started = time.perf_counter()
            found = gc.collect()
            took = time.perf_counter() - started
            if took > 0.05:  # worth an operator's notice
                log.info(kv("full_gc", ms=round(took * 1000, 1), collected=found))
        self.health.tick(now, time.time())

    # ----------------------------------------------------------------- egress

    def _egress_proxy(self) -> EgressProxy:
        def lists() -> tuple[str, tuple[str, ...], tuple[str, ...]]:
            s = self.settings
            return s.network, s.egress_allow, s.egress_deny

        def own_ports() -> tuple[int, ...]:
            ports = []
            if self.settings.tcp:
                ports.append(parse_listen(self.settings.tcp, "tcp")[1])
            metrics = self.ctx.metrics
            if metrics is not None and metrics.server is not None:
                ports.append(int(metrics.server.server_address[1]))
            return tuple(ports)

        def session_of(pid: int) -> str | None:
            session = self.pool.by_pid.get(pid)
            if session is not None:
                return session.key
            return "(spare)" if pid in self.pool.spares.by_pid else None

        return EgressProxy(
            self.settings.state_dir,
            PolicySource(lists, own_ports),
            session_of,
            lambda: self.ctx.metrics,
        )

    # ---------------------------------------------------------- observability

    def _start_metrics(self) -> Metrics | None:
        if not self.settings.metrics:
            return None
        metrics = Metrics(self._metrics_snapshot)
        token = None
        if self.settings.metrics_token_file:
            token = read_token(self.settings.metrics_token_file)  # checked by `serve`
        url = metrics.serve(self.settings.metrics, token)
        log.info(kv("metrics", url=url, credentials="required" if token else "none"))
        host = metrics.server.server_address[0]
        if token is None and not ipaddress.ip_address(host.split("%")[0]).is_loopback:
            log.warning(
                kv(
                    "metrics_open",
                    url=url,
                    hint="anyone who reaches this address reads them; set metrics_token_file",
                )
            )
        return metrics

    def _metrics_snapshot(self) -> dict[str, Any]:
        """Read at scrape time, from the metrics thread: copies only."""
        counts = {state.value: 0 for state in State}
        counts.update(self.table.counts_by_state())
        me = psutil.Process()
        return {
            "sessions": counts,
            "queued_turns": self.turns.queued_total,
            "max_sessions": self.ctx.max_sessions,
            "spare_workers": len(self.pool.spares.by_pid),  # a len: safe from this thread
            "supervisor_rss_bytes": me.memory_info().rss,
            "supervisor_open_fds": me.num_fds(),
            # Each live session's cgroup as the kernel counts it (none without cgroups).
            "session_cgroups": self.pool.cgroups.usage_by_key(list(self.table.judged.values())),
        }

    def _notify_systemd(self, now: float) -> None:
        """WATCHDOG=1 from the main loop (so a stuck loop is caught) and a
        STATUS= line with session counts."""
        watchdog = self.notifier.watchdog
        if watchdog is not None and now >= self._next_watchdog:
            self.notifier.send("WATCHDOG=1")
            self._next_watchdog = now + watchdog / 2
        counts = self.table.counts_by_state()
        by_state = ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
        self.notifier.status(f"{len(self.table)} sessions" + (f": {by_state}" if by_state else ""))

    # ---------------------------------------------------------------- reload

    def reload(self) -> tuple[list[str], list[str]]:
        """Re-read the configuration file. New sessions get the new settings,
        running ones keep theirs until they restart; an invalid file is
        refused (RemoteProtocolError) and the old settings stay in force.
        systemd (Type=notify-reload) hears RELOADING=1 first and READY=1
        once it is over, whatever the outcome."""
        self.notifier.send("RELOADING=1", f"MONOTONIC_USEC={time.monotonic_ns() // 1000}")
        try:
            return self._reload_settings()
        finally:
            self.notifier.send("READY=1")

    def _reload_settings(self) -> tuple[list[str], list[str]]:
        old = self.settings
        if old.config_file is None:
            raise RemoteProtocolError(
                ErrorCode.BAD_CONFIG,
                "the supervisor was started without --config; nothing to reload",
            )
        try:
            new, changed, restart = configfile.reload_settings(old)
        except configfile.ConfigError as exc:
            log.error(kv("reload_refused", error=str(exc)))
            raise RemoteProtocolError(ErrorCode.BAD_CONFIG, f"reload refused: {exc}") from None
        self.ctx.settings = new
        self.ctx.base_env = allowlisted(self.ctx.environ, new.pass_env)
        self._size_for_fd_limit()
        self.health.judge_all_soon()  # limits and idle time may have changed
        log.info(
            kv(
                "reloaded",
                file=old.config_file,
                changed=",".join(changed) or "nothing",
                restart_needed=",".join(restart) or "nothing",
            )
        )
        return changed, restart

    # ---------------------------------------------------------------- shutdown

    async def _shutdown(self) -> None:
        """Stop taking turns, let running ones finish (up to the grace period),
        then stop every worker in parallel."""
        ctx, sessions = self.ctx, self.table.sessions
        ctx.accepting = False
        self.pool.kill_spares()
        for session in sessions.values():
            self.turns.fail_queue(
                session, ErrorCode.SHUTTING_DOWN, "the supervisor is shutting down"
            )
        deadline = time.monotonic() + self.settings.shutdown_grace
        while (
            not ctx.forced
            and time.monotonic() < deadline
            and any(s.state is State.BUSY for s in sessions.values())
        ):
            await asyncio.sleep(0.05)
        live = [s for s in sessions.values() if s.state in LIVE_STATES]
        await asyncio.gather(
            *(
                self.lifecycle.killer.kill_session(
                    s,
                    force=ctx.forced,
                    reason="the supervisor is shutting down",
                    code=ErrorCode.SHUTTING_DOWN,
                )
                for s in live
            )
        )
        # Let tasks that reply to kill requests send their answers.
        if ctx.tasks:
            await asyncio.wait(set(ctx.tasks), timeout=1.0)
        zygote = self.pool.zygote
        assert zygote is not None
        zygote_pid = zygote.pid
        zygote.close()
        if zygote_pid is not None:
            await self._wait_pid_gone(zygote_pid, 2.0)

    async def _wait_pid_gone(self, pid: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                return
            if done:
                return
            await asyncio.sleep(0.01)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
