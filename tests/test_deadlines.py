"""The supervisor's periodic work follows what is due, not what is held:
the deadline heap against a plain model, Health's tick over a table of
many held sessions and a few live ones, and stops staggered in a shutdown
(fakes for the parts around them; the real tick and kills are exercised by
every e2e test with a worker)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st

from hermes_sup.supervisor.cgroups import SessionGroups
from hermes_sup.supervisor.config import Settings
from hermes_sup.supervisor.deadlines import Deadlines
from hermes_sup.supervisor.environment import SessionOptions
from hermes_sup.supervisor.health import Health
from hermes_sup.supervisor.kills import STOPS_AT_ONCE, Killer
from hermes_sup.supervisor.session import Session
from hermes_sup.supervisor.states import Sleep, State

KEYS = st.sampled_from("abcdefgh")
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("set"), KEYS, st.floats(0, 100)),
        st.tuples(st.just("discard"), KEYS, st.just(0.0)),
        st.tuples(st.just("pop"), st.just(""), st.floats(0, 100)),
    ),
    max_size=200,
)


@given(OPS)
def test_deadlines_pop_what_a_plain_dict_says_is_due(ops) -> None:
    heap, model = Deadlines(), {}
    for op, key, value in ops:
        if op == "set":
            heap.set(key, value)
            model[key] = value
        elif op == "discard":
            heap.discard(key)
            model.pop(key, None)
        else:
            due = heap.pop_due(value)
            expected = sorted((w, k) for k, w in model.items() if w <= value)
            assert sorted(due) == sorted(k for _, k in expected)
            assert [model[k] for k in due] == sorted(model[k] for k in due)  # earliest first
            for key_due in due:
                del model[key_due]
        assert len(heap) == len(model)
        assert all((k in heap) == (k in model) for k in "abcdefgh")


def test_replaced_deadlines_do_not_grow_the_heap() -> None:
    heap = Deadlines()
    for i in range(10_000):
        heap.set("beating", float(i))  # a heartbeat moving one deadline on
    assert len(heap._heap) <= 64 * 4
    assert heap.pop_due(1e9) == ["beating"]


class CountingContext:
    """The parts of Context that Health uses, counting settings lookups."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.accepting = True
        self.lookups = 0
        self.spawned: list[object] = []

    def settings_for(self, session: Session) -> Settings:
        self.lookups += 1
        return self.settings

    def spawn(self, coro) -> None:
        coro.close()
        self.spawned.append(coro)


def _session(key: str, state: State = State.EXITED) -> Session:
    return Session(key=key, dir=Path("/nonexistent") / key, options=SessionOptions(), state=state)


def _lifecycle(**more: object) -> SimpleNamespace:
    """What Health reads of a Lifecycle here: its pool's session groups
    (none: no cgroups), and `more`."""
    return SimpleNamespace(pool=SimpleNamespace(cgroups=SessionGroups()), **more)


def _table(held: int, live: int) -> SimpleNamespace:
    sessions = {f"held-{i}": _session(f"held-{i}") for i in range(held)}
    table = SimpleNamespace(sessions=sessions, judged={})
    for i in range(live):
        session = _session(f"live-{i}", State.IDLE)
        session.proc = SimpleNamespace(pid=1, descendants=lambda: [])  # type: ignore[assignment]
        session.last_heartbeat = time.monotonic()
        sessions[session.key] = table.judged[session.key] = session
    return table


def test_a_tick_looks_only_at_live_sessions_and_only_when_due() -> None:
    settings = Settings(
        Path("/nonexistent"),
        Path("/nonexistent"),
        idle_timeout=None,
        heartbeat_timeout=30.0,
        idle_heartbeat_interval=5.0,
        disk_limit_mb=None,  # no disk rounds: this counts the heartbeat watch's lookups
    )
    ctx = CountingContext(settings)
    table = _table(held=5_000, live=3)
    health = Health(ctx, table, lifecycle=_lifecycle())  # type: ignore[arg-type]
    for session in table.judged.values():
        health.judge_soon(session)  # as the table calls it (server.connect wires it)
    now = time.monotonic()
    health.begin(now)
    health.tick(now, time.time())
    assert ctx.lookups == 3  # the live ones, once: none of the 5,000 held
    _ticks(health, now, now + 14.0)  # beats still fresh: nothing due
    assert ctx.lookups == 3
    _ticks(health, now + 14.0, now + 16.0)  # half the silence limit: watched now
    assert ctx.lookups == 6


def test_an_idle_session_is_looked_at_when_its_idle_time_is_up() -> None:
    settings = Settings(
        Path("/nonexistent"),
        Path("/nonexistent"),
        idle_timeout=60.0,
        heartbeat_timeout=600.0,
        disk_limit_mb=None,
    )
    ctx = CountingContext(settings)
    table = _table(held=0, live=1)
    (session,) = table.judged.values()
    health = Health(
        ctx,
        table,
        lifecycle=_lifecycle(killer=SimpleNamespace(kill_session=lambda *a, **k: _noop())),
    )  # type: ignore[arg-type]
    health.judge_soon(session)  # as the table calls it (server.connect wires it)
    now, wall = time.monotonic(), time.time()
    session.last_activity = wall
    health.begin(now)
    health.tick(now, wall)
    assert session.sleep is Sleep.AWAKE
    _ticks(health, now, now + 59.0, wall)
    assert session.sleep is Sleep.AWAKE and ctx.lookups == 1  # not due yet: not looked at
    session.last_heartbeat = now + 59.0  # it kept beating
    _ticks(health, now + 59.0, now + 60.5, wall + 59.0)
    assert session.sleep is Sleep.HIBERNATED and ctx.lookups == 2
    assert [c for c in ctx.spawned if c.__name__ == "_noop"]  # its worker told to stop


def _ticks(health: Health, start: float, end: float, wall: float | None = None) -> None:
    """Tick a quarter second apart from `start` to `end` (monotonic; the
    wall clock moves with it from `wall`)."""
    t = start
    while t < end:
        t = min(end, t + 0.25)
        health.tick(t, (wall if wall is not None else time.time()) + (t - start))


async def _noop() -> None:
    return None


def test_a_session_idle_before_its_pid_is_known_is_still_watched() -> None:
    """A worker's hello can come before the zygote says its pid: the
    session is idle with no process handle yet, and must not be lost."""
    settings = Settings(Path("/nonexistent"), Path("/nonexistent"), idle_timeout=60.0)
    ctx = CountingContext(settings)
    table = _table(held=0, live=1)
    (session,) = table.judged.values()
    proc, session.proc = session.proc, None
    health = Health(
        ctx,
        table,
        lifecycle=_lifecycle(killer=SimpleNamespace(kill_session=lambda *a, **k: _noop())),
    )  # type: ignore[arg-type]
    health.judge_soon(session)  # as the table calls it (server.connect wires it)
    now, wall = time.monotonic(), time.time()
    session.last_activity = wall
    health.begin(now)
    _ticks(health, now, now + 1.0, wall)
    session.proc = proc  # the zygote's word arrives
    session.last_heartbeat = now + 40.0  # and it keeps beating
    _ticks(health, now + 1.0, now + 61.0, wall + 1.0)
    assert session.sleep is Sleep.HIBERNATED


class FakeWorker:
    """A worker that exits a moment after it is asked to stop."""

    def __init__(self, session: Session, stopping: list[int], peak: list[int]) -> None:
        self.pid, self.returncode = 4242, None
        self.session, self.stopping, self.peak = session, stopping, peak

    def descendants(self) -> list[object]:
        return []

    def signal_group(self, sig: int) -> None:
        pass

    terminate = kill = lambda self: None  # noqa: E731

    def asked_to_stop(self) -> None:
        self.stopping[0] += 1
        self.peak[0] = max(self.peak[0], self.stopping[0])

        def gone() -> None:
            self.stopping[0] -= 1
            self.returncode = 0
            self.session.exited.set()

        asyncio.get_running_loop().call_later(0.01, gone)


def _stop_all(accepting: bool, draining: bool, n: int = 40) -> int:
    """Stop `n` fake workers at once; the most that were stopping together."""
    stopping, peak = [0], [0]

    async def main() -> None:
        settings = Settings(Path("/nonexistent"), Path("/nonexistent"))
        ctx = SimpleNamespace(
            settings=settings, accepting=accepting, draining=draining, forced=False,
            settings_for=lambda session: settings,
        )  # fmt: skip
        sessions = [_session(f"s{i}", State.IDLE) for i in range(n)]
        for session in sessions:
            session.proc = FakeWorker(session, stopping, peak)  # type: ignore[assignment]

        def to_worker(session: Session, msg: object) -> bool:
            session.proc.asked_to_stop()  # type: ignore[union-attr]
            return True

        killer = Killer(
            ctx,  # type: ignore[arg-type]
            SimpleNamespace(transition=lambda s, e, r=None: setattr(s, "state", State.STOPPING)),  # type: ignore[arg-type]
            SimpleNamespace(fail_queue=lambda *a: None),  # type: ignore[arg-type]
            SimpleNamespace(),  # type: ignore[arg-type]
            SimpleNamespace(to_worker=to_worker),  # type: ignore[arg-type]
        )
        done = await asyncio.gather(*(killer.kill_session(s, force=False) for s in sessions))
        assert {how for _, how in done} == {"stopped"}

    asyncio.run(main())
    return peak[0]


def test_a_shutdown_or_a_drain_stops_a_few_workers_at_a_time() -> None:
    assert _stop_all(accepting=False, draining=False) == STOPS_AT_ONCE < 40
    assert _stop_all(accepting=True, draining=True) == STOPS_AT_ONCE


def test_stops_while_sessions_are_admitted_are_not_held_back() -> None:
    # A stop parked behind others would keep its descriptors while a new
    # session took its slot (see kills.py).
    assert _stop_all(accepting=True, draining=False) == 40
