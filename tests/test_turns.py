"""Turns from their queue to their one final answer: the first turn handed
over in the spawn request, cancels, the turn timeout, resends of the same
id, and the count of waiting turns. The real parts, with a fake pool and
fake endpoints (no process, no socket)."""

from __future__ import annotations

import signal
from collections.abc import Callable

import pytest

from hermes_sup.protocol import ErrorCode, Kind
from hermes_sup.supervisor.lifecycle import HANDOVER_TEXT
from hermes_sup.supervisor.resends import RESEND_SETTLE
from hermes_sup.supervisor.states import State

from .fakes import ALICE, BOB, Rig, exited_with, killed_by


@pytest.fixture
def rig(tmp_path, monkeypatch) -> Callable[..., Rig]:
    return lambda **settings: Rig(tmp_path, monkeypatch, **settings)


# ---------------------------------------------------------------- handover


def test_the_first_turn_rides_in_the_spawn_request_once_its_runtime_has_started(rig) -> None:
    h = rig()

    async def scenario() -> None:
        first = h.send("a", "hi")
        assert "turn" not in h.spawn_requests("a")[0]  # no worker of this runtime yet
        await h.started("a")
        assert [m.id for m in h.to_worker("a", Kind.TURN)] == [first]
        h.reply("a", "hello")

        second = h.send("b", "hi")
        assert h.spawn_requests("b")[0]["turn"] == {"id": second, "text": "hi"}
        session = h.table.require("b")
        assert session.current is not None and session.current.id == second
        assert not session.queue and h.turns.queued_total == 0
        proc = await h.started("b")
        # The worker had it already: it is not sent again, and its client
        # hears it runs once the hello shows the worker is up.
        assert h.to_worker("b", Kind.TURN) == []
        assert h.statuses(second)[-1] == {"state": "running", "pid": proc.pid}
        assert session.state is State.BUSY
        h.reply("b", "done")
        assert [m.body for m in h.finals(second)] == [{"text": "done"}]

    h.run(scenario())


def test_a_long_first_turn_or_another_runtime_waits_for_the_hello(rig) -> None:
    h = rig(runtimes=("other",))

    async def scenario() -> None:
        h.send("a", "hi")
        await h.started("a")
        h.reply("a", "hello")

        long = h.send("long", "x" * (HANDOVER_TEXT + 1))
        assert "turn" not in h.spawn_requests("long")[0]
        just_fits = h.send("fits", "x" * HANDOVER_TEXT)
        assert h.spawn_requests("fits")[0]["turn"]["id"] == just_fits
        other = h.send("o", "hi", runtime="other")
        assert h.spawn_requests("o")[0]["runtime"] == "other"
        assert "turn" not in h.spawn_requests("o")[0]  # never started yet
        new_config = h.send("cfg", "hi", agent={"model": "m2"})
        assert "turn" not in h.spawn_requests("cfg")[0]  # same runtime, other config

        for key, req in (("long", long), ("o", other), ("cfg", new_config)):
            await h.started(key)
            assert [m.id for m in h.to_worker(key, Kind.TURN)] == [req]

    h.run(scenario())


def test_a_session_failing_fast_gets_its_first_turn_after_the_hello(rig) -> None:
    h = rig(backoff_base=0.01)

    async def scenario() -> None:
        h.send("a", "hi")
        await h.started("a")
        h.reply("a", "hello")
        # Same runtime, known to start; but this session's worker crashes
        # before its hello, with nothing handed yet (the first turn was
        # given normally), so the turn stays queued.
        req = h.send("b", "x" * (HANDOVER_TEXT + 1))
        await h.forked("b")
        h.exit("b", exited_with(1))
        assert h.table.require("b").fast_failures == 1
        await h.advance(0.05)  # the retry
        assert "turn" not in h.spawn_requests("b")[1]
        await h.started("b")
        assert [m.id for m in h.to_worker("b", Kind.TURN)] == [req]

    h.run(scenario())


# ----------------------------------------------------------------- cancel


def test_a_turn_cancelled_while_its_worker_starts_is_cancelled_right_after_the_hello(
    rig,
) -> None:
    h = rig()

    async def scenario() -> None:
        h.send("warm", "hi")
        await h.started("warm")
        h.reply("warm", "hello")
        req = h.send("a", "hi")
        await h.forked("a")
        cancel = h.cancel("a")
        assert h.answers(cancel)[0].body == {"turn": req}
        assert h.to_worker("a", Kind.CANCEL) == []  # it cannot hear us yet
        h.hello("a")
        assert [m.body for m in h.to_worker("a", Kind.CANCEL)] == [{"turn": req}]
        assert h.table.require("a").cancel_on_hello is None

    h.run(scenario())


def test_a_queued_turn_cancelled_ends_at_once_and_never_runs(rig) -> None:
    h = rig()

    async def scenario() -> None:
        running = h.send("a", "one")
        queued = h.send("a", "two")
        await h.started("a")
        cancel = h.cancel("a", queued)
        assert h.answers(cancel)[0].body == {"turn": queued}
        (error,) = h.finals(queued)
        assert error.body == {
            "code": ErrorCode.TURN_FAILED.value,
            "message": "cancelled before it started",
        }
        h.reply("a", "done")
        assert [m.id for m in h.to_worker("a", Kind.TURN)] == [running]
        assert h.table.require("a").state is State.IDLE
        nothing = h.cancel("a", "no-such-turn")
        assert h.answers(nothing)[0].body == {"turn": None}

    h.run(scenario())


# ---------------------------------------------------------------- timeout


def test_a_turn_over_its_timeout_is_cancelled_and_a_worker_ignoring_it_is_killed(rig) -> None:
    h = rig(turn_timeout=0.01, cancel_grace=0.02)

    async def scenario() -> None:
        req = h.send("a", "forever")
        proc = await h.started("a")
        await h.advance(0.015)  # the turn timeout (0.01 s) has fired
        (error,) = h.finals(req)
        assert error.body["code"] == ErrorCode.TURN_TIMEOUT.value
        assert "0.01s turn timeout" in error.body["message"]
        assert [m.body for m in h.to_worker("a", Kind.CANCEL)] == [{"turn": req}]
        assert proc.signals == []  # it has cancel_grace to stop
        h.event("a", "late news")  # what it still says is not passed on
        assert [m.kind for m in h.answers(req)].count(Kind.EVENT) == 2  # queued, running
        await h.advance(0.05)  # cancel_grace has passed: killed, with its group
        assert proc.signals == [signal.SIGKILL]
        assert proc.group_signals == [signal.SIGKILL]
        session = h.table.require("a")
        assert "did not stop when cancelled" in (session.kill_reason or "")
        h.clock.advance(10.0)
        h.exit("a", killed_by(signal.SIGKILL))
        assert h.finals(req) == [error]  # still exactly one final answer
        assert session.state is State.EXITED

    h.run(scenario())


def test_a_worker_that_stops_its_timed_out_turn_keeps_running(rig) -> None:
    h = rig(turn_timeout=0.01, cancel_grace=0.02)

    async def scenario() -> None:
        req = h.send("a", "slow")
        behind = h.send("a", "next")
        proc = await h.started("a")
        await h.advance(0.015)
        (error,) = h.finals(req)
        h.reply("a", "cancelled", re=req)  # the worker gives up the turn
        assert h.finals(req) == [error]  # its late answer is dropped
        # The next turn runs on the same worker; the grace timer of the
        # abandoned turn does not touch it.
        assert [m.id for m in h.to_worker("a", Kind.TURN)] == [req, behind]
        h.reply("a", "quick")
        assert [m.body for m in h.finals(behind)] == [{"text": "quick"}]
        await h.advance(0.05)
        assert proc.signals == [] and proc.group_signals == []

    h.run(scenario())


# ---------------------------------------------------------------- resends


def test_a_turn_resent_by_a_reconnected_client_answers_it_and_never_runs_twice(rig) -> None:
    h = rig()

    async def scenario() -> None:
        req = h.send("a", "hi")
        await h.started("a")
        h.endpoints.gone.add(ALICE)  # alice gave up and closed; she resends as bob
        h.send("a", "hi", client=BOB, id=req)
        await h.advance(settle_resend())
        assert h.answers(req, BOB)[-1].body["data"] == {"state": "duplicate"}
        h.event("a", "progress")
        h.reply("a", "done")
        assert [m.kind for m in h.answers(req, BOB)][-2:] == [Kind.EVENT, Kind.REPLY]
        h.send("a", "hi", client=BOB, id=req)  # and again, after the answer
        assert [m.body for m in h.finals(req, BOB)] == [{"text": "done"}] * 2
        assert [m.id for m in h.to_worker("a", Kind.TURN)] == [req]  # ran once
        assert h.turns.queued_total == 0 and not h.table.require("a").queue

    h.run(scenario())


def test_a_turn_resent_while_it_waits_is_queued_and_run_only_once(rig) -> None:
    h = rig()

    async def scenario() -> None:
        req = h.send("a", "hi")
        h.send("a", "hi", id=req)  # the same client, say after a timeout
        h.send("a", "hi", client=BOB, id=req)  # and another one
        await h.advance(settle_resend())
        assert h.turns.queued_total == 1 and len(h.table.require("a").queue) == 1
        await h.started("a")
        h.reply("a", "done")
        assert [m.id for m in h.to_worker("a", Kind.TURN)] == [req]
        # One reply in all, to whichever client has the turn (a resend from
        # another connection may be refused, never answered by a second run).
        assert [m.kind for m in h.finals(req)].count(Kind.REPLY) == 1

    h.run(scenario())


def settle_resend() -> float:
    """How long a resend from another connection may wait before it is
    answered (it looks for the first connection first)."""
    return RESEND_SETTLE + 0.05


# ---------------------------------------------------------- queued_total


def test_the_count_of_waiting_turns_follows_every_queue(rig) -> None:
    """queued_total is kept, not counted (a `send` reads it): after each
    step it must equal the turns actually waiting."""
    h = rig(backoff_base=10.0)  # no retry while the test runs

    async def scenario() -> None:
        def consistent() -> None:
            assert h.turns.queued_total == h.queued_recount()

        h.send("a", "one")
        h.send("a", "two")
        three = h.send("a", "three")
        h.send("b", "one")
        consistent()
        assert h.turns.queued_total == 4
        await h.started("a")  # pump: "one" runs
        consistent()
        h.cancel("a", three)  # a queued turn taken out
        consistent()
        h.reply("a", "done")  # pump: "two" runs
        consistent()
        assert h.turns.queued_total == 1
        # b's worker fails to boot before its hello: its turn is still waiting.
        await h.forked("b")
        h.exit("b", exited_with(70))
        consistent()
        assert h.turns.queued_total == 1
        # A handed turn put back by a boot failure counts again.
        h.send("c", "one")  # the runtime has started (a): handed over
        consistent()
        assert h.table.require("c").current is not None
        await h.forked("c")
        h.exit("c", exited_with(70))
        consistent()
        assert h.turns.queued_total == 2
        # A kill fails what waits; a shutdown-like fail_queue empties the rest.
        h.send("a", "four")
        h.send("a", "five")
        consistent()
        await h.lifecycle.killer.kill_session(h.table.require("b"), force=False)  # clears BACKOFF
        consistent()
        for session in h.table.sessions.values():
            h.turns.fail_queue(session, ErrorCode.SHUTTING_DOWN, "stopping")
        consistent()
        assert h.turns.queued_total == 0

    h.run(scenario())
