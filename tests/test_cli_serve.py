"""What `serve` and a long `send` tell the person waiting, and serve's JSON log (`--log-format json`): each with the real command,
on a pseudo-terminal where a person would watch."""

from __future__ import annotations

import json
import os
import sys
import time

import pexpect
import pytest

from hermes_sup.cli.serve_log import parse_kv
from hermes_sup.protocol import Kind

from .test_faults import until


def test_json_log_lines_carry_their_fields(supervisor_factory) -> None:
    sup = supervisor_factory("--log-format", "json")
    with sup.client() as client:
        pid = int(client.run("tg:-1001:thread-5", "pid").text)
    # "spawned" is written when the zygote's answer is read, which may come
    # after the worker's own reply: wait for it.
    deadline = time.monotonic() + 20
    while '"spawned"' not in sup.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    lines = [json.loads(line) for line in sup.log().splitlines() if line.strip()]
    assert all({"ts", "level", "logger"} <= set(item) for item in lines)
    spawned = next(item for item in lines if item.get("event") == "spawned")
    assert spawned["session"] == "tg:-1001:thread-5" and spawned["pid"] == str(pid)
    assert spawned["level"] == "info" and spawned["ts"].endswith("Z")
    ready = next(item for item in lines if item.get("event") == "ready" and "control" in item)
    assert ready["control"] == f"ipc://{sup.state_dir}/control.sock"


def test_parse_kv_reads_back_quoted_values() -> None:
    assert parse_kv('exited session=a:1 reason="killed by \\"us\\"" pid=7') == {
        "event": "exited",
        "session": "a:1",
        "reason": 'killed by "us"',
        "pid": "7",
    }
    assert parse_kv("Traceback (most recent call last):") is None
    assert parse_kv('bad_request error=""') == {"event": "bad_request", "error": ""}


@pytest.mark.e2e
def test_ctrl_c_of_serve_says_what_it_waits_for(workdir) -> None:
    state, data = workdir / "s", workdir / "d"
    child = pexpect.spawn(
        sys.executable,
        ["-m", "hermes_sup.cli", "serve", "--state-dir", str(state), "--data-dir", str(data)]
        + ["--shutdown-grace", "30"],
        encoding="utf-8",
        timeout=30,
        env=dict(os.environ, NO_COLOR="1"),
    )
    try:
        child.expect(r" ready pid=\d+ control=")
        from hermes_sup.client import Client

        with Client(state, timeout=10) as client:
            client.submit(Kind.SEND, {"text": "sleep 60"}, session="busy")
            until(lambda: client.sessions() and client.sessions()[0]["state"] == "busy")
            child.sendintr()
            child.expect(
                "running turns get up to 30s to finish, then every worker is stopped; "
                "press Ctrl-C again to stop them now"
            )
            child.sendintr()
            child.expect("stopping every worker now")
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == 0
    finally:
        child.close(force=True)


def test_a_long_send_says_it_still_waits(supervisor) -> None:
    child = pexpect.spawn(
        sys.executable,
        ["-m", "hermes_sup.cli", "--state-dir", str(supervisor.state_dir), "send", "slow"]
        + ["sleep 6.5"],
        encoding="utf-8",
        timeout=30,
        env=dict(os.environ, NO_COLOR="1"),
    )
    try:
        child.expect(r"still waiting for slow \(\ds without news; Ctrl-C cancels the turn\)")
        child.expect("slept 6.5")
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == 0
    finally:
        child.close(force=True)
