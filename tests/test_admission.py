"""Admission: whether a session may start a worker now. A failed session is
refused until its cool-down has passed; at max_sessions the least recently
used idle session is stopped to make room, and with none idle the request
is refused as `overloaded`. The count of running workers that decides it is
kept by the state transitions. The real parts, with a fake pool and fake
endpoints (no process, no socket)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from hermes_sup.protocol import ErrorCode, Kind
from hermes_sup.supervisor.states import State

from .fakes import Rig, exited_with, settle


@pytest.fixture
def rig(tmp_path, monkeypatch) -> Callable[..., Rig]:
    return lambda **settings: Rig(tmp_path, monkeypatch, **settings)


def test_a_failed_session_is_refused_until_its_cool_down_has_passed(rig) -> None:
    h = rig(failed_cooldown=300.0)

    async def scenario() -> None:
        h.send("a", "hi")
        await h.forked("a")
        h.exit("a", exited_with(71))  # cannot load its runtime: failed at once
        session = h.table.require("a")
        assert session.state is State.FAILED

        h.clock.advance(200.0)
        refused = h.send("a", "again")
        (error,) = h.finals(refused)
        assert error.body["code"] == ErrorCode.SESSION_FAILED.value
        assert "could not load its agent runtime" in error.body["message"]
        assert "wait 100s" in error.body["message"]  # what is left of the cool-down
        assert not session.queue and h.turns.queued_total == 0
        assert len(h.spawn_requests("a")) == 1

        h.clock.advance(101.0)
        accepted = h.send("a", "again")
        assert h.finals(accepted) == []
        assert h.statuses(accepted) == [{"state": "queued", "position": 1}]
        assert session.state is State.STARTING and session.fast_failures == 0
        assert len(h.spawn_requests("a")) == 2
        reasons = [body["data"]["reason"] for kind, body in session.history if kind == "state"]
        assert reasons[-2:] == ["cool-down passed", None]  # cleared, then spawned

    h.run(scenario())


def test_killing_a_failed_session_clears_it_at_once(rig) -> None:
    h = rig(failed_cooldown=300.0)

    async def scenario() -> None:
        h.send("a", "hi")
        await h.forked("a")
        h.exit("a", exited_with(71))
        session = h.table.require("a")
        pid, how = await h.lifecycle.killer.kill_session(session, force=False)
        assert (pid, how) == (None, "cleared")
        assert session.state is State.EXITED and session.fast_failures == 0
        h.send("a", "again")
        assert session.state is State.STARTING

    h.run(scenario())


def test_at_max_sessions_the_least_recently_used_idle_session_makes_room(rig) -> None:
    h = rig(max_sessions=2)

    async def scenario() -> None:
        def counted() -> None:
            assert h.table.running == h.running_recount()

        h.send("a", "hi")
        counted()
        await h.started("a")
        h.reply("a", "one")
        h.send("b", "hi")
        await h.started("b")
        h.reply("b", "one")
        h.send("a", "more")  # a is used again: b is now the one used longest ago
        h.reply("a", "two")
        counted()
        assert h.table.running == 2

        for_c = h.send("c", "hi")
        assert h.finals(for_c) == []
        await settle()  # the eviction runs as a task
        a, b, c = (h.table.require(k) for k in "abc")
        assert b.state is State.STOPPING and a.state is State.IDLE
        assert c.state is State.STARTING
        assert [m.kind for m in h.to_worker("b", Kind.STOP)] == [Kind.STOP]
        assert "evicted to make room (max_sessions 2)" in (b.kill_reason or "")
        counted()
        assert h.table.running == 2  # a and c: a stopping worker is not counted

        h.exit("b", exited_with(0))
        await settle()
        assert b.state is State.EXITED and b.fast_failures == 0
        counted()

    h.run(scenario())


def test_at_max_sessions_with_none_idle_a_new_session_is_refused_as_overloaded(rig) -> None:
    h = rig(max_sessions=2)

    async def scenario() -> None:
        h.send("a", "hi")
        h.send("b", "hi")
        await h.started("a")
        await h.started("b")
        assert h.table.require("a").state is State.BUSY
        assert h.table.require("b").state is State.BUSY

        refused = h.send("c", "hi")
        (error,) = h.finals(refused)
        assert error.body["code"] == ErrorCode.OVERLOADED.value
        assert "all 2 session slots are busy" in error.body["message"]
        assert h.spawn_requests("c") == [] and h.turns.queued_total == 0
        await settle()
        assert h.to_worker("a", Kind.STOP) == [] and h.to_worker("b", Kind.STOP) == []

        h.reply("a", "done")  # now a is idle: it makes room
        h.send("c", "hi")
        await settle()
        assert h.table.require("a").state is State.STOPPING
        assert len(h.spawn_requests("c")) == 1

    h.run(scenario())


def test_a_starting_session_takes_a_slot_and_a_backed_off_one_gives_it_back(rig) -> None:
    h = rig(max_sessions=1, backoff_base=10.0)

    async def scenario() -> None:
        h.send("a", "hi")
        assert h.table.running == 1  # STARTING counts: its worker is being made
        refused = h.send("b", "hi")
        assert h.finals(refused)[0].body["code"] == ErrorCode.OVERLOADED.value
        await h.forked("a")
        h.exit("a", exited_with(1))  # before its hello: backs off
        assert h.table.require("a").state is State.BACKOFF
        assert h.table.running == h.running_recount() == 0
        h.send("b", "hi")
        assert h.table.require("b").state is State.STARTING
        assert h.table.running == 1

    h.run(scenario())
