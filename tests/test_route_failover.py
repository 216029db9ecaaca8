"""Clients that find a live router (client/failover.py): a list of routers,
used one at a time; a request that finds the one in use gone goes through
the next, a turn under its one id, so it runs once."""

from __future__ import annotations

import asyncio
import signal
import threading
from pathlib import Path

import pytest

from hermes_sup.client import (
    AsyncClient,
    AsyncRouters,
    Client,
    Connection,
    NoSuchSession,
    Routers,
    SupervisorError,
    Timeout,
)

from . import test_route
from .test_route import NODES, RouterProcess

cluster = test_route.cluster  # two supervisors behind a router (a fixture)


def routers(*names: str) -> Routers:
    return Routers([Connection(f"ipc:///nowhere/{n}", b"k" * 32) for n in names], timeout=1.0)


def test_a_router_that_does_not_answer_is_left_for_the_next() -> None:
    seen: list[str] = []

    def ask(c: Client) -> str:
        seen.append(c.connection.endpoint)
        if len(seen) == 1:
            raise Timeout("no answer")
        return "answered"

    with routers("a", "b") as rs:
        assert rs.call(ask) == "answered"
        assert seen == ["ipc:///nowhere/a", "ipc:///nowhere/b"]
        assert (rs.current, rs.failovers) == (1, 1)
        # It stays with the one that answered.
        assert rs.call(lambda c: c.connection.endpoint) == "ipc:///nowhere/b"


def test_node_lost_goes_round_and_any_other_error_is_the_answer() -> None:
    tries: list[str] = []

    def lost(c: Client) -> None:
        tries.append(c.connection.endpoint)
        raise SupervisorError("node_lost", "the node died")

    with routers("a", "b") as rs, pytest.raises(SupervisorError) as err:
        rs.call(lost)
    assert err.value.code == "node_lost"
    assert len(tries) == 4  # every router, twice (rounds=2)

    def missing(c: Client) -> None:
        raise NoSuchSession("no_such_session", "no session 'x'")

    with routers("a", "b") as rs, pytest.raises(NoSuchSession):
        rs.call(missing)
    assert rs.failovers == 0
    with pytest.raises(ValueError, match="at least one router"):
        Routers([])


def test_the_asyncio_form_fails_over_alike() -> None:
    seen: list[str] = []

    async def ask(c: AsyncClient) -> str:
        seen.append(c.connection.endpoint)
        if len(seen) == 1:
            raise SupervisorError("node_lost", "the node died")
        return "answered"

    async def main() -> tuple[str, int]:
        async with AsyncRouters(
            [Connection(f"ipc:///nowhere/{n}", b"k" * 32) for n in "ab"], timeout=1.0
        ) as rs:
            return await rs.call(ask), rs.failovers

    assert asyncio.run(main()) == ("answered", 1)
    assert seen == ["ipc:///nowhere/a", "ipc:///nowhere/b"]


@pytest.mark.e2e
def test_a_router_killed_mid_turn_costs_the_turn_one_resend_through_the_other(
    cluster, workdir: Path
) -> None:
    sups, first = cluster
    (workdir / "second").mkdir()
    second = RouterProcess(workdir / "second", workdir / "nodes.toml")
    try:
        second.wait_nodes(set(NODES))
        with Routers.local([first.state_dir, second.state_dir], timeout=30.0) as rs:
            assert rs.run("door:1", "env HERMES_SESSION_KEY").text == "door:1"
            # The first router is killed while the turn runs on its node.
            killer = threading.Timer(1.0, first.proc.send_signal, (signal.SIGKILL,))
            killer.start()
            try:
                reply = rs.run("door:1", "sh echo ran >> runs.txt && sleep 3 && echo done")
            finally:
                killer.join()
            assert reply.ok and [e.data for e in reply.events if e.type == "output"] == ["done"]
            assert rs.failovers == 1 and rs.current == 1
            ran = rs.run("door:1", "sh cat runs.txt")
            assert "".join(str(e.data) for e in ran.events if e.type == "output").split() == ["ran"]
    finally:
        second.stop()
        first.proc.wait()
