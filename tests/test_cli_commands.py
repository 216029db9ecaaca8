"""The commands operators reach for (issue 18, "Missing commands" and items
10, 13): open/start, restart, signal, inspect, events, logs from disk with
the supervisor down, --version; each the real CLI against a real supervisor."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from importlib import metadata

from hermes_sup.cli.show import clock
from hermes_sup.protocol import session_dir_name

from .clirunner import hermes_sup
from .test_faults import until


def hs(sup, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hermes_sup.cli", "--state-dir", str(sup.state_dir), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        env=dict(os.environ, NO_COLOR="1"),
    )


def row(sup, key: str) -> dict:
    with sup.client() as client:
        return next(r for r in client.sessions() if r["key"] == key)


def test_open_and_start_start_a_worker_without_a_turn(supervisor) -> None:
    opened = hs(supervisor, "open", "tg:42", "--session-env", "platform=telegram")
    assert opened.returncode == 0, opened.stderr
    assert opened.stdout.startswith("tg:42: created and started")
    assert until(lambda: row(supervisor, "tg:42")["state"] == "idle")
    assert row(supervisor, "tg:42")["turns"] == 0
    again = hs(supervisor, "start", "tg:42", "--json")
    assert again.returncode == 0
    assert json.loads(again.stdout)["created"] is False
    with supervisor.client() as client:
        assert client.run("tg:42", "env HERMES_SESSION_PLATFORM").text == "telegram"


def test_restart_gives_the_session_a_fresh_worker(supervisor) -> None:
    with supervisor.client() as client:
        old = int(client.run("r1", "pid").text)
        client.run("r1", "setenv MARK kept-on-disk")
    result = hs(supervisor, "restart", "r1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"r1: stopped (pid {old}); started pid ")
    new = row(supervisor, "r1")["pid"]
    assert new is not None and new != old
    with supervisor.client() as client:
        assert int(client.run("r1", "pid").text) == new  # a new process
        # ...on the session's data, as Hermes's state.db is: the probe keeps
        # what setenv set in the session's home.
        assert client.run("r1", "env MARK").text == "kept-on-disk"
    ghost = hs(supervisor, "restart", "nobody")
    assert ghost.returncode == 1 and "no session 'nobody'" in ghost.stderr


def test_signal_reaches_the_worker(supervisor) -> None:
    with supervisor.client() as client:
        pid = int(client.run("s1", "pid").text)
    sent = hs(supervisor, "signal", "term", "s1")
    assert sent.returncode == 0, sent.stderr
    assert sent.stdout.strip() == f"s1: sent SIGTERM to pid {pid}"
    # Exited, or backing off if it had run for less than min_uptime.
    assert until(lambda: row(supervisor, "s1")["pid"] is None)
    assert "SIGTERM" in row(supervisor, "s1")["last_exit"]
    bad = hs(supervisor, "signal", "SIGNOPE", "s1")
    assert bad.returncode == 2 and "not a signal name or number" in bad.stderr  # usage
    idle = hs(supervisor, "signal", "HUP", "s1")
    assert idle.returncode == 1 and "no running worker to signal" in idle.stderr


def test_inspect_names_directories_options_and_env_names_not_values(supervisor) -> None:
    with supervisor.client() as client:
        client.open("alice", session_env={"platform": "web"}, env={"API_TOKEN": "s3cr3t-value"})
        client.run("alice", "pid")
    shown = hs(supervisor, "inspect", "alice")
    assert shown.returncode == 0, shown.stderr
    digest = session_dir_name("alice")
    data = supervisor.data_dir / "sessions" / digest
    assert f"data:       {data}" in shown.stdout
    assert f"log:        {data / 'worker.log'}" in shown.stdout
    assert "session_env PLATFORM=web" in shown.stdout and "env API_TOKEN" in shown.stdout
    assert "s3cr3t-value" not in shown.stdout
    info = json.loads(hs(supervisor, "inspect", "alice", "--json").stdout)
    assert info["dir"] == str(data) and info["workspace"] == str(data / "workspace")
    assert info["home"] == str(data / "home") and info["pid"] == row(supervisor, "alice")["pid"]
    assert {"HERMES_HOME", "HERMES_SESSION_KEY", "API_TOKEN", "HERMES_SESSION_PLATFORM"} <= set(
        info["env_names"]
    )
    assert "s3cr3t-value" not in json.dumps(info)
    assert info["options"]["env"] == ["API_TOKEN"]
    assert [h["state"] for h in info["state_history"]][:2] == ["starting", "idle"]
    # Each step of the history says when it happened.
    started = info["state_history"][0]["at"]
    assert abs(started - info["started"]) < 60
    assert f"history:    {clock(started)} exited -> starting" in shown.stdout
    missing = hs(supervisor, "inspect", "nobody")
    assert missing.returncode == 1 and "no session 'nobody'" in missing.stderr


def test_events_streams_every_session_as_json_lines(supervisor) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "hermes_sup.cli", "--state-dir", str(supervisor.state_dir)]
        + ["events", "--json"],
        stdout=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True)
    reader.start()
    try:
        with supervisor.client() as client:
            # Turns until the first event shows: then it is subscribed.
            while lines.empty():
                client.run("warm-up", "pid")
                time.sleep(0.2)
            client.run("ev", "sh echo seen-by-events")
        seen = []
        while not seen or seen[-1]["type"] != "reply":
            item = json.loads(lines.get(timeout=20))
            if item["session"] == "ev":
                seen.append(item)
        types = [i["type"] for i in seen]
        assert types[:2] == ["state", "state"] and "turn" in types
        output = next(i for i in seen if i["type"] == "output")
        assert output["data"] == "seen-by-events" and output["turn"] == seen[-1]["turn"]
        assert seen[0]["data"]["state"] == "starting" and "turn" not in seen[0]
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 0


def test_logs_from_the_data_dir_with_the_supervisor_down(supervisor_factory, workdir) -> None:
    sup = supervisor_factory()
    with sup.client() as client:
        client.run("down", "pid")
    live = hs(sup, "logs", "down")
    sup.stop()
    assert hs(sup, "logs", "down").returncode == 3  # needs the supervisor
    offline = hs(sup, "logs", "down", "--data-dir", str(sup.data_dir))
    assert offline.returncode == 0, offline.stderr
    assert offline.stdout == live.stdout
    unknown = hs(sup, "logs", "other", "--data-dir", str(sup.data_dir))
    assert unknown.returncode == 1 and "no session 'other'" in unknown.stderr
    wrong = hs(sup, "logs", "down", "--data-dir", str(workdir))
    assert wrong.returncode == 1 and "holds no sessions" in wrong.stderr


def test_version(tmp_path) -> None:
    result = hermes_sup("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"hermes-sup, version {metadata.version('hermes-sup')}"
