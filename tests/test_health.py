"""Hung means hung: silence the supervisor did not hear, or that a busy
worker could not help, is not a hang (supervisor/health.py).

Real supervisors and workers, short heartbeat limits, and no deadline a
loaded machine would miss: every wait is for something the supervisor says
or does, with a generous bound.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest

from hermes_sup.protocol import Kind

from .test_faults import final, row, wait_running
from .waiting import wait_for

# Limits short enough that a stop of a few seconds is many times them.
FAST = (
    "--heartbeat-timeout",
    "1",
    "--heartbeat-interval",
    "0.25",
    "--idle-heartbeat-interval",
    "0.3",
)


@pytest.mark.parametrize("also_workers", [False, True], ids=["supervisor", "paused-vm"])
def test_a_stopped_supervisor_wakes_and_kills_no_session(
    supervisor_factory, also_workers: bool
) -> None:
    """A supervisor that was not running (SIGSTOP, a paused VM, a stalled
    machine) heard no heartbeats meanwhile; the workers were fine. When it
    runs again it must not take them for hung. Stopped alone, its workers'
    beats wait in its socket; stopped with them (as in a paused VM), none
    were sent, and the supervisor runs again a moment before they do."""
    sup = supervisor_factory(*FAST)
    keys = [f"s{i}" for i in range(8)]
    with sup.client() as client:
        pids = {key: int(client.run(key, "pid").text) for key in keys}
        # And one with a turn running, which beats on the shorter interval.
        req = client.submit(Kind.SEND, {"text": "sleep 8"}, session="busy")
        busy = wait_running(client, req)
        workers = [*pids.values(), busy] if also_workers else []
        os.kill(sup.pid, signal.SIGSTOP)
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(5.0)  # five times the heartbeat limit, whatever the load
        finally:
            os.kill(sup.pid, signal.SIGCONT)
            for pid in workers:
                os.kill(pid, signal.SIGCONT)
        # Its first tick after waking is where it used to kill them.
        wait_for(
            lambda: " gap " in sup.log() or " hung " in sup.log(),
            timeout=30,
            what="the supervisor to notice it was not running",
        )
        assert " hung " not in sup.log()
        for key in keys:
            assert int(client.run(key, "pid").text) == pids[key], key
        msg = final(client, req)
        assert msg.kind is Kind.REPLY and msg.body["text"] == "slept 8"
        assert row(client, "busy")["pid"] == busy
    assert " hung " not in sup.log()


def test_a_stopped_worker_is_still_replaced(supervisor_factory) -> None:
    """A worker that is stopped (state T) makes no progress: hung, as before."""
    sup = supervisor_factory(*FAST)
    with sup.client() as client:
        req = client.submit(Kind.SEND, {"text": "sleep 60"}, session="frozen")
        pid = wait_running(client, req)
        os.kill(pid, signal.SIGSTOP)
        try:
            msg = final(client, req, timeout=30)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        assert msg.kind is Kind.ERROR and msg.body["code"] == "worker_died"
        assert "hung" in msg.body["message"]
        assert int(client.run("frozen", "pid").text) != pid
    assert " hung session=frozen" in sup.log()


def test_a_busy_worker_that_cannot_beat_is_slow_not_hung(supervisor_factory) -> None:
    """A turn that keeps the heartbeat from being sent while it burns CPU
    (the probe's `spin` holds the GIL) is given more time, within bounds."""
    sup = supervisor_factory(*FAST)
    with sup.client(timeout=60) as client:
        pid = int(client.run("spinner", "pid").text)
        reply = client.run("spinner", "spin 2.5")
        assert reply.text.startswith("spun"), reply.text
        assert int(client.run("spinner", "pid").text) == pid
    log = sup.log()
    assert " hung " not in log and " slow session=spinner" in log


def test_a_worker_busy_without_beats_for_too_long_is_still_hung(supervisor_factory) -> None:
    """Progress buys a silent worker a bounded number of extra limits: one
    spinning without heartbeats for ever is replaced all the same."""
    sup = supervisor_factory(*FAST)
    with sup.client(timeout=60) as client:
        pid = int(client.run("forever", "pid").text)
        req = client.submit(Kind.SEND, {"text": "spin 60"}, session="forever")
        msg = final(client, req, timeout=60)
        assert msg.kind is Kind.ERROR and msg.body["code"] == "worker_died"
        assert "hung" in msg.body["message"] and "busy on CPU" in msg.body["message"]
        assert int(client.run("forever", "pid").text) != pid
    log = sup.log()
    assert log.count(" slow session=forever") == 3
    assert " hung session=forever" in log and "busy=cpu" in log
