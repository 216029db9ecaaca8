"""Leases with a deadline (supervisor/node_lease.py, leases.py), without
processes: a node renews its lease only while routers reach it, gives its
sessions up before the lease runs out, and another node may take a
session whose holder's lease ran out (its lock broken, its epoch fenced)."""

from __future__ import annotations

import json
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hermes_sup.supervisor.leases import LeaseHeld, LeaseLost, Leases
from hermes_sup.supervisor.node_lease import (
    SKEW,
    NodeLease,
    lease_path,
    node_expired,
    read_deadline,
    write_deadline,
)


def leases(node: str, data: Path) -> Leases:
    held = Leases(node)
    held.expired = partial(node_expired, data)
    return held


def test_a_lock_whose_holders_lease_ran_out_is_broken_and_the_holder_fenced(
    tmp_path: Path,
) -> None:
    session = tmp_path / "sessions" / "s1"
    session.mkdir(parents=True)
    x, y = leases("x", tmp_path), leases("y", tmp_path)
    held = x.take(session)

    # No node lease file: x holds it by its lock alone, as ever.
    with pytest.raises(LeaseHeld) as refused:
        y.take(session)
    assert refused.value.holder is not None and refused.value.holder.node == "x"

    # x's lease is live: still held.
    write_deadline(tmp_path, "x", time.time() + 5)
    with pytest.raises(LeaseHeld):
        y.take(session)
    # Run out, but within the clock skew allowed: still held.
    write_deadline(tmp_path, "x", time.time() - SKEW / 2)
    with pytest.raises(LeaseHeld):
        y.take(session)

    # Run out: y takes it, with a new epoch; x, waking, finds it fenced.
    write_deadline(tmp_path, "x", time.time() - SKEW - 1)
    taken = y.take(session)
    assert taken.epoch == held.epoch + 1
    with pytest.raises(LeaseLost, match="node y"):
        x.check(held)
    # A third node finds y's lease held (y's own node lease is not run out).
    with pytest.raises(LeaseHeld) as third:
        leases("z", tmp_path).take(session)
    assert third.value.holder is not None and third.value.holder.node == "y"
    x.release(held)
    y.release(taken)


def test_a_node_lease_file_that_cannot_be_read_never_runs_out(tmp_path: Path) -> None:
    assert read_deadline(tmp_path, "x") is None and not node_expired(tmp_path, "x")
    path = lease_path(tmp_path, "x")
    path.parent.mkdir()
    for junk in ("", "[]", '{"deadline": "soon"}', '{"deadline": true}'):
        path.write_text(junk)
        assert not node_expired(tmp_path, "x", now=time.time() + 1e9)
    path.write_text(json.dumps({"node": "x", "deadline": 100.0}))
    assert node_expired(tmp_path, "x", now=100.0 + SKEW + 0.1)
    assert not node_expired(tmp_path, "x", now=100.0 + SKEW - 0.1)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Owner:
    """The two Ownership calls a node lease makes, recorded."""

    def __init__(self) -> None:
        self.released: list[str] = []
        self.lost: list[tuple[str, str]] = []

    def release(self, session: Any) -> None:
        session.lease = None
        self.released.append(session.key)

    def on_lease_lost(self, session: Any, why: str) -> None:
        self.lost.append((session.key, why))


def node_lease(tmp_path: Path) -> tuple[NodeLease, Clock, Owner, dict[str, Any]]:
    clock, owner = Clock(), Owner()
    sessions: dict[str, Any] = {
        "held": SimpleNamespace(key="held", lease=object()),
        "idle": SimpleNamespace(key="idle", lease=None),
    }
    lease = NodeLease(
        tmp_path,
        "x",
        5.0,
        sessions,
        owner,
        clock=clock,
        wall=lambda: clock.now,  # type: ignore[arg-type]
    )
    return lease, clock, owner, sessions


def test_a_node_renews_only_while_routers_reach_it_and_fences_itself_first(
    tmp_path: Path,
) -> None:
    lease, clock, owner, sessions = node_lease(tmp_path)

    def y_reached() -> None:  # the routers reach another node, y
        write_deadline(tmp_path, "y", clock.now + 5.0, heard=clock.now)

    y_reached()
    lease.tick()
    assert read_deadline(tmp_path, "x") is None  # not reached, y is: no lease

    lease.heard_from_router()
    lease.tick()
    assert read_deadline(tmp_path, "x") == 1005.0
    # Routers go on reaching it: renewed at each tick.
    for _ in range(10):
        clock.now += lease.every
        lease.heard_from_router()
        y_reached()
        lease.tick()
    assert read_deadline(tmp_path, "x") == clock.now + 5.0
    assert owner.lost == []

    # Cut off: it renews while the last ping is recent (half a lease time),
    # then stops; one renewal before its deadline it gives up its sessions.
    last_heard = clock.now
    while not owner.lost:
        clock.now += lease.every
        y_reached()
        lease.tick()
        assert clock.now - last_heard <= 1.5 * lease.lease_time
    deadline = read_deadline(tmp_path, "x")
    assert deadline is not None and clock.now < deadline  # before anyone may take them
    assert owner.released == ["held"] and sessions["held"].lease is None
    assert "no router reached it" in owner.lost[0][1]
    # Nothing more to give up; and back in touch, it renews again.
    clock.now += 10
    lease.tick()
    assert len(owner.lost) == 1
    lease.heard_from_router()
    lease.tick()
    assert read_deadline(tmp_path, "x") == clock.now + 5.0 and not lease.fenced


def test_when_the_routers_reach_no_node_no_session_is_given_up(tmp_path: Path) -> None:
    lease, clock, owner, _ = node_lease(tmp_path)
    write_deadline(tmp_path, "y", clock.now + 5.0, heard=clock.now)
    lease.heard_from_router()
    lease.tick()
    # Every router stops: y is not reached either (its last ping ages as
    # ours does). Nobody is cut off from anyone: x keeps renewing.
    for _ in range(60):
        clock.now += lease.every
        lease.tick()
    assert owner.lost == []
    assert read_deadline(tmp_path, "x") == clock.now + 5.0


def test_a_node_that_wakes_from_a_freeze_fences_itself_before_it_renews(tmp_path: Path) -> None:
    lease, clock, owner, _ = node_lease(tmp_path)
    lease.heard_from_router()
    lease.tick()
    # Frozen for 60 s; a router's ping is the first thing it reads on waking.
    clock.now += 60
    lease.heard_from_router()
    lease.tick()
    assert [key for key, _ in owner.lost] == ["held"]
    assert read_deadline(tmp_path, "x") == clock.now + 5.0  # renewed after, not before


def test_ray_up_gives_nodes_a_lease_only_with_a_shared_data_directory() -> None:
    from hermes_sup.cli.ray import RayUpSettings, serve_args_for

    shared = RayUpSettings(data_dir=Path("/shared"), serve_args=("--runtime", "probe"))
    assert serve_args_for(shared) == ["--runtime", "probe", "--lease-time", "5"]
    assert serve_args_for(RayUpSettings(data_dir=Path("/shared"), lease_time=0)) == []
    assert serve_args_for(RayUpSettings()) == []  # data of its own: nobody else could take it


def test_the_agents_watchdog_kills_a_silent_supervisor_before_its_lease_runs_out(
    tmp_path: Path,
) -> None:
    from hermes_sup.cluster.watchdog import Watchdog, WatchdogSettings, lease_left

    # The agent reads the file the supervisor writes.
    assert lease_left(tmp_path, "x") is None
    write_deadline(tmp_path, "x", time.time() + 3.0)
    left = lease_left(tmp_path, "x")
    assert left is not None and 2.0 < left <= 3.0

    killed: list[int] = []
    answers = [True, False, False, False]
    remaining: list[float | None] = [None]

    def watchdog() -> Watchdog:
        return Watchdog(
            7,
            WatchdogSettings(every=1.0, timeout=2.0, misses=3),
            lambda timeout: answers.pop(0),
            kill=lambda pid, sig: killed.append(pid),
            lease_left=lambda: remaining[0],
        )

    # Far from its deadline (or no lease): the misses are counted as ever.
    dog = watchdog()
    remaining[0] = 30.0
    assert [dog.check() for _ in range(3)] == [None, None, None] and killed == []
    # Within one ping's time of it: the first miss kills.
    answers[:] = [True, False]
    dog = watchdog()
    assert dog.check() is None
    remaining[0] = 2.5
    why = dog.check()
    assert killed == [7] and why is not None and "node lease runs out in 2.5s" in why
