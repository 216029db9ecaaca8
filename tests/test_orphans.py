"""A turn whose client is gone longer than the `orphan_grace` its send asked
for is cancelled; one whose client comes back in time, or that asked for no
grace, runs on. Real supervisors, real client connections closed."""

from __future__ import annotations

from functools import partial

import pytest

from hermes_sup.client import SupervisorError

from . import waiting

wait_for = partial(waiting.wait_for, timeout=60.0, every=0.1)


def ended(sup, key: str, turn_id: str) -> dict | None:  # noqa: ANN001
    with sup.client() as c:
        state = c.turn_status(key, turn_id)
    return state if state["state"] == "ended" else None


def test_a_turn_whose_client_is_gone_past_its_grace_is_cancelled(supervisor_factory):
    sup = supervisor_factory()
    c = sup.client()
    orphan = c.send("alice", "sleep 60", turn_id="orphan-1", orphan_grace=0.5)
    next(iter(orphan))
    kept = c.send("bob", "sleep 60", turn_id="kept-1")  # no grace: runs on
    next(iter(kept))
    c.close()
    state = wait_for(lambda: ended(sup, "alice", "orphan-1"), what="the orphan cancelled")
    assert state["outcome"]["body"]["text"] == "cancelled", state
    assert "turn_orphaned" in sup.log()
    with sup.client() as again:
        assert again.turn_status("bob", "kept-1")["state"] == "running"
        # A retry learns the end; the session serves new turns.
        assert again.run("alice", "sleep 60", turn_id="orphan-1").text == "cancelled"
        assert again.run("alice", "echo next").ok
        assert again.cancel("bob", "kept-1")


def test_a_client_that_comes_back_within_the_grace_keeps_its_turn(supervisor_factory):
    sup = supervisor_factory()
    c = sup.client()
    turn = c.send("carol", "sleep 3", turn_id="back-1", orphan_grace=30)
    next(iter(turn))
    c.close()
    with sup.client(timeout=60) as back:
        reply = back.run("carol", "sleep 3", turn_id="back-1")
    assert reply.text == "slept 3"
    assert "turn_orphaned" not in sup.log()


@pytest.mark.parametrize("grace", [0, -1, 3601])
def test_a_bad_orphan_grace_is_refused_by_name(supervisor_factory, grace):
    sup = supervisor_factory()
    with sup.client() as c, pytest.raises(SupervisorError) as err:
        c.run("dave", "echo hi", orphan_grace=grace)
    assert err.value.code == "bad_field" and "orphan_grace" in str(err.value)
