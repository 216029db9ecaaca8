"""The supervisor: owns worker processes and routes messages between clients and them.

Theory of operation
-------------------
`Supervisor.run` prepares everything that must exist before any zmq context
or thread does (the state directory, the lock, the signing key, the subreaper
flag, the zygote) and then enters one asyncio loop.

Two ROUTER sockets are bound in the private state directory: `control.sock`
for clients (front ends, the CLI) and `workers.sock` for workers. Only the
supervisor binds; everyone else connects. Client frames are signed with the
shared key; each worker's frames with its own token, which is handed to it
through the zygote and never crosses a socket. A worker's routing id is
chosen by the supervisor, and its token proves it.

Frames are read and sent without blocking (a slow client is dropped, never
waited on); see channel.py for how the sockets are driven by the loop.
Signal handlers only put an event on a queue; the main loop reaps children.
A tick enforces heartbeats, limits and idle time. Long operations (spawn,
kill, shutdown) are tasks, so no command waits for another.

Every state change goes through `_transition`, which applies the table in
states.py and publishes the change to watchers. Every turn ends in exactly
one reply or error to its client, whatever happens to its worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
import resource
import secrets
import shutil
import signal
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from importlib import metadata
from typing import Any

import msgpack
import psutil
import zmq
from zmq.auth.thread import ThreadAuthenticator

from hermes_sup.protocol import (
    MAGIC,
    PROTOCOL_VERSION,
    ErrorCode,
    Kind,
    Limits,
    LocalProtocolError,
    Message,
    RemoteProtocolError,
    ReplayGuard,
    WorkerExit,
    check_session_key,
    decode,
    describe_exit,
    encode,
    error_message,
    sign,
)

from . import configfile, remote, statedir
from .channel import Channel
from .config import Settings
from .environment import allowlisted, check_policy, parse_options, worker_env
from .limits import TreeUsage, safe_max_sessions, scan_trees
from .logfmt import kv
from .logs import PipeReader, SessionLog, tail
from .metrics import Metrics, exit_category
from .notify import Notifier
from .process import WorkerProcess, become_subreaper, kill_processes
from .records import WorkerRecords
from .session import Session, Turn, open_session_dir, save_session_meta, session_path
from .spare_dirs import SpareDirs
from .spare_workers import Spare, SparePool
from .spawner import Zygote, ZygoteError
from .states import LIVE_STATES, Event, State

RUNNING_STATES = LIVE_STATES - {State.STOPPING}

log = logging.getLogger("hermes_sup.supervisor")

MAX_UNCLAIMED_EXITS = 4096
MAX_WATCHERS = 1024
# Answers kept so that a client resending a `send` with the same id after a
# timeout gets the same turn, never a second run of it.
DEDUP_ENTRIES = 10_000
TICK = 0.25
# An idle worker is hung after missing this many of its (slower) beats.
IDLE_BEATS_PER_TIMEOUT = 3
# A full garbage collection pauses the loop for about 0.8 us per tracked
# object here: 95 ms at 2,000 sessions. Python starts one whenever the heap
# has grown by a quarter, so while sessions are being added it kept landing
# in the middle of spawns. The supervisor starts them itself on a fixed
# clock instead (young cycles are still collected as usual, by generations
# 0 and 1), and freezes what it made at start-up, which lives as long as it.
FULL_GC_INTERVAL = 300.0
GC_NEVER = 1_000_000  # gen-1 collections before Python would start a full one
MIB = 1024 * 1024
# Event data larger than this is not kept in a session's replay history.
HISTORY_DATA_LIMIT = 8192
# Exits a worker chooses before it could have started a turn: a first turn
# handed over in its spawn request did not run, and may be tried again.
UNSTARTED_EXITS = frozenset({WorkerExit.BOOT_FAILED, WorkerExit.RUNTIME_LOAD_FAILED})
# A first turn longer than this waits for the worker's hello instead: the
# spawn request travels as one datagram, bounded by the socket's buffer.
HANDOVER_TEXT = 16 * 1024
MAX_LOG_TAIL = 100_000


def approx_size(data: Any) -> int:
    """About how many bytes `data` holds: its msgpack size (C speed; far
    cheaper than len(repr(data)))."""
    if isinstance(data, (str, bytes)):
        return len(data)
    try:
        return len(msgpack.packb(data))
    except (TypeError, ValueError, OverflowError):
        return len(repr(data))


def version() -> str:
    """The installed hermes-sup version."""
    try:
        return metadata.version("hermes-sup")
    except metadata.PackageNotFoundError:
        return "0+unknown"


@dataclass
class Watcher:
    """A client that asked to see state changes (of one session, or all)."""

    client: bytes
    id: str
    session: str | None


@dataclass
class SentTurn:
    """What the supervisor remembers of a `send`, for resends with the same id."""

    session: str
    turn: Turn | None
    final: Message | None = None


class Supervisor:
    """One supervisor process serving many sessions."""

    def __init__(self, settings: Settings, environ: dict[str, str] | None = None) -> None:
        self.settings = settings
        self.environ = dict(os.environ if environ is None else environ)
        # Taken out of the environment, so nothing we start can notify systemd.
        self.notifier = Notifier(os.environ if environ is None else self.environ)
        self.environ.pop("NOTIFY_SOCKET", None)
        self._next_watchdog = 0.0
        self.metrics: Metrics | None = None
        self.limits = Limits(max_frame_size=settings.max_frame_size)
        self.guard = ReplayGuard()
        self.sessions: dict[str, Session] = {}
        self.by_worker_id: dict[bytes, Session] = {}
        self.by_pid: dict[int, Session] = {}
        self.unclaimed_exits: dict[int, int] = {}
        self.watchers: dict[str, Watcher] = {}
        self.sent: OrderedDict[str, SentTurn] = OrderedDict()
        self.queued_total = 0
        self.running = 0  # sessions with a worker that is not being stopped
        # The runtimes (name and config) whose workers have said hello: a
        # first turn is handed over in the spawn request only to those.
        self.runtimes_started: set[str] = set()
        self.max_sessions = settings.max_sessions or 1
        self.accepting = True
        self.forced = False
        self.started = time.time()
        self.key = b""
        self.base_env: dict[str, str] = {}
        self.zygote: Zygote | None = None
        self.records: WorkerRecords | None = None
        self.spare_dirs = SpareDirs(settings.data_dir)
        self._lock = statedir.InstanceLock(settings.state_dir)
        self._events: asyncio.Queue[tuple[str, Any]] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._cull_pending = False
        # Spawns between the request to the zygote and the registration of
        # the new pid: the worker is already our child but not yet known.
        self._spawning = 0
        self.spare_workers = SparePool()
        self._scanning = False
        self._next_scan = 0.0
        self._next_full_gc = time.monotonic() + FULL_GC_INTERVAL
        self._front_handlers: dict[Kind, Callable[[bytes, Message], None]] = {
            Kind.PING: self._on_ping,
            Kind.OPEN: self._on_open,
            Kind.SEND: self._on_send,
            Kind.CANCEL: self._on_cancel,
            Kind.LIST: self._on_list,
            Kind.KILL: self._on_kill,
            Kind.WATCH: self._on_watch,
            Kind.UNWATCH: self._on_unwatch,
            Kind.LOGS: self._on_logs,
            Kind.STATUS: self._on_status,
            Kind.APPROVE: self._on_approve,
            Kind.RELOAD: self._on_reload,
        }

    # ------------------------------------------------------------------ start

    def run(self) -> int:
        """Start, serve until SIGTERM/SIGINT, shut down. Returns an exit status."""
        s = self.settings
        statedir.ensure_private_dir(s.state_dir)
        statedir.ensure_private_dir(s.data_dir)
        self.control_endpoint = statedir.endpoint(s.state_dir, statedir.CONTROL_SOCKET)
        self.worker_endpoint = statedir.endpoint(s.state_dir, statedir.WORKER_SOCKET)
        self.tcp_endpoint: str | None = None
        if s.tcp:
            remote.parse_tcp(s.tcp)  # a bad address fails now, before anything starts
        self._lock.acquire()
        try:
            self.key = statedir.load_or_create_key(s.state_dir)
            self.records = WorkerRecords(s.state_dir)
            self.spare_dirs.reset()
            for line in self.records.stop_leftovers():
                log.warning(kv("leftover_worker", detail=line))
            self._size_for_fd_limit()
            become_subreaper()
            self.base_env = allowlisted(self.environ, s.pass_env)
            self._start_zygote()
            return asyncio.run(self._main())
        finally:
            if self.zygote is not None:
                self.zygote.close()
            for name in (statedir.CONTROL_SOCKET, statedir.WORKER_SOCKET):
                try:
                    (s.state_dir / name).unlink()
                except FileNotFoundError:
                    pass
            self._lock.release()

    def _size_for_fd_limit(self) -> None:
        """Raise our open-file limit to the hard limit and derive max_sessions
        from it: running out of descriptors aborts libzmq, so refuse first."""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard != resource.RLIM_INFINITY and soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        # Spares hold descriptors as sessions do.
        safe = max(1, safe_max_sessions(soft) - self.settings.spare_workers)
        wanted = self.settings.max_sessions
        if wanted is not None and wanted > safe:
            log.warning(
                kv(
                    "max_sessions_lowered",
                    wanted=wanted,
                    allowed=safe,
                    fd_limit=soft,
                    hint="raise LimitNOFILE / ulimit -n to allow more",
                )
            )
        self.max_sessions = min(wanted or safe, safe)
        log.info(kv("limits", fd_limit=soft, max_sessions=self.max_sessions))

    def _start_zygote(self) -> None:
        home = self.settings.data_dir / "zygote-home"
        statedir.ensure_private_dir(home)
        env = dict(self.base_env)
        # The zygote's own HERMES_HOME stays empty: anything preloaded that
        # captured a path at import would show up there, not in a session.
        env["HERMES_HOME"] = str(home)
        if "PYTHONPATH" in self.environ:
            env["PYTHONPATH"] = self.environ["PYTHONPATH"]
        self.zygote = Zygote(self.settings.preload, env, cwd=str(self.settings.data_dir))
        ready = self.zygote.start()
        if ready.get("failed"):
            for mod, why in ready["failed"].items():
                log.error(kv("preload_failed", module=mod, error=why))
        log.info(
            kv(
                "zygote_ready",
                pid=ready.get("pid"),
                preloaded=",".join(ready.get("loaded", [])),
                seconds=f"{ready.get('seconds', 0):.3f}",
            )
        )

    async def _main(self) -> int:
        loop = asyncio.get_running_loop()
        self._events = asyncio.Queue()
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        # Client ids are the routing id behind one byte naming the socket
        # (0: the local control socket, 1: TCP), and replies are signed with
        # that socket's key.
        self.fronts: list[tuple[Channel, bytes]] = [
            (Channel(self._bind(self.control_endpoint), partial(self._on_front, 0), loop), self.key)
        ]
        self.tcp_monitor: Channel | None = None
        self.auth = self._start_tcp(loop)
        self.back = Channel(self._bind(self.worker_endpoint), self._on_back, loop)
        assert self.zygote is not None
        self.zygote.attach(loop)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(sig, self._events.put_nowait, ("signal", sig))
        log.info(
            kv(
                "ready",
                pid=os.getpid(),
                control=self.control_endpoint,
                runtime=self.settings.runtime,
                version=version(),
            )
        )
        self._reap()  # anything that died before the handler was installed
        gc.collect()
        gc.freeze()
        gc.set_threshold(*gc.get_threshold()[:2], GC_NEVER)
        self.metrics = self._start_metrics()
        self.notifier.send("READY=1", f"MAINPID={os.getpid()}", "STATUS=serving, no sessions yet")
        ticker = asyncio.create_task(self._tick_loop())
        self._fill_spares()
        try:
            await self._main_loop()
        finally:
            ticker.cancel()
            self.zygote.detach(loop)
            for channel, _ in self.fronts:
                channel.close()
            self.back.close()
            if self.tcp_monitor is not None:
                self.tcp_monitor.close()
            if self.auth is not None:
                self.auth.stop()
            self.ctx.term()
            self.notifier.close()
            if self.metrics is not None:
                self.metrics.close()
        log.info(kv("stopped", pid=os.getpid()))
        return 0

    def _start_tcp(self, loop: asyncio.AbstractEventLoop) -> ThreadAuthenticator | None:
        """The CURVE endpoint for remote front ends, if configured."""
        s = self.settings
        if not s.tcp:
            return None
        host, port = remote.parse_tcp(s.tcp)
        public, secret = remote.server_keys(s.data_dir)
        # The ZAP handler must run before the socket binds: without one,
        # libzmq lets every CURVE key in.
        auth = ThreadAuthenticator(self.ctx, log=logging.getLogger("hermes_sup.zap"))
        auth.start()
        auth.configure_curve_callback(remote.ZAP_DOMAIN, remote.Allowlist(s.data_dir))
        sock = self._router()
        sock.curve_server = True
        sock.curve_publickey = public
        sock.curve_secretkey = secret
        sock.zap_domain = remote.ZAP_DOMAIN.encode()
        self.tcp_endpoint = remote.tcp_endpoint(host, port)
        try:
            sock.bind(self.tcp_endpoint)
        except zmq.ZMQError as exc:
            sock.close(0)
            auth.stop()
            raise remote.RemoteError(f"cannot listen on {self.tcp_endpoint}: {exc}") from None
        self.fronts.append(
            (Channel(sock, partial(self._on_front, 1), loop), remote.remote_hmac_key(s.data_dir))
        )
        # Peers that fail the handshake (no CURVE, wrong server key) never
        # reach ZAP; the socket's monitor is the only place they show.
        monitor = sock.get_monitor_socket(remote.HANDSHAKE_FAILURES)
        self.tcp_monitor = Channel(monitor, remote.log_handshake_failure, loop)
        log.info(
            kv(
                "tcp_ready",
                endpoint=self.tcp_endpoint,
                server_public=public.decode(),
                allowed=len(remote.allowed(s.data_dir)),
            )
        )
        return auth

    def _router(self) -> zmq.Socket[bytes]:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # Sends to a peer that is gone raise instead of vanishing silently.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # Frames a little over the limit reach decode and get a clear too_large
        # reply; far over it, zmq drops the peer before buffering the frame.
        limit = self.settings.max_frame_size
        sock.setsockopt(zmq.MAXMSGSIZE, limit + limit // 4 + 4096)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        return sock

    def _bind(self, endpoint: str) -> zmq.Socket[bytes]:
        sock = self._router()
        path = endpoint.removeprefix("ipc://")
        if os.path.exists(path):
            os.unlink(path)  # stale socket of a dead supervisor: we hold the lock
        old = os.umask(0o177)
        try:
            sock.bind(endpoint)
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        return sock

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
                    self._reload()
                except RemoteProtocolError:
                    pass  # refused and logged; the old settings stay in force
            elif kind == "signal":
                name = signal.Signals(arg).name
                if shutdown is None:
                    log.info(kv("shutdown", signal=name))
                    self.notifier.send("STOPPING=1", f"STATUS=shutting down ({name})")
                    shutdown = asyncio.create_task(self._shutdown())
                elif arg == signal.SIGINT and not self.forced:
                    log.warning(kv("shutdown_forced", signal=name))
                    self._force_kill_all()

    async def _tick_loop(self) -> None:
        """Heartbeats, limits and idle time, a few times a second."""
        while True:
            await asyncio.sleep(TICK)
            try:
                self._tick()
            except Exception:
                log.exception(kv("bug", where="tick"))

    def _tick(self) -> None:
        now = time.monotonic()
        wall = time.time()
        s = self.settings
        if len(self.spare_workers) != s.spare_workers:
            self._fill_spares()  # one that died young waits out its back-off; a reload may trim
        if self.notifier.enabled:
            self._notify_systemd(now)
        if now >= self._next_full_gc:
            self._next_full_gc = now + FULL_GC_INTERVAL
            started = time.perf_counter()
            found = gc.collect()
            took = time.perf_counter() - started
            if took > 0.05:  # worth an operator's notice
                log.info(kv("full_gc", ms=round(took * 1000, 1), collected=found))
        for session in list(self.sessions.values()):
            own = session.settings or s
            if session.state in (State.IDLE, State.BUSY) and session.proc is not None:
                silent = now - session.last_heartbeat
                limit = own.heartbeat_timeout
                if session.state is State.IDLE:
                    limit = max(limit, IDLE_BEATS_PER_TIMEOUT * own.idle_heartbeat_interval)
                if silent > limit and not session.hang_signalled:
                    self._on_hang(session, silent)
            if (
                own.idle_timeout is not None
                and self.accepting
                and session.state is State.IDLE
                and not session.queue
                and wall - session.last_activity > own.idle_timeout
            ):
                idle = wall - session.last_activity
                self._spawn_task(
                    self._kill_session(session, force=False, reason=f"idle for {idle:.0f}s")
                )
        if (
            now >= self._next_scan
            and not self._scanning
            and any(
                x.memory_limit_mb or x.max_procs
                for x in [s, *(v.settings for v in self.sessions.values() if v.settings)]
            )
        ):
            self._next_scan = now + s.limits_interval
            self._spawn_task(self._check_limits())

    def _start_metrics(self) -> Metrics | None:
        if not self.settings.metrics:
            return None
        metrics = Metrics(self._metrics_snapshot)
        url = metrics.serve(self.settings.metrics)
        log.info(kv("metrics", url=url))
        return metrics

    def _metrics_snapshot(self) -> dict[str, Any]:
        """Read at scrape time, from the metrics thread: copies only."""
        counts = {state.value: 0 for state in State}
        counts.update(self._counts_by_state())
        me = psutil.Process()
        return {
            "sessions": counts,
            "queued_turns": self.queued_total,
            "max_sessions": self.max_sessions,
            "spare_workers": len(self.spare_workers.by_pid),  # a len: safe from this thread
            "supervisor_rss_bytes": me.memory_info().rss,
            "supervisor_open_fds": me.num_fds(),
        }

    def _notify_systemd(self, now: float) -> None:
        """WATCHDOG=1 from the main loop (so a stuck loop is caught) and a
        STATUS= line with session counts."""
        watchdog = self.notifier.watchdog
        if watchdog is not None and now >= self._next_watchdog:
            self.notifier.send("WATCHDOG=1")
            self._next_watchdog = now + watchdog / 2
        counts = self._counts_by_state()
        by_state = ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
        self.notifier.status(
            f"{len(self.sessions)} sessions" + (f": {by_state}" if by_state else "")
        )

    def _counts_by_state(self) -> dict[str, int]:
        """How many sessions are in each state (only states that occur).
        Copies the session list first: the metrics thread calls this too."""
        return dict(Counter(session.state.value for session in list(self.sessions.values())))

    def _spawn_task(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error(kv("bug", where="task"), exc_info=task.exception())

    # ---------------------------------------------------------------- clients

    def _send_client(self, client: bytes, msg: Message, payload: bytes | None = None) -> bool:
        """Send to a client without blocking; False if it is gone or too slow.
        `payload` is a worker's own envelope that already says what `msg`
        says (same session, same `re`): it is re-signed, not re-encoded."""
        channel, key = self.fronts[client[0]]
        try:
            if payload is not None:
                frames = [MAGIC, sign(key, payload), payload]
            else:
                frames = encode(msg, key, self.limits)
        except LocalProtocolError as exc:
            log.error(kv("unsendable", kind=msg.kind.value, error=exc.message))
            frames = encode(
                error_message(
                    ErrorCode.INTERNAL.value, exc.message, re=msg.re, session=msg.session
                ),
                key,
            )
        try:
            channel.send([client[1:], *frames])
            return True
        except zmq.Again:
            log.warning(kv("client_slow_dropped", kind=msg.kind.value, re=msg.re))
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            log.debug(kv("client_gone", kind=msg.kind.value, re=msg.re))
        return False

    def _error(
        self, client: bytes, code: ErrorCode, message: str, re: str | None, session: str | None
    ) -> None:
        self._send_client(client, error_message(code.value, message, re=re, session=session))

    def _on_front(self, index: int, frames: list[bytes]) -> None:
        if len(frames) < 2:
            return
        client, rest = bytes([index]) + frames[0], frames[1:]
        try:
            msg = decode(rest, self.fronts[index][1], self.limits)
            if msg.kind is Kind.SEND and msg.id in self.sent:
                self._on_resend(client, msg)
                return
            now = time.time()
            self.guard.check(msg.id, msg.ts, now)
            if msg.ttl is not None and now - msg.ts > msg.ttl:
                # Its sender has stopped waiting and told its caller it failed.
                raise RemoteProtocolError(
                    ErrorCode.EXPIRED,
                    f"the {msg.kind.value!r} request arrived {now - msg.ts:.1f}s after it was "
                    f"sent, past its {msg.ttl:g}s time to live; it was not carried out",
                    msg_id=msg.id,
                )
        except RemoteProtocolError as exc:
            log.warning(kv("bad_request", code=exc.code.value, error=exc.message))
            self._error(client, exc.code, exc.message, exc.msg_id, None)
            return
        handler = self._front_handlers.get(msg.kind)
        if handler is None:
            self._error(
                client,
                ErrorCode.UNKNOWN_KIND,
                f"{msg.kind.value!r} is not a request a client can send",
                msg.id,
                msg.session,
            )
            return
        try:
            handler(client, msg)
        except RemoteProtocolError as exc:
            self._error(client, exc.code, exc.message, msg.id, msg.session)
        except Exception as exc:
            log.exception(kv("bug", kind=msg.kind.value))
            self._error(client, ErrorCode.INTERNAL, f"internal error: {exc}", msg.id, msg.session)

    def _on_resend(self, client: bytes, msg: Message) -> None:
        """A `send` with an id we already took: the same turn, never a second run."""
        record = self.sent[msg.id]
        if record.final is not None:
            self._send_client(client, record.final)
            return
        if record.turn is not None:
            record.turn.client = client  # the rest of the turn goes to the resender
        self._send_client(
            client,
            msg.reply(Kind.EVENT, {"type": "status", "data": {"state": "duplicate"}}),
        )

    def _on_ping(self, client: bytes, msg: Message) -> None:
        self._send_client(
            client,
            msg.reply(
                Kind.PONG,
                {
                    "version": version(),
                    "protocol": PROTOCOL_VERSION,
                    "pid": os.getpid(),
                    "uptime": time.time() - self.started,
                },
            ),
        )

    def _session_for(self, key: str, raw_options: object) -> Session:
        """Find or create a session; new options on a running one are a conflict."""
        options = parse_options(raw_options) if raw_options is not None else None
        if options is not None:
            s = self.settings
            check_policy(options, s.workspace_roots, (s.runtime, *s.runtimes))
        session = self.sessions.get(key)
        if session is None:
            path = session_path(self.settings.data_dir, key)
            fresh = not path.exists()
            stored = None if fresh else open_session_dir(self.settings.data_dir, key)[1]
            defaults = parse_options(self.settings.session_defaults or None)
            session = Session(key=key, dir=path, options=options or stored or defaults)
            s = self.settings
            session.log = SessionLog(session.log_path, s.log_max_bytes, s.log_backups)
            session.history = deque(maxlen=s.history)
            if fresh:
                session.unsaved = True  # written once its worker is asked for
            else:
                save_session_meta(session)
            self.sessions[key] = session
            log.info(kv("session_new", session=key, dir=path.name))
        elif options is not None and options != session.options:
            if session.state in LIVE_STATES:
                raise RemoteProtocolError(
                    ErrorCode.SESSION_CONFLICT,
                    f"session {key!r} is running with other options; kill it to apply new ones",
                )
            session.options = options
            if not session.unsaved:
                save_session_meta(session)
        return session

    def _check_runnable(self, session: Session) -> None:
        """Refuse turns for a failed session (until its cool-down) and when
        there is no room for another worker."""
        if session.state is State.FAILED:
            left = session.retry_at - time.monotonic()
            if left > 0:
                raise RemoteProtocolError(
                    ErrorCode.SESSION_FAILED,
                    f"session {session.key!r} has failed: its worker {session.last_exit}. "
                    f"Kill it to retry now, or wait {left:.0f}s",
                )
            self._transition(session, Event.CLEAR, "cool-down passed")
            session.fast_failures = 0
        if session.state in (State.EXITED, State.BACKOFF):
            self._make_room(session)

    def _make_room(self, session: Session) -> None:
        """Before a new worker: stop the least recently used idle session if
        we are at max_sessions, or refuse with `overloaded`."""
        if self.running < self.max_sessions:
            return  # counted at every transition: no scan of every session per spawn
        idle = [
            s
            for s in self.sessions.values()
            if s.state is State.IDLE and not s.queue and s is not session
        ]
        if not idle:
            raise RemoteProtocolError(
                ErrorCode.OVERLOADED,
                f"all {self.max_sessions} session slots are busy; try again shortly",
            )
        victim = min(idle, key=lambda s: s.last_activity)
        log.info(kv("evict", session=victim.key, for_session=session.key))
        self._spawn_task(
            self._kill_session(
                victim,
                force=False,
                reason=f"evicted to make room (max_sessions {self.max_sessions})",
            )
        )

    def _on_open(self, client: bytes, msg: Message) -> None:
        key = check_session_key(msg.session)
        self._check_accepting()
        created = key not in self.sessions or self.sessions[key].state is State.EXITED
        session = self._session_for(key, msg.body.get("options"))
        self._check_runnable(session)
        if session.state is State.EXITED:
            self._start_worker(session)
        session.touch()
        self._send_client(
            client,
            msg.reply(
                Kind.OPENED,
                {"pid": session.pid, "state": session.state.value, "created": created},
            ),
        )

    def _on_send(self, client: bytes, msg: Message) -> None:
        key = check_session_key(msg.session)
        self._check_accepting()
        session = self._session_for(key, msg.body.get("options"))
        s = self.settings
        # Refuse a full queue before making room: that may evict another session.
        if len(session.queue) >= s.max_queue or self.queued_total >= s.max_queued_total:
            raise RemoteProtocolError(
                ErrorCode.BUSY,
                f"session {key!r} already has {len(session.queue)} turns waiting "
                f"(limit {s.max_queue}; {self.queued_total} waiting in all, limit "
                f"{s.max_queued_total}); try again when it catches up",
            )
        self._check_runnable(session)
        turn = Turn(id=msg.id, client=client, text=msg.body["text"])
        self._enqueue(session, turn)
        self._remember(msg.id, SentTurn(session=key, turn=turn))
        session.touch()
        if session.state is State.IDLE and len(session.queue) == 1:
            self._pump(session)  # runs now: its `running` status is the acknowledgement
            return
        position = len(session.queue)
        if session.state is State.EXITED:
            self._start_worker(session)  # first: the fork starts while we answer
        elif session.state is State.BACKOFF:
            self._schedule_retry(session)
        # Acknowledge at once, so a client can tell a slow turn from a dead supervisor.
        self._send_client(
            client,
            msg.reply(
                Kind.EVENT,
                {"type": "status", "data": {"state": "queued", "position": position}},
            ),
        )
        self._pump(session)

    def _remember(self, msg_id: str, record: SentTurn) -> None:
        self.sent[msg_id] = record
        while len(self.sent) > DEDUP_ENTRIES:
            self.sent.popitem(last=False)

    def _on_cancel(self, client: bytes, msg: Message) -> None:
        key = check_session_key(msg.session)
        session = self._require(key)
        target = msg.body.get("turn")
        cancelled: str | None = None
        if session.current is not None and target in (None, session.current.id):
            cancelled = session.current.id
            if session.state is State.STARTING:
                # Handed over in the spawn request; the worker cannot hear
                # us before its hello, so the cancel goes right after it.
                session.cancel_on_hello = cancelled
            else:
                self._send_worker(session, Message(Kind.CANCEL, {"turn": cancelled}, session=key))
        elif target is not None:
            for turn in list(session.queue):
                if turn.id == target:
                    session.queue.remove(turn)
                    self.queued_total -= 1
                    cancelled = turn.id
                    self._cancelled_unstarted(session, turn)
        self._send_client(client, msg.reply(Kind.CANCELLED, {"turn": cancelled}))

    def _on_list(self, client: bytes, msg: Message) -> None:
        prefix = msg.body.get("prefix", "")
        state = msg.body.get("state")
        chosen = [
            s
            for key, s in sorted(self.sessions.items())
            if key.startswith(prefix) and (state is None or s.state.value == state)
        ]
        self._spawn_task(self._list_reply(client, msg, chosen))

    async def _list_reply(self, client: bytes, msg: Message, chosen: list[Session]) -> None:
        """Answer `list` with stats sampled now (psutil, in a thread), never
        from a background stats loop."""
        pids = [s.pid for s in chosen if s.pid is not None]
        usage: dict[int, TreeUsage] = {}
        if pids:
            usage = await asyncio.get_running_loop().run_in_executor(None, scan_trees, pids, True)
        now = time.monotonic()
        rows = []
        for s in chosen:
            row = s.describe()
            row["runtime"] = self.settings.runtime
            use = usage.get(s.pid) if s.pid is not None else None
            if use is None:
                row.update(rss=None, cpu_percent=None, procs=None)
            else:
                since = s.cpu_sample if s.cpu_sample is not None else (0.0, s.spawned_mono)
                elapsed = max(now - since[1], 1e-6)
                row.update(
                    rss=use.rss,
                    procs=use.procs,
                    cpu_percent=round(max(0.0, use.cpu - since[0]) / elapsed * 100, 1),
                )
                s.cpu_sample = (use.cpu, now)
            rows.append(row)
        self._send_client(client, msg.reply(Kind.SESSIONS, {"sessions": rows}))

    def _on_status(self, client: bytes, msg: Message) -> None:
        counts = self._counts_by_state()
        me = psutil.Process()
        with me.oneshot():
            rss, fds = me.memory_info().rss, me.num_fds()
        info = {
            "pid": os.getpid(),
            "version": version(),
            "protocol": PROTOCOL_VERSION,
            "uptime": time.time() - self.started,
            "started": self.started,
            "runtime": self.settings.runtime,
            "endpoints": {
                "control": self.control_endpoint,
                "workers": self.worker_endpoint,
                "tcp": self.tcp_endpoint,
            },
            "state_dir": str(self.settings.state_dir),
            "data_dir": str(self.settings.data_dir),
            "zygote_pid": self.zygote.pid if self.zygote else None,
            "sessions": counts,
            "total_sessions": len(self.sessions),
            "max_sessions": self.max_sessions,
            "spare_workers": self.spare_workers.ready_count(),
            "queued": self.queued_total,
            "rss": rss,
            "fds": fds,
            "fd_limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
            "accepting": self.accepting,
        }
        self._send_client(client, msg.reply(Kind.INFO, {"supervisor": info}))

    def _on_kill(self, client: bytes, msg: Message) -> None:
        key = check_session_key(msg.session)
        session = self._require(key)
        force = bool(msg.body.get("force", False))
        purge = bool(msg.body.get("purge", False))

        async def kill_and_reply() -> None:
            pid, reason = await self._kill_session(session, force=force)
            if purge and session.state is State.EXITED and self.sessions.get(key) is session:
                self._purge(session)
                reason += ", data purged"
            self._send_client(client, msg.reply(Kind.KILLED, {"pid": pid, "reason": reason}))

        self._spawn_task(kill_and_reply())

    def _purge(self, session: Session) -> None:
        """Forget a stopped session and delete its data (kill --purge)."""
        if session.log is not None:
            session.log.close()
        shutil.rmtree(session.dir, ignore_errors=True)
        del self.sessions[session.key]
        log.info(kv("purged", session=session.key))

    def _on_watch(self, client: bytes, msg: Message) -> None:
        if msg.session is not None:
            check_session_key(msg.session)
        if len(self.watchers) >= MAX_WATCHERS:
            raise RemoteProtocolError(ErrorCode.BUSY, f"too many watchers (limit {MAX_WATCHERS})")
        self.watchers[msg.id] = Watcher(client, msg.id, msg.session)
        self._send_client(client, msg.reply(Kind.EVENT, {"type": "watching", "data": None}))
        replay = msg.body.get("replay", 0)
        session = self.sessions.get(msg.session) if msg.session else None
        if replay > 0 and session is not None:
            for _event_type, body in list(session.history)[-replay:]:
                self._send_client(
                    client,
                    Message(Kind.EVENT, {**body, "replayed": True}, session=session.key, re=msg.id),
                )

    def _on_unwatch(self, client: bytes, msg: Message) -> None:
        watch_id = msg.body["watch"]
        watcher = self.watchers.get(watch_id)
        if watcher is not None and watcher.client == client:
            del self.watchers[watch_id]
        for session in self.sessions.values():
            if session.log_followers.get(watch_id) == client:
                del session.log_followers[watch_id]
        self._send_client(client, msg.reply(Kind.EVENT, {"type": "unwatched", "data": None}))

    def _on_logs(self, client: bytes, msg: Message) -> None:
        key = check_session_key(msg.session)
        session = self._require(key)
        count = max(0, min(int(msg.body.get("lines", 50)), MAX_LOG_TAIL))
        lines = tail(session.log_path, count, self.settings.log_backups) if count else []
        self._send_client(client, msg.reply(Kind.LOG_LINES, {"lines": lines}))
        if msg.body.get("follow"):
            session.log_followers[msg.id] = client

    def _on_log_lines(self, session: Session, lines: list[str]) -> None:
        for watch_id, client in list(session.log_followers.items()):
            for line in lines:
                msg = Message(
                    Kind.EVENT, {"type": "log", "data": line}, session=session.key, re=watch_id
                )
                if not self._send_client(client, msg):
                    session.log_followers.pop(watch_id, None)
                    break

    def _read_pipe(self, session: Session, reader: PipeReader) -> None:
        """Move a worker's output into its log; at end of file, stop reading."""
        if not reader.drain():
            asyncio.get_running_loop().remove_reader(reader.fd)
            reader.close()
            if session.pipe is reader:
                session.pipe = None

    def _publish(
        self,
        session: Session,
        event_type: str,
        data: Any,
        turn: str | None = None,
        bound: int | None = None,
    ) -> None:
        """Record an event in the session's history and send it to every
        watcher of the session; forget watchers that are gone. `bound` is an
        upper bound on the size of `data` when one is known for free (the
        payload it came in), which spares measuring it."""
        body: dict[str, Any] = {"type": event_type, "data": data}
        if turn is not None:
            body["turn"] = turn
        kept = body
        size = bound if bound is not None and bound <= HISTORY_DATA_LIMIT else approx_size(data)
        if size > HISTORY_DATA_LIMIT:
            kept = {**body, "data": f"({size} bytes not kept)"}
        session.history.append((event_type, kept))
        for watcher in list(self.watchers.values()):
            if watcher.session not in (None, session.key):
                continue
            msg = Message(Kind.EVENT, body, session=session.key, re=watcher.id)
            if not self._send_client(watcher.client, msg):
                self.watchers.pop(watcher.id, None)

    def _on_approve(self, client: bytes, msg: Message) -> None:
        """An answer to an approval request of the running turn, for its worker."""
        key = check_session_key(msg.session)
        session = self._require(key)
        choice = msg.body["choice"]
        if choice not in ("once", "session", "always", "deny"):
            raise RemoteProtocolError(
                ErrorCode.BAD_FIELD,
                f"approval choice {choice[:20]!r} is not once, session, always or deny",
            )
        turn = session.current
        if turn is None or not self._send_worker(
            session, Message(Kind.APPROVE, {"choice": choice}, session=key)
        ):
            raise RemoteProtocolError(
                ErrorCode.NOTHING_TO_APPROVE, f"session {key!r} has no running turn to approve"
            )
        self._publish(session, "approval_answer", {"choice": choice}, turn=turn.id)
        self._send_client(client, msg.reply(Kind.APPROVED, {"choice": choice, "turn": turn.id}))

    def _on_reload(self, client: bytes, msg: Message) -> None:
        changed, restart = self._reload()
        self._send_client(
            client, msg.reply(Kind.RELOADED, {"changed": changed, "restart_needed": restart})
        )

    def _reload(self) -> tuple[list[str], list[str]]:
        """Re-read the configuration file. New sessions get the new settings,
        running ones keep theirs until they restart; an invalid file is
        refused (RemoteProtocolError) and the old settings stay in force."""
        old = self.settings
        if old.config_file is None:
            raise RemoteProtocolError(
                ErrorCode.BAD_CONFIG,
                "the supervisor was started without --config; nothing to reload",
            )
        base = Settings(state_dir=old.state_dir, data_dir=old.data_dir)
        try:
            new = configfile.build(base, old.config_file, old.overrides)
        except configfile.ConfigError as exc:
            log.error(kv("reload_refused", error=str(exc)))
            raise RemoteProtocolError(ErrorCode.BAD_CONFIG, f"reload refused: {exc}") from None
        new.config_file, new.overrides = old.config_file, old.overrides
        if "preload" not in old.overrides and new.preload == ():
            new.preload = old.preload  # computed at start (e.g. for hermes), not from the file
        restart = [f for f in configfile.RESTART_FIELDS if getattr(new, f) != getattr(old, f)]
        for name in restart:
            setattr(new, name, getattr(old, name))
        changed = [
            f.name
            for f in dataclasses.fields(Settings)
            if f.name not in configfile.META_FIELDS and getattr(new, f.name) != getattr(old, f.name)
        ]
        self.settings = new
        self.base_env = allowlisted(self.environ, new.pass_env)
        self._size_for_fd_limit()
        log.info(
            kv(
                "reloaded",
                file=old.config_file,
                changed=",".join(changed) or "nothing",
                restart_needed=",".join(restart) or "nothing",
            )
        )
        return changed, restart

    def _require(self, key: str) -> Session:
        session = self.sessions.get(key)
        if session is None:
            raise RemoteProtocolError(ErrorCode.NO_SUCH_SESSION, f"no session {key!r}")
        return session

    def _check_accepting(self) -> None:
        if not self.accepting:
            raise RemoteProtocolError(
                ErrorCode.SHUTTING_DOWN, "the supervisor is shutting down; try again after restart"
            )

    # ---------------------------------------------------------------- turns

    def _transition(self, session: Session, event: Event, reason: str | None = None) -> None:
        previous = session.state
        session.advance(event)
        self.running += (session.state in RUNNING_STATES) - (previous in RUNNING_STATES)
        self._publish(
            session,
            "state",
            {
                "state": session.state.value,
                "previous": previous.value,
                "pid": session.pid,
                "reason": reason,
            },
            bound=128 + 4 * len(reason or ""),  # UTF-8: at most 4 bytes a character
        )

    def _enqueue(self, session: Session, turn: Turn) -> None:
        session.queue.append(turn)
        self.queued_total += 1

    def _finish(
        self, turn: Turn, session: Session, final: Message, payload: bytes | None = None
    ) -> None:
        """Give a turn its one final answer (and remember it for resends)."""
        record = self.sent.get(turn.id)
        if record is not None:
            record.final = final
            record.turn = None
        self._send_client(turn.client, final, payload)
        self._publish(
            session,
            "reply" if final.kind is Kind.REPLY else "error",
            final.body,
            turn=turn.id,
            bound=None if payload is None else len(payload),
        )
        if self.metrics is not None:
            outcome = "reply" if final.kind is Kind.REPLY else str(final.body.get("code"))
            self.metrics.turns.labels(outcome).inc()
            if turn.started_at is not None:
                self.metrics.turn_seconds.observe(time.monotonic() - turn.started_at)

    def _cancelled_unstarted(self, session: Session, turn: Turn) -> None:
        """End a turn that was cancelled before any worker ran it."""
        self._finish(
            turn,
            session,
            error_message(
                ErrorCode.TURN_FAILED.value,
                "cancelled before it started",
                re=turn.id,
                session=session.key,
            ),
        )

    def _fail_queue(self, session: Session, code: ErrorCode, text: str) -> None:
        while session.queue:
            turn = session.queue.popleft()
            self.queued_total -= 1
            self._finish(
                turn, session, error_message(code.value, text, re=turn.id, session=session.key)
            )

    def _pump(self, session: Session) -> None:
        """Hand the next queued turn to an idle worker."""
        if session.state is not State.IDLE or session.current is not None or not session.queue:
            return
        turn = session.queue.popleft()
        self.queued_total -= 1
        session.current = turn
        self._begin(session, turn, handed=False)

    def _begin(self, session: Session, turn: Turn, handed: bool) -> None:
        """The turn runs now: tell its client, and its worker unless the
        worker already has it (`handed`: it came in the spawn request)."""
        turn.started_at = time.monotonic()
        # An idle worker may have been silent longer than a busy one may be:
        # the busy clock starts with the turn.
        session.last_heartbeat = max(session.last_heartbeat, turn.started_at)
        if self.metrics is not None:
            self.metrics.routing_seconds.observe(turn.started_at - turn.queued_at)
        self._transition(session, Event.TURN)
        # The worker first: its turn is the critical path; the client's
        # acknowledgement and the history are made while the worker runs it.
        if not handed:
            self._send_worker(
                session, Message(Kind.TURN, {"text": turn.text}, session=session.key, id=turn.id)
            )
        elif session.cancel_on_hello == turn.id:
            self._send_worker(session, Message(Kind.CANCEL, {"turn": turn.id}, session=session.key))
        session.cancel_on_hello = None
        self._send_client(
            turn.client,
            Message(
                Kind.EVENT,
                {"type": "status", "data": {"state": "running", "pid": session.pid}},
                session=session.key,
                re=turn.id,
            ),
        )
        self._publish(
            session, "turn", {"text": turn.text}, turn=turn.id, bound=16 + 4 * len(turn.text)
        )
        own = session.settings or self.settings
        if own.turn_timeout is not None:
            asyncio.get_running_loop().call_later(
                own.turn_timeout, self._on_turn_timeout, session, turn
            )

    def _on_turn_timeout(self, session: Session, turn: Turn) -> None:
        if session.current is not turn or turn.abandoned:
            return
        own = session.settings or self.settings
        limit = own.turn_timeout
        turn.abandoned = True
        self._finish(
            turn,
            session,
            error_message(
                ErrorCode.TURN_TIMEOUT.value,
                f"the turn ran over the {limit:g}s turn timeout and was cancelled",
                re=turn.id,
                session=session.key,
            ),
        )
        self._send_worker(session, Message(Kind.CANCEL, {"turn": turn.id}, session=session.key))
        generation = session.generation
        # A runtime that ignores the cancel loses its worker.
        asyncio.get_running_loop().call_later(
            own.cancel_grace, self._check_cancelled, session, turn, generation
        )

    def _check_cancelled(self, session: Session, turn: Turn, generation: int) -> None:
        if session.current is turn and session.generation == generation:
            self._terminate(
                session,
                f"its turn ran over the {(session.settings or self.settings).turn_timeout:g}s "
                "turn timeout "
                "and did not stop when cancelled",
            )

    # ---------------------------------------------------------------- workers

    def _start_worker(self, session: Session) -> None:
        if session.retry_timer is not None:
            session.retry_timer.cancel()
            session.retry_timer = None
        session.generation += 1
        spare = self.spare_workers.take()
        token, worker_id = (spare.token, spare.worker_id) if spare else self._new_identity()
        session.token, session.worker_id = token, worker_id
        session.proc = session.hello_pid = None
        session.exited = asyncio.Event()
        session.started_at = time.time()
        session.spawned_mono = session.last_heartbeat = time.monotonic()
        session.hang_signalled = False
        session.kill_reason = session.kill_code = None
        session.cpu_sample = None  # CPU% is per worker: start from this one
        session.settings = self.settings
        self._transition(session, Event.SPAWN)
        self.by_worker_id[worker_id] = session
        assert self.zygote is not None
        request = self._spawn_request(session)
        session.runtime_kind = repr((request["runtime"], sorted(request["runtime_config"].items())))
        if (
            session.queue
            and session.current is None
            and len(session.queue[0].text) <= HANDOVER_TEXT
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
            turn = session.queue.popleft()
            self.queued_total -= 1
            session.current = turn
            request["turn"] = {"id": turn.id, "text": turn.text}
        # Asked now, not when the task first runs: the fork starts sooner.
        # Counted from this moment: the worker is our child as soon as it is
        # cloned, and until it is registered an orphan cull (which may run
        # before the task below starts) must not take it for an orphan.
        if spare is not None and not self._assign(session, spare, request):
            spare = None  # gone meanwhile: fork one, under a routing id of its own
            del self.by_worker_id[worker_id]
            token, worker_id = self._new_identity()
            session.token, session.worker_id = token, worker_id
            self.by_worker_id[worker_id] = session
            request.update(token=token, worker_id=worker_id)
        if spare is None:
            self._spawning += 1
            forked = self.zygote.spawn(request)
            self._spawn_task(self._fork(session, session.generation, forked))  # it uncounts
        if session.unsaved:
            session.unsaved = False
            try:
                # A spare directory moved into place while the worker starts
                # spares it making its own.
                custom = session.options.workspace is not None
                if not self.spare_dirs.take(session.dir, with_workspace=not custom):
                    open_session_dir(self.settings.data_dir, session.key)
                save_session_meta(session)
                self.spare_dirs.refill()  # one behind each new session
            except OSError as exc:
                # The worker needs the directory too, and says so if it fails.
                log.error(kv("session_dir_failed", session=session.key, error=exc))

    @staticmethod
    def _new_identity() -> tuple[bytes, bytes]:
        """A signing token and a routing id for a worker to be forked."""
        return secrets.token_bytes(32), b"w" + secrets.token_bytes(15)

    def _spawn_request(self, session: Session) -> dict[str, Any]:
        s = self.settings
        env = worker_env(
            self.base_env, s.env, session.options, session.key, session.home, session.workspace
        )
        rlimits = {}
        if s.max_open_files:
            rlimits["nofile"] = s.max_open_files
        if s.cpu_seconds:
            rlimits["cpu"] = s.cpu_seconds
        return {
            "key": session.key,
            "title": session.key if len(session.key) <= 48 else session.key[:45] + "...",
            "token": session.token,
            "worker_id": session.worker_id,
            "endpoint": self.worker_endpoint,
            "supervisor_pid": os.getpid(),
            "env": env,
            "workspace": str(session.workspace),
            "home": str(session.home),
            "runtime": session.options.runtime or s.runtime,
            "runtime_config": {**s.runtime_config, **session.options.agent},
            "options": session.options.to_wire(),
            # Several beats per timeout, so one late beat is never a hang.
            "heartbeat": min(s.heartbeat_interval, s.heartbeat_timeout / 4),
            "idle_heartbeat": s.idle_heartbeat_interval,
            "rlimits": rlimits,
        }

    async def _fork(
        self, session: Session, generation: int, forked: asyncio.Future[tuple[int, int | None]]
    ) -> None:
        """Register the forked worker; ends the spawn `_start_worker` counted."""
        try:
            await self._fork_and_register(session, generation, forked)
        finally:
            self._spawning -= 1

    async def _fork_and_register(
        self, session: Session, generation: int, forked: asyncio.Future[tuple[int, int | None]]
    ) -> None:
        try:
            pid, out_fd = await forked
        except ZygoteError as exc:
            if session.generation == generation:
                self._worker_gone(session, f"could not be forked: {exc}", exit_code=None)
            return
        self._adopt(session, generation, WorkerProcess(pid), out_fd)
        status = self.unclaimed_exits.pop(pid, None)
        if status is not None:
            self._on_exit(pid, status)

    def _adopt(
        self, session: Session, generation: int, proc: WorkerProcess, out_fd: int | None
    ) -> None:
        """Make a forked (or assigned spare) process the session's worker."""
        session.proc = proc
        self.by_pid[proc.pid] = session
        loop = asyncio.get_running_loop()
        if out_fd is not None and session.log is not None:
            reader = PipeReader(
                out_fd, session.log, lambda lines: self._on_log_lines(session, lines)
            )
            session.pipe = reader
            loop.add_reader(out_fd, self._read_pipe, session, reader)
        if self.records is not None:
            self.records.add(proc.pid, session.key, proc.create_time)
        log.info(kv("spawned", session=session.key, pid=proc.pid))
        if self.metrics is not None:
            self.metrics.spawns.inc()
        loop.call_later(self.settings.start_timeout, self._check_started, session, generation)

    # ---------------------------------------------------------------- spares

    def _fill_spares(self) -> None:
        """Fork spare workers up to `spare_workers` (see spare_workers.py)."""
        pool = self.spare_workers
        if not self.accepting or self.zygote is None or time.monotonic() < pool.retry_at:
            return
        while len(pool) < self.settings.spare_workers:
            spare = Spare()
            pool.add(spare)
            request = {
                "spare": True,
                "worker_id": spare.worker_id,
                "token": spare.token,
                "endpoint": self.worker_endpoint,
                "supervisor_pid": os.getpid(),
            }
            self._spawning += 1  # as for a worker: culls wait until it is known
            self._spawn_task(self._register_spare(spare, self.zygote.spawn(request)))
        while len(pool) > self.settings.spare_workers:  # fewer since a reload
            extra = next(iter(pool.by_id.values()))
            pool.retire(extra)
            if extra.proc is not None:
                extra.proc.kill()  # it holds nothing; reaped as any child

    async def _register_spare(
        self, spare: Spare, forked: asyncio.Future[tuple[int, int | None]]
    ) -> None:
        try:
            try:
                pid, out_fd = await forked
            except ZygoteError as exc:
                self.spare_workers.discard(spare)
                self.spare_workers.retry_at = time.monotonic() + 1.0  # not on every tick
                log.warning(kv("spare_not_forked", error=exc))
                return
            proc = WorkerProcess(pid)
            self.spare_workers.forked(spare, proc, out_fd)
            if self.records is not None:
                self.records.add(pid, "(spare)", proc.create_time)
            if spare.worker_id not in self.spare_workers.by_id or not self.accepting:
                proc.kill()  # trimmed or shutting down while it was forked
            status = self.unclaimed_exits.pop(pid, None)
            if status is not None:
                self._on_exit(pid, status)
        finally:
            self._spawning -= 1

    def _on_spare(self, spare: Spare, frames: list[bytes]) -> None:
        try:
            msg = decode(frames, spare.token, self.limits)
        except RemoteProtocolError as exc:
            log.warning(kv("bad_spare_message", error=exc))
            return
        if msg.kind is Kind.SPARE:
            spare.ready = True

    def _assign(self, session: Session, spare: Spare, request: dict[str, Any]) -> bool:
        """Give a new session a ready spare worker: send it the spawn request
        it would have been forked with. False if it is gone (then fork one)."""
        assert spare.proc is not None
        # Everything but the token, which the spare has had since its fork.
        body = {"request": {k: v for k, v in request.items() if k != "token"}}
        try:
            self.back.send([spare.worker_id, *encode(Message(Kind.ASSIGN, body), spare.token)])
        except zmq.ZMQError as exc:
            log.warning(kv("spare_unreachable", pid=spare.proc.pid, error=exc))
            # Out of the pool already; its exit is still ours to clean up.
            self.spare_workers.by_pid[spare.proc.pid] = spare
            spare.proc.kill()
            return False
        self._adopt(session, session.generation, spare.proc, spare.out_fd)
        return True

    def _spare_exited(self, spare: Spare, status: int) -> None:
        assert spare.proc is not None
        pid = spare.proc.pid
        spare.proc.set_exited(status)
        if self.records is not None:
            self.records.remove(pid)
        output = b""
        if spare.out_fd is not None:
            os.set_blocking(spare.out_fd, False)
            try:
                output = os.read(spare.out_fd, 65536)
            except OSError:
                pass
            os.close(spare.out_fd)
        pool, s = self.spare_workers, self.settings
        if spare.worker_id not in pool.by_id:
            pool.discard(spare)  # retired by us
            return
        delay = pool.died(spare, s.min_uptime, s.backoff_base, s.backoff_cap)
        if self.accepting:
            why = describe_exit(spare.proc.exit_code, spare.proc.exit_signal)
            text = output.decode("utf-8", "replace").strip()[-2000:]
            log.warning(kv("spare_exited", pid=pid, why=why, output=text or "(none)"))
            asyncio.get_running_loop().call_later(delay, self._fill_spares)

    def _check_started(self, session: Session, generation: int) -> None:
        if session.generation == generation and session.state is State.STARTING:
            self._terminate(
                session, f"did not say hello within {self.settings.start_timeout:g}s of its start"
            )

    def _send_worker(self, session: Session, msg: Message) -> bool:
        if session.worker_id is None or session.token is None:
            return False
        try:
            self.back.send([session.worker_id, *encode(msg, session.token)])
            return True
        except zmq.ZMQError as exc:
            log.warning(kv("worker_unreachable", session=session.key, error=exc))
            return False

    def _on_back(self, frames: list[bytes]) -> None:
        if len(frames) != 4:
            log.warning(kv("bad_worker_frames", count=len(frames)))
            return
        session = self.by_worker_id.get(frames[0])
        if session is None and frames[0] in self.spare_workers.by_id:
            self._on_spare(self.spare_workers.by_id[frames[0]], frames[1:])
            return
        if session is None or session.token is None:
            log.debug(kv("unknown_worker", id=frames[0].hex()[:16]))
            return
        try:
            msg = decode(frames[1:], session.token, self.limits)
        except RemoteProtocolError as exc:
            log.warning(kv("bad_worker_message", session=session.key, error=exc))
            return
        if msg.session != session.key:
            log.warning(kv("worker_wrong_session", session=session.key, claimed=msg.session))
            return
        session.last_heartbeat = time.monotonic()
        if msg.kind is Kind.HEARTBEAT:
            return  # a heartbeat is life, not activity: it does not reset the idle clock
        session.touch()
        if msg.kind is Kind.HELLO:
            if session.state is State.STARTING:
                session.hello_pid = int(msg.body["pid"])
                self._transition(session, Event.HELLO)
                self.runtimes_started.add(session.runtime_kind)
                log.info(kv("ready", session=session.key, pid=msg.body["pid"]))
                if session.current is not None:
                    # The first turn came with the spawn request; the worker
                    # started it right after this hello.
                    self._begin(session, session.current, handed=True)
                else:
                    self._pump(session)
            return
        turn = session.current
        if turn is None or msg.re != turn.id:
            log.warning(kv("stray_worker_message", session=session.key, kind=msg.kind.value))
            return
        # Checked above: the worker's envelope names this session and this
        # turn, so its payload goes to the client as it is, re-signed.
        payload = frames[3]
        if msg.kind is Kind.EVENT:
            if not turn.abandoned:
                self._send_client(turn.client, msg, payload)
            self._publish(
                session, msg.body["type"], msg.body.get("data"), turn=turn.id, bound=len(payload)
            )
        elif msg.kind in (Kind.REPLY, Kind.ERROR):
            if turn.abandoned:
                pass  # its client already had a turn_timeout error
            elif session.state is State.STOPPING:
                # The worker was told to stop and cut this turn short: say so.
                self._finish(
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
                self._finish(turn, session, msg, payload)
            session.current = None
            session.turns += 1
            self._transition(session, Event.DONE)
            self._pump(session)
            if len(self.spare_workers) < self.settings.spare_workers:
                self._fill_spares()  # after a turn, not on a new session's way to its reply
        else:
            log.warning(kv("unexpected_worker_message", session=session.key, kind=msg.kind.value))

    # ---------------------------------------------------------------- health

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
            (session.settings or self.settings).abort_grace,
            self._kill_now,
            session,
            session.generation,
        )

    def _terminate(self, session: Session, reason: str) -> None:
        """End a worker for a reason of the supervisor's own (a limit, a hang)."""
        if session.proc is None or session.proc.returncode is not None:
            return
        log.warning(kv("terminating", session=session.key, pid=session.proc.pid, reason=reason))
        session.kill_reason = reason
        self._kill_now(session, session.generation)

    def _kill_now(self, session: Session, generation: int) -> None:
        proc = session.proc
        if session.generation != generation or proc is None or proc.returncode is not None:
            return
        tree = proc.descendants()
        proc.signal_group(signal.SIGKILL)
        proc.kill()
        kill_processes(tree)

    async def _check_limits(self) -> None:
        """Sample every live worker's tree (in a thread: it reads /proc) and
        recycle the sessions over their memory or process limit."""
        s = self.settings
        workers = {
            sess.proc.pid: sess
            for sess in self.sessions.values()
            if sess.proc is not None
            and sess.proc.returncode is None
            and sess.state in (State.IDLE, State.BUSY)
        }
        if not workers:
            return
        self._scanning = True
        started = time.monotonic()
        try:
            usage: dict[int, TreeUsage] = await asyncio.get_running_loop().run_in_executor(
                None, scan_trees, list(workers)
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
            s = session.settings or self.settings
            if s.memory_limit_mb and use.rss > s.memory_limit_mb * MIB:
                self._terminate(
                    session,
                    f"went over its memory limit ({use.rss / MIB:.0f} MiB RSS with its "
                    f"children > {s.memory_limit_mb} MiB) and was recycled",
                )
            elif s.max_procs and use.procs > s.max_procs:
                self._terminate(
                    session,
                    f"went over its process limit ({use.procs} processes > "
                    f"{s.max_procs}) and was recycled",
                )

    # ---------------------------------------------------------------- exits

    def _reap(self) -> None:
        """Collect every child that has exited (workers, orphans, the zygote)."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if self.zygote is not None and pid == self.zygote.pid:
                self._on_zygote_exit(status)
            else:
                self._on_exit(pid, status)

    def _on_zygote_exit(self, status: int) -> None:
        assert self.zygote is not None
        self.zygote.fail_pending("the zygote died")
        if not self.accepting:
            return
        code = os.waitstatus_to_exitcode(status)
        log.error(kv("zygote_died", status=code))
        self.zygote.detach(asyncio.get_running_loop())
        self.zygote.close()
        self._start_zygote()
        self.zygote.attach(asyncio.get_running_loop())

    def _on_exit(self, pid: int, status: int) -> None:
        spare = self.spare_workers.by_pid.get(pid)
        if spare is not None:
            self._spare_exited(spare, status)
            return
        session = self.by_pid.pop(pid, None)
        if session is None or session.proc is None or session.proc.pid != pid:
            # An orphan of a dead worker, or a worker whose pid the zygote has
            # not told us yet: keep its status for `_fork` to claim.
            if len(self.unclaimed_exits) >= MAX_UNCLAIMED_EXITS:
                self.unclaimed_exits.pop(next(iter(self.unclaimed_exits)))
            self.unclaimed_exits[pid] = status
            return
        if self.records is not None:
            self.records.remove(pid)
        if session.pipe is not None:
            # Every line the worker wrote before it died is logged before its
            # death is handled (and reported).
            self._read_pipe(session, session.pipe)
        session.proc.set_exited(status)
        reason = session.kill_reason or describe_exit(
            session.proc.exit_code, session.proc.exit_signal
        )
        self._worker_gone(session, reason, exit_code=session.proc.exit_code)

    def _worker_gone(self, session: Session, reason: str, exit_code: int | None) -> None:
        """The session's worker is no more: decide the session's next state
        and answer whoever was waiting on it."""
        s = session.settings or self.settings
        was = session.state
        pid = session.proc.pid if session.proc is not None else None
        if session.worker_id is not None:
            self.by_worker_id.pop(session.worker_id, None)
        session.worker_id = None
        session.token = None
        session.exits += 1
        session.last_exit = reason
        uptime = time.monotonic() - session.spawned_mono
        if was is State.STOPPING or not self.accepting:
            event = Event.EXIT
        elif exit_code == WorkerExit.RUNTIME_LOAD_FAILED:
            event = Event.GIVE_UP  # it will never start: do not retry in a loop
        elif was is State.STARTING or uptime < s.min_uptime:
            session.fast_failures += 1
            event = (
                Event.GIVE_UP if session.fast_failures >= s.max_fast_failures else Event.FAST_EXIT
            )
        else:
            session.fast_failures = 0
            event = Event.EXIT
        self._transition(session, event, reason)
        if self.metrics is not None:
            signal_name = session.proc.exit_signal if session.proc is not None else None
            self.metrics.exits.labels(
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
                self._cancelled_unstarted(session, turn)  # while it waited for the hello
            else:
                session.queue.appendleft(turn)
                self.queued_total += 1
        if session.current is not None:
            turn, session.current = session.current, None
            if not turn.abandoned:
                if was is State.STOPPING or session.kill_code is not None:
                    code = ErrorCode(session.kill_code or ErrorCode.SESSION_KILLED.value)
                    text = f"the session was stopped during this turn: {reason}"
                else:
                    code = ErrorCode.WORKER_DIED
                    text = f"the worker of session {session.key!r} (pid {pid}) {reason} during this turn"
                self._finish(
                    turn, session, error_message(code.value, text, re=turn.id, session=session.key)
                )
        session.cancel_on_hello = None  # its worker is gone, and with it the handed turn
        if session.state is State.FAILED:
            session.retry_at = time.monotonic() + s.failed_cooldown
            self._fail_queue(
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
            delay = min(s.backoff_base * 2 ** (session.fast_failures - 1), s.backoff_cap)
            session.retry_at = time.monotonic() + delay
            for turn in session.queue:
                self._send_client(
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
                self._schedule_retry(session)
        session.exited.set()
        if session.state is State.EXITED and session.queue and self.accepting:
            self._start_worker(session)  # messages are waiting: start a fresh worker
        self._schedule_orphan_cull()

    def _schedule_retry(self, session: Session) -> None:
        if session.retry_timer is None:
            delay = max(0.0, session.retry_at - time.monotonic())
            session.retry_timer = asyncio.get_running_loop().call_later(delay, self._retry, session)

    def _retry(self, session: Session) -> None:
        session.retry_timer = None
        if session.state is not State.BACKOFF or not session.queue or not self.accepting:
            return
        try:
            self._make_room(session)
        except RemoteProtocolError as exc:
            self._fail_queue(session, exc.code, exc.message)
            return
        self._start_worker(session)

    def _schedule_orphan_cull(self) -> None:
        if not self._cull_pending:
            self._cull_pending = True
            asyncio.get_running_loop().call_later(0.05, self._cull_orphans)

    def _cull_orphans(self) -> None:
        """Kill processes re-parented to us that are not workers: descendants
        left behind by a worker that died. Nothing a session started outlives it."""
        self._cull_pending = False
        if self._spawning:
            self._schedule_orphan_cull()  # a new worker may be adopted but not yet known
            return
        known = set(self.by_pid) | set(self.spare_workers.by_pid)
        if self.zygote is not None and self.zygote.pid is not None:
            known.add(self.zygote.pid)
        try:
            children = psutil.Process().children()
        except psutil.Error:
            return
        orphans = [p for p in children if p.pid not in known]
        for proc in orphans:
            try:
                tree = proc.children(recursive=True)
            except psutil.Error:
                tree = []
            hit = kill_processes([proc, *tree])
            if hit:
                log.warning(kv("orphans_killed", pid=proc.pid, count=hit))

    # ---------------------------------------------------------------- kill

    async def _kill_session(
        self,
        session: Session,
        force: bool,
        reason: str = "killed by request",
        code: ErrorCode = ErrorCode.SESSION_KILLED,
    ) -> tuple[int | None, str]:
        """Stop a session's worker and everything it started; return (pid, how).
        Also clears a backed-off or failed session."""
        if session.state in (State.BACKOFF, State.FAILED):
            self._fail_queue(session, code, f"the session was stopped: {reason}")
            self._transition(session, Event.CLEAR, reason)
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
        self._transition(session, Event.KILL, reason)
        self._fail_queue(session, code, f"the session was stopped before this turn ran: {reason}")
        s = session.settings or self.settings
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
        if not (force or self.forced) and self._send_worker(
            session, Message(Kind.STOP, {}, session=session.key)
        ):
            await self._wait_exit(session, s.stop_timeout)
        if not session.exited.is_set():
            tree += proc.descendants()
            how = "terminated"
            proc.signal_group(signal.SIGTERM)
            proc.terminate()
            if not (force or self.forced):
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

    def _force_kill_all(self) -> None:
        self.forced = True
        self._kill_spares()
        for session in self.sessions.values():
            if session.proc is not None and session.proc.returncode is None:
                session.kill_reason = "the supervisor was told twice to shut down"
                session.kill_code = ErrorCode.SHUTTING_DOWN.value
                session.proc.signal_group(signal.SIGKILL)
                session.proc.kill()

    # ---------------------------------------------------------------- shutdown

    async def _shutdown(self) -> None:
        """Stop taking turns, let running ones finish (up to the grace period),
        then stop every worker in parallel."""
        self.accepting = False
        self._kill_spares()
        for session in self.sessions.values():
            self._fail_queue(session, ErrorCode.SHUTTING_DOWN, "the supervisor is shutting down")
        deadline = time.monotonic() + self.settings.shutdown_grace
        while (
            not self.forced
            and time.monotonic() < deadline
            and any(s.state is State.BUSY for s in self.sessions.values())
        ):
            await asyncio.sleep(0.05)
        live = [s for s in self.sessions.values() if s.state in LIVE_STATES]
        await asyncio.gather(
            *(
                self._kill_session(
                    s,
                    force=self.forced,
                    reason="the supervisor is shutting down",
                    code=ErrorCode.SHUTTING_DOWN,
                )
                for s in live
            )
        )
        # Let tasks that reply to kill requests send their answers.
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=1.0)
        assert self.zygote is not None
        zygote_pid = self.zygote.pid
        self.zygote.close()
        if zygote_pid is not None:
            await self._wait_pid_gone(zygote_pid, 2.0)

    def _kill_spares(self) -> None:
        """Spares hold nothing: SIGKILL them (reaped as any child)."""
        for spare in list(self.spare_workers.by_id.values()):
            if spare.proc is not None and spare.proc.returncode is None:
                spare.proc.kill()

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
