"""What a worker's exit means for its session, and for the turns waiting on
it: the restart policy (states.exit_event, states.backoff_delay) over its
whole table, and the lifecycle applying it, driven with a fake pool and fake
endpoints (no process is started)."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any

import pytest

from hermes_sup.protocol import ErrorCode, Kind
from hermes_sup.supervisor.spawner import ZygoteError
from hermes_sup.supervisor.states import Event, State, backoff_delay, exit_event

from .fakes import Rig, exited_with, killed_by, settle

# ------------------------------------------------------------------ policy

LONG = 60.0  # seconds of uptime: well past min_uptime
CASES = [
    # (was, accepting, load_failed, uptime, fast_failures) -> (event, fast_failures)
    pytest.param(State.STOPPING, True, False, 0.1, 3, Event.EXIT, 3, id="stopped"),
    pytest.param(State.STOPPING, True, True, 0.1, 0, Event.EXIT, 0, id="stopped-wins-over-load"),
    pytest.param(State.BUSY, False, False, 0.1, 2, Event.EXIT, 2, id="shutting-down"),
    pytest.param(State.STARTING, False, True, 0.1, 0, Event.EXIT, 0, id="shutting-down-wins"),
    pytest.param(State.IDLE, True, True, LONG, 0, Event.GIVE_UP, 0, id="cannot-load"),
    pytest.param(State.STARTING, True, True, 0.1, 1, Event.GIVE_UP, 1, id="cannot-load-at-start"),
    pytest.param(State.STARTING, True, False, 0.1, 0, Event.FAST_EXIT, 1, id="before-hello"),
    pytest.param(State.STARTING, True, False, LONG, 0, Event.FAST_EXIT, 1, id="slow-no-hello"),
    pytest.param(State.IDLE, True, False, 0.5, 1, Event.FAST_EXIT, 2, id="soon-after-start"),
    pytest.param(State.BUSY, True, False, 0.5, 2, Event.FAST_EXIT, 3, id="busy-soon"),
    pytest.param(State.STARTING, True, False, 0.1, 4, Event.GIVE_UP, 5, id="one-too-many"),
    pytest.param(State.IDLE, True, False, 0.5, 4, Event.GIVE_UP, 5, id="too-many-after-hello"),
    pytest.param(State.IDLE, True, False, LONG, 4, Event.EXIT, 0, id="ran-a-while-clears"),
    pytest.param(State.BUSY, True, False, 2.0, 3, Event.EXIT, 0, id="exactly-min-uptime"),
]


@pytest.mark.parametrize("was, accepting, load_failed, uptime, failures, event, after", CASES)
def test_an_exit_is_an_exit_a_fast_failure_or_giving_up(
    was: State,
    accepting: bool,
    load_failed: bool,
    uptime: float,
    failures: int,
    event: Event,
    after: int,
) -> None:
    got = exit_event(
        was,
        accepting=accepting,
        load_failed=load_failed,
        uptime=uptime,
        min_uptime=2.0,
        fast_failures=failures,
        max_fast_failures=5,
    )
    assert got == (event, after)


def test_every_event_the_policy_gives_is_a_move_the_state_table_has() -> None:
    """Whatever state a worker dies in, the session can take the event."""
    from hermes_sup.supervisor.states import LIVE_STATES, next_state

    for was in LIVE_STATES:
        for load_failed in (False, True):
            for uptime in (0.0, LONG):
                for accepting in (False, True):
                    event, _ = exit_event(
                        was,
                        accepting=accepting,
                        load_failed=load_failed,
                        uptime=uptime,
                        min_uptime=2.0,
                        fast_failures=0,
                        max_fast_failures=5,
                    )
                    next_state(was, event)  # raises InvalidTransition if not


def test_the_backoff_doubles_from_its_base_up_to_its_cap() -> None:
    delays = [backoff_delay(n, 0.5, 30.0) for n in range(1, 10)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert backoff_delay(1, 5.0, 2.0) == 2.0  # a cap below the base wins


# ------------------------------------------------------------- lifecycle


@pytest.fixture
def rig(tmp_path, monkeypatch) -> Callable[..., Rig]:
    return lambda **settings: Rig(tmp_path, monkeypatch, **settings)


async def warm_up(h: Rig) -> None:
    """A first session says hello: the runtime is known to start, so the
    next session's first turn rides in its spawn request."""
    req = h.send("warm", "hi")
    await h.started("warm")
    h.reply("warm", "hello")
    assert h.finals(req)[0].kind is Kind.REPLY


def errors(h: Rig, req: str) -> list[dict[str, Any]]:
    return [m.body for m in h.finals(req) if m.kind is Kind.ERROR]


def test_a_worker_that_dies_before_its_hello_backs_off_doubling_and_the_waiting_turn_is_told(
    rig,
) -> None:
    h = rig(backoff_base=0.01, backoff_cap=1.0)

    async def scenario() -> None:
        req = h.send("a", "hi")
        await h.forked("a")
        h.exit("a", exited_with(1))
        session = h.table.require("a")
        assert session.state is State.BACKOFF and session.fast_failures == 1
        backoff = [d for d in h.statuses(req) if d["state"] == "backoff"]
        assert backoff == [{"state": "backoff", "retry_in": 0.01, "reason": "exited with status 1"}]
        assert h.finals(req) == [] and list(session.queue)[0].id == req  # still waiting
        await h.advance(0.05)  # the retry timer (0.01 s) has fired
        assert len(h.spawn_requests("a")) == 2 and session.state is State.STARTING
        await h.forked("a")
        h.exit("a", exited_with(1))  # again, still before its hello
        retry_in = [d["retry_in"] for d in h.statuses(req) if d["state"] == "backoff"]
        assert retry_in == [0.01, 0.02]
        assert h.turns.queued_total == 1 and h.finals(req) == []

    h.run(scenario())


def test_a_back_off_ends_on_the_clock_however_slow_the_machine(rig) -> None:
    """A machine that stalls (here a real pause of three back-offs)
    does not end the back-off early, and one that is busy does not make it
    late: the retry comes when the clock reaches it, and only then."""
    h = rig(backoff_base=1 / 64)  # binary fractions: the clock's sums are exact

    async def scenario() -> None:
        h.send("a", "hi")
        await h.forked("a")
        h.exit("a", exited_with(1))
        time.sleep(0.05)  # the machine stalls: real time passes, the clock does not
        await settle()
        assert len(h.spawn_requests("a")) == 1
        await h.advance(1 / 128)
        assert len(h.spawn_requests("a")) == 1 and h.table.require("a").state is State.BACKOFF
        await h.advance(1 / 128)
        assert len(h.spawn_requests("a")) == 2 and h.table.require("a").state is State.STARTING

    h.run(scenario())


def test_after_too_many_fast_failures_the_session_fails_and_its_turns_say_how_many(rig) -> None:
    h = rig(max_fast_failures=2, backoff_base=0.01, failed_cooldown=300)

    async def scenario() -> None:
        first = h.send("a", "one")
        second = h.send("a", "two")
        await h.forked("a")
        h.exit("a", exited_with(1))
        await h.advance(0.05)  # retried
        await h.forked("a")
        h.exit("a", killed_by(signal.SIGSEGV))
        session = h.table.require("a")
        assert session.state is State.FAILED and session.fast_failures == 2
        for req in (first, second):
            (error,) = errors(h, req)
            assert error["code"] == ErrorCode.SESSION_FAILED.value
            assert "killed by SIGSEGV" in error["message"]
            assert "(2 fast failures in a row)" in error["message"]
            assert "wait 300s" in error["message"]
        assert not session.queue and h.turns.queued_total == 0
        await h.advance(0.05)
        assert len(h.spawn_requests("a")) == 2  # no retry once failed

    h.run(scenario())


def test_a_runtime_that_cannot_load_fails_the_session_at_once(rig) -> None:
    h = rig()

    async def scenario() -> None:
        req = h.send("a", "hi")
        await h.forked("a")
        h.exit("a", exited_with(71))
        session = h.table.require("a")
        assert session.state is State.FAILED and session.fast_failures == 0
        (error,) = errors(h, req)
        assert error["code"] == ErrorCode.SESSION_FAILED.value
        assert "could not load its agent runtime" in error["message"]
        assert "fast failures in a row" not in error["message"]  # one is not "in a row"

    h.run(scenario())


def test_a_worker_that_ran_a_while_fails_its_turn_and_the_next_one_gets_a_fresh_worker(
    rig,
) -> None:
    h = rig(min_uptime=2.0)

    async def scenario() -> None:
        running = h.send("a", "long job")
        proc = await h.started("a")
        waiting = h.send("a", "next")
        h.clock.advance(10.0)  # past min_uptime: not a fast failure
        h.exit("a", killed_by(signal.SIGKILL))
        session = h.table.require("a")
        (error,) = errors(h, running)
        assert error["code"] == ErrorCode.WORKER_DIED.value
        assert f"(pid {proc.pid})" in error["message"]
        assert "killed by SIGKILL" in error["message"]
        assert session.fast_failures == 0 and session.exits == 1
        # The waiting turn got no error: a fresh worker was asked for at once.
        assert h.finals(waiting) == []
        assert len(h.spawn_requests("a")) == 2 and session.state is State.STARTING
        # The runtime has started and the session is not failing: the
        # waiting turn rides in the new spawn request.
        assert h.spawn_requests("a")[1]["turn"] == {"id": waiting, "text": "next"}
        await h.started("a")
        assert [m.id for m in h.to_worker("a", Kind.TURN)] == [running]
        assert h.statuses(waiting)[-1]["state"] == "running"

    h.run(scenario())


def test_a_handed_turn_whose_worker_failed_to_boot_waits_for_the_next_worker(rig) -> None:
    """Exit 70 (or 71) before the hello is before any turn: the turn did not run."""
    h = rig(backoff_base=0.01)

    async def scenario() -> None:
        await warm_up(h)
        req = h.send("a", "hi")
        (request,) = h.spawn_requests("a")
        assert request["turn"] == {"id": req, "text": "hi"}  # handed over
        await h.forked("a")
        h.exit("a", exited_with(70))
        session = h.table.require("a")
        assert session.state is State.BACKOFF and session.current is None
        assert [t.id for t in session.queue] == [req] and h.turns.queued_total == 1
        assert h.finals(req) == []
        assert [d["state"] for d in h.statuses(req)][-1] == "backoff"
        await h.advance(0.05)  # retried: failing fast, so no handover this time
        assert "turn" not in h.spawn_requests("a")[1]
        await h.started("a")
        h.reply("a", "done")
        assert [m.kind for m in h.finals(req)] == [Kind.REPLY]

    h.run(scenario())


def test_a_handed_turn_whose_worker_crashed_before_its_hello_fails_once(rig) -> None:
    """A crash before the hello may have run the handed turn: it fails, never runs twice."""
    h = rig(backoff_base=0.01)

    async def scenario() -> None:
        await warm_up(h)
        req = h.send("a", "hi")
        assert "turn" in h.spawn_requests("a")[0]
        proc = await h.forked("a")
        h.exit("a", exited_with(1))
        session = h.table.require("a")
        (error,) = errors(h, req)
        assert error["code"] == ErrorCode.WORKER_DIED.value
        assert f"(pid {proc.pid})" in error["message"]
        assert not session.queue and session.current is None and h.turns.queued_total == 0
        await h.advance(0.05)
        assert len(h.spawn_requests("a")) == 1  # nothing waits: no retry

    h.run(scenario())


def test_a_handed_turn_cancelled_before_its_worker_failed_to_boot_ends_cancelled(rig) -> None:
    h = rig(backoff_base=0.01)

    async def scenario() -> None:
        await warm_up(h)
        req = h.send("a", "hi")
        await h.forked("a")
        h.cancel("a", req)
        h.exit("a", exited_with(70))
        session = h.table.require("a")
        (error,) = errors(h, req)
        assert error["code"] == ErrorCode.TURN_FAILED.value
        assert error["message"] == "cancelled before it started"
        assert not session.queue and h.turns.queued_total == 0
        assert session.cancel_on_hello is None

    h.run(scenario())


def test_a_handed_turn_whose_fork_failed_waits_for_the_next_worker(rig) -> None:
    h = rig(backoff_base=0.01)

    async def scenario() -> None:
        await warm_up(h)
        req = h.send("a", "hi")
        await h.fork_failed("a", ZygoteError("the zygote died"))
        session = h.table.require("a")
        assert session.state is State.BACKOFF and h.finals(req) == []
        assert [t.id for t in session.queue] == [req] and h.turns.queued_total == 1
        assert h.pool.spawning == 0  # the failed spawn was counted back

    h.run(scenario())
