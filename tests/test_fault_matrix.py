"""Faults around turns in flight, with clients that retry by turn id: two
supervisors on one shared data directory behind a real router, every fault
a real signal to a real process. Each turn appends its id to a file in its
session's workspace, so a second run would show; after each fault the
client learns the turn's end (or that it was interrupted), never a second
run of it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from hermes_sup.client import Client, NotRunning, SupervisorError, Timeout
from hermes_sup.protocol import session_dir_name

from . import waiting
from .test_route import RouterProcess, owner, shared_cluster  # noqa: F401 (a fixture)


def runs(workdir: Path, key: str) -> list[str]:
    path = workdir / "shared" / "sessions" / session_dir_name(key) / "workspace" / "runs.txt"
    return path.read_text().split() if path.exists() else []


def key_on(node: str, prefix: str) -> str:
    return next(f"{prefix}:{i}" for i in range(1000) if owner(f"{prefix}:{i}") == node)


def retry(state_dir: Path, key: str, text: str, turn_id: str) -> object:
    """What a front end does after a fault: send the same turn again, by its
    id, until the answer is an end (a reply or an error other than the
    router or node being away)."""

    def attempt() -> object | None:
        try:
            with Client(state_dir, timeout=60.0) as c:
                return c.run(key, text, turn_id=turn_id)
        except SupervisorError as exc:
            return None if exc.code in ("node_lost", "moved") else exc
        except (NotRunning, Timeout):
            return None

    return waiting.wait_for(attempt, timeout=120.0, every=0.5, what=f"an end for {turn_id}")


@pytest.mark.e2e
def test_no_fault_runs_a_turn_twice_or_leaves_its_fate_unknown(shared_cluster, workdir):  # noqa: F811
    sups, router = shared_cluster
    nodes_file = workdir / "nodes.toml"

    # The router is killed while a turn runs, and started again: the retry
    # joins the turn on its node (or reads its end there).
    key = key_on("a", "router")
    text = "sh echo router-1 >> runs.txt; sleep 2; echo finished"
    with Client(router.state_dir, timeout=60.0) as c:
        turn = c.send(key, text, turn_id="router-1")
        next(iter(turn))
        waiting.wait_for(lambda: runs(workdir, key) == ["router-1"], what="the turn running")
    router.proc.send_signal(signal.SIGKILL)
    router.proc.wait()
    router._log.close()
    router = RouterProcess(workdir, nodes_file)
    try:
        router.wait_nodes({"a", "b"})
        reply = retry(router.state_dir, key, text, "router-1")
        assert getattr(reply, "ok", False) and reply.text == "exit 0", reply  # type: ignore[attr-defined]
        assert runs(workdir, key) == ["router-1"]

        # A node frozen (SIGSTOP) longer than the router's heartbeat: the
        # router takes it for lost, the other node cannot take the session
        # (the frozen one still holds its lease) and the retry waits; the
        # node wakes, and the turn ends where it ran.
        key = key_on("b", "frozen")
        text = "sh echo frozen-1 >> runs.txt; sleep 1"
        with Client(router.state_dir, timeout=60.0) as c:
            turn = c.send(key, text, turn_id="frozen-1")
            next(iter(turn))
            waiting.wait_for(lambda: runs(workdir, key) == ["frozen-1"], what="the turn running")
            os.kill(sups["b"].pid, signal.SIGSTOP)
            try:
                router.wait_nodes({"a"}, timeout=60.0)
                time.sleep(1.0)  # past the turn's own end, on the worker's side
            finally:
                os.kill(sups["b"].pid, signal.SIGCONT)
            try:
                first = turn.collect()
            except SupervisorError as exc:
                first = exc
        reply = (
            first if getattr(first, "ok", False) else retry(router.state_dir, key, text, "frozen-1")
        )
        assert getattr(reply, "ok", False), reply
        assert runs(workdir, key) == ["frozen-1"]
        router.wait_nodes({"a", "b"})

        # A node killed (SIGKILL) while its turn runs: the router sends the
        # turn to the other node, which shares the data and answers from the
        # session's journal once the lease is free: interrupted, not run again.
        key = key_on("a", "killed")
        text = "sh echo killed-1 >> runs.txt; sleep 60"
        with Client(router.state_dir, timeout=60.0) as c:
            turn = c.send(key, text, turn_id="killed-1")
            next(iter(turn))
            waiting.wait_for(lambda: runs(workdir, key) == ["killed-1"], what="the turn running")
            os.kill(sups["a"].pid, signal.SIGKILL)
            sups["a"].proc.wait()
            with pytest.raises(SupervisorError) as lost:
                turn.collect()
            assert lost.value.code == "interrupted", lost.value
            # ...and so does every retry, and the status says so.
            with pytest.raises(SupervisorError) as again:
                c.run(key, text, turn_id="killed-1")
            assert again.value.code == "interrupted"
            state = c.turn_status(key, "killed-1")
            assert state["state"] == "ended" and state["outcome"]["body"]["code"] == "interrupted"

        # The killed node is started again on the same data: the turn is
        # still not run again there (its journal), and new turns run.
        sups["a"].start()
        router.wait_nodes({"a", "b"})
        with Client(router.state_dir, timeout=60.0) as c:
            with pytest.raises(SupervisorError) as after:
                c.run(key, text, turn_id="killed-1")
            assert after.value.code == "interrupted"
            assert c.run(key, "sh echo killed-2 >> runs.txt", turn_id="killed-2").ok
        assert runs(workdir, key) == ["killed-1", "killed-2"]
    finally:
        router.stop()
