"""Fakes for driving the supervisor's parts without a process, a socket or a
supervisor: the real Context, Watchers, SessionTable, Turns, Lifecycle and
Front, wired as server.py wires them, around a fake WorkerPool and a fake
Endpoints that record what was sent to whom.

A worker here is a `FakeProcess` (the Popen-like `ProcessHandle`, plus the
`set_exited` the reaper calls): signals are recorded, nothing is sent. A
fork is a future that the test resolves (`forked`); an exit is what the
reaper would report (`exit`). Time is a `Clock` that moves only when the
test moves it: the lifecycle's clock, and the event loop's, on which the
parts arm their timers (back-off retry, turn timeout, cancel grace). So
"soon after its start", "after the cool-down" and "the retry has fired"
are decided by the test (`await rig.advance(seconds)`), never by how busy
the machine is, and no test waits on the real clock.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest

from hermes_sup.protocol import Kind, Limits, Message, encode
from hermes_sup.supervisor import lifecycle as lifecycle_module
from hermes_sup.supervisor.cgroups import SessionGroups
from hermes_sup.supervisor.config import Settings
from hermes_sup.supervisor.context import Context
from hermes_sup.supervisor.endpoints import Endpoints
from hermes_sup.supervisor.front import Front
from hermes_sup.supervisor.lifecycle import Lifecycle
from hermes_sup.supervisor.pool import WorkerPool
from hermes_sup.supervisor.process import exit_status
from hermes_sup.supervisor.sealing import Sealing
from hermes_sup.supervisor.server import connect
from hermes_sup.supervisor.session import Session
from hermes_sup.supervisor.spare_dirs import SpareDirs
from hermes_sup.supervisor.table import RUNNING_STATES, SessionTable
from hermes_sup.supervisor.turns import Turns
from hermes_sup.supervisor.watchers import Watchers

CLIENT_KEY = b"k" * 32
ALICE = b"\x00alice"  # client ids: the front socket's index, then the routing id
BOB = b"\x00bob"


def exited_with(code: int) -> int:
    """The waitpid status of a process that exited with `code`."""
    return code << 8


def killed_by(sig: signal.Signals) -> int:
    """The waitpid status of a process killed by `sig`."""
    return int(sig)


class FakeProcess:
    """A worker process that records the signals it is sent (ProcessHandle)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.exit_code: int | None = None
        self.exit_signal: str | None = None
        self.create_time: float | None = None
        self.signals: list[int] = []  # to the worker itself
        self.group_signals: list[int] = []  # to its process group

    def set_exited(self, status: int) -> None:
        self.exit_code, self.exit_signal = exit_status(status)
        self.returncode = self.exit_code if self.exit_code is not None else -1

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)

    def signal_group(self, sig: int) -> None:
        self.group_signals.append(sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def descendants(self) -> list[Any]:
        return []


class FakeEndpoints:
    """Endpoints without sockets: what went to each client and worker, in order."""

    worker = "ipc:///nonexistent/workers.sock"
    limits = Limits()
    error = Endpoints.error  # the real one: an error_message through to_client

    def __init__(self) -> None:
        self.to_clients: list[tuple[bytes, Message]] = []
        self.to_workers: list[tuple[str, Message]] = []
        self.gone: set[bytes] = set()  # clients whose sends fail

    def client_key(self, index: int) -> bytes:
        return CLIENT_KEY

    def to_client(self, client: bytes, msg: Message, payload: bytes | None = None) -> bool:
        if client in self.gone:
            return False
        self.to_clients.append((client, msg))
        return True

    def to_worker(self, session: Session, msg: Message) -> bool:
        # As the real one: a session without a worker identity has no worker.
        if session.worker_id is None or session.token is None:
            return False
        self.to_workers.append((session.key, msg))
        return True


class FakePool:
    """What Lifecycle uses of WorkerPool, with no zygote, spares, pipes or
    records. The spawn request and the identity bookkeeping are the real
    pool's methods; a fork is a future the test resolves."""

    spawn_request = WorkerPool.spawn_request
    identify = WorkerPool.identify
    forget_worker = WorkerPool.forget_worker
    _sealed_uid = WorkerPool._sealed_uid

    def __init__(self, ctx: Context, endpoints: FakeEndpoints) -> None:
        self.ctx = ctx
        self.endpoints = endpoints
        self.by_worker_id: dict[bytes, Session] = {}
        self.by_pid: dict[int, Session] = {}
        self.forks: list[tuple[dict[str, Any], asyncio.Future[tuple[int, int | None]]]] = []
        self.spawning = 0
        self.orphan_culls = 0
        self.sealing = Sealing()  # unsealed, as sealed = off
        self.sealed_uids: dict[str, int] = {}
        self.cgroups = SessionGroups()  # not started: none

    def take_spare(self) -> None:
        return None  # spare_workers = 0: every worker is forked

    def fork(self, request: dict[str, Any]) -> asyncio.Future[tuple[int, int | None]]:
        future: asyncio.Future[tuple[int, int | None]] = asyncio.get_running_loop().create_future()
        self.forks.append((request, future))
        self.spawning += 1
        return future

    def forked(self) -> None:
        self.spawning -= 1

    def adopt(self, session: Session, proc: FakeProcess, out_fd: int | None) -> int | None:
        session.proc = proc  # type: ignore[assignment]
        self.by_pid[proc.pid] = session
        return None

    def claim_exit(self, pid: int, status: int) -> Session | None:
        session = self.by_pid.pop(pid, None)
        if session is None or session.proc is None or session.proc.pid != pid:
            return None
        session.proc.set_exited(status)
        return session

    def schedule_orphan_cull(self) -> None:
        self.orphan_culls += 1

    def kill_spares(self) -> None:
        pass


class Clock:
    """The lifecycle's `time` and the event loop's: monotonic time stands
    still until `advance`. Wall time (`time`) is the real one: it only
    stamps records."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return time.time()

    def advance(self, seconds: float) -> None:
        self.now += seconds


class ClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose time is a `Clock`: a timer fires once the test
    has moved the clock past it, and never because the machine was slow.

    Between moves, a loop with nothing ready and a timer not yet due
    sleeps in its selector, and wakes to find it still not due: a scenario
    that waits for a timer without moving the clock hangs (until the
    run's bound), it never passes by luck."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock

    def time(self) -> float:
        return self.clock.now


# Seconds of real time a scenario may take before it is called hung. Its
# timers are on the test's clock, so this bounds only a bug (a wait for
# something that never comes), however loaded the machine.
HUNG_AFTER = 60.0


class Rig:
    """The parts, wired as Supervisor._compose wires them, around the fakes."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch, **settings: Any) -> None:
        self.settings = Settings(state_dir=root / "s", data_dir=root / "d", **settings)
        self.clock = Clock()
        monkeypatch.setattr(lifecycle_module, "time", self.clock)
        # The fork path makes the worker's handle itself, from the pid.
        monkeypatch.setattr(lifecycle_module, "WorkerProcess", FakeProcess)
        self.ctx = Context(self.settings, {})
        self.ctx.max_sessions = self.settings.max_sessions or 64
        self.endpoints = FakeEndpoints()
        endpoints: Any = self.endpoints
        self.watchers = Watchers(endpoints)
        self.table = SessionTable(self.ctx, self.watchers, SpareDirs(self.settings.data_dir))
        self.table.store.spare_dirs.reset()
        self.turns = Turns(
            self.ctx,
            self.table,
            endpoints,
            self.watchers,
            terminate=lambda session, reason: self.lifecycle.killer.terminate(session, reason),
        )
        self.pool = FakePool(self.ctx, self.endpoints)
        pool: Any = self.pool
        self.lifecycle = Lifecycle(self.ctx, self.table, self.turns, pool, endpoints)
        connect(self.table, self.turns, self.lifecycle, endpoints)
        self.front = Front(
            self.ctx,
            self.table,
            self.turns,
            self.lifecycle,
            self.watchers,
            pool,
            endpoints,
            lambda: ([], []),
        )
        self._pids = itertools.count(5_000_001)  # above any real pid (pid_max <= 2**22)

    def run(self, scenario: Coroutine[Any, Any, None]) -> None:
        """Run a test's scenario on a fresh loop on the test's clock; a
        scenario still running after HUNG_AFTER real seconds is cancelled."""
        loop = ClockLoop(self.clock)
        task = loop.create_task(scenario)
        # A thread of real time: the loop's own timers would wait for the clock.
        watchdog = threading.Timer(HUNG_AFTER, loop.call_soon_threadsafe, (task.cancel,))
        watchdog.start()
        try:
            loop.run_until_complete(task)
        except asyncio.CancelledError:
            raise AssertionError(f"the scenario hung: not done in {HUNG_AFTER:g}s") from None
        finally:
            watchdog.cancel()
            # As asyncio.run ends: what the parts started and left is cancelled.
            left = asyncio.all_tasks(loop)
            for other in left:
                other.cancel()
            if left:
                loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def advance(self, seconds: float) -> None:
        """Move the clock by `seconds`, and let the timers now due (and
        what they start) run."""
        self.clock.advance(seconds)
        await settle()

    # ---------------------------------------------------------- clients

    def request(
        self, kind: Kind, session: str, body: dict[str, Any], client: bytes = ALICE, id: str = ""
    ) -> str:
        """A signed request from a client, through Front.on_frames; its id."""
        msg = Message(kind, body, session=session, **({"id": id} if id else {}))
        self.front.on_frames(client[0], [client[1:], *encode(msg, CLIENT_KEY)])
        return msg.id

    def send(self, key: str, text: str, client: bytes = ALICE, id: str = "", **options: Any) -> str:
        """A `send` of `text` to session `key`; the request's id."""
        body: dict[str, Any] = {"text": text}
        if options:
            body["options"] = options
        return self.request(Kind.SEND, key, body, client, id)

    def cancel(self, key: str, turn: str | None = None) -> str:
        return self.request(Kind.CANCEL, key, {} if turn is None else {"turn": turn})

    def answers(self, re: str, client: bytes | None = None) -> list[Message]:
        """Everything sent to clients in answer to request `re` (to `client` only, if given)."""
        return [
            m
            for c, m in self.endpoints.to_clients
            if m.re == re and (client is None or c == client)
        ]

    def finals(self, re: str, client: bytes | None = None) -> list[Message]:
        """The final answers (replies and errors) of request `re`."""
        return [m for m in self.answers(re, client) if m.kind in (Kind.REPLY, Kind.ERROR)]

    def statuses(self, re: str) -> list[dict[str, Any]]:
        """The `status` events' data sent for request `re`."""
        return [
            m.body["data"]
            for m in self.answers(re)
            if m.kind is Kind.EVENT and m.body.get("type") == "status"
        ]

    def to_worker(self, key: str, kind: Kind) -> list[Message]:
        """What session `key`'s workers were sent, of one kind."""
        return [m for k, m in self.endpoints.to_workers if k == key and m.kind is kind]

    # ---------------------------------------------------------- workers

    def spawn_requests(self, key: str) -> list[dict[str, Any]]:
        """Every spawn request made for session `key`, oldest first."""
        return [request for request, _ in self.pool.forks if request["key"] == key]

    async def forked(self, key: str) -> FakeProcess:
        """The zygote answers session `key`'s pending fork with a new pid."""
        future = next(f for r, f in self.pool.forks if r["key"] == key and not f.done())
        future.set_result((next(self._pids), None))
        await settle()
        proc = self.table.require(key).proc
        assert isinstance(proc, FakeProcess)
        return proc

    async def fork_failed(self, key: str, error: Exception) -> None:
        future = next(f for r, f in self.pool.forks if r["key"] == key and not f.done())
        future.set_exception(error)
        await settle()

    def hello(self, key: str) -> None:
        """The session's worker proves its token."""
        session = self.table.require(key)
        assert session.proc is not None
        pid = session.proc.pid
        self.lifecycle.on_hello(session, Message(Kind.HELLO, {"pid": pid}, session=key))

    async def started(self, key: str) -> FakeProcess:
        """Fork and hello: the session's worker is ready."""
        proc = await self.forked(key)
        self.hello(key)
        return proc

    def event(self, key: str, data: Any) -> None:
        """The running turn's worker sends an event for it."""
        session = self.table.require(key)
        assert session.current is not None
        msg = Message(
            Kind.EVENT, {"type": "message", "data": data}, session=key, re=session.current.id
        )
        self.turns.on_answer(session, msg, b"payload")

    def reply(self, key: str, text: str, re: str | None = None) -> None:
        """The session's worker answers its running turn (or turn `re`)."""
        session = self.table.require(key)
        if re is None:
            assert session.current is not None
            re = session.current.id
        self.turns.on_answer(
            session, Message(Kind.REPLY, {"text": text}, session=key, re=re), b"payload"
        )

    def exit(self, key: str, status: int) -> None:
        """The reaper saw the session's worker exit with waitpid `status`."""
        session = self.table.require(key)
        assert session.proc is not None
        self.lifecycle.on_exit(session.proc.pid, status)

    # ---------------------------------------------------------- checks

    def running_recount(self) -> int:
        """Sessions with a running worker, counted (the table keeps a counter)."""
        return sum(s.state in RUNNING_STATES for s in self.table.sessions.values())

    def queued_recount(self) -> int:
        """Turns waiting in every queue, counted (Turns keeps a counter)."""
        return sum(len(s.queue) for s in self.table.sessions.values())


async def settle() -> None:
    """Let callbacks and tasks that are ready run (no timers, no waiting)."""
    for _ in range(10):
        await asyncio.sleep(0)
