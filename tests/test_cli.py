"""The operator CLI: click's CliRunner for parsing, a real supervisor for
behaviour, and a real pseudo-terminal (pexpect) for attach."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pexpect
import pytest
from click.testing import CliRunner

from hermes_sup.cli.common import parse_duration
from hermes_sup.cli.main import cli
from hermes_sup.protocol import Kind, session_dir_name
from hermes_sup.supervisor.logread import split_stamp

from .test_faults import RUNTIMES, until


def hs(sup, *args: str, env: dict[str, str] | None = None, input: str | None = None):
    """Run the real `hermes-sup` command against a supervisor."""
    cmd = [sys.executable, "-m", "hermes_sup.cli", "--state-dir", str(sup.state_dir), *args]
    return subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=60,
        input=input,
        env=env or dict(os.environ, NO_COLOR="1"),
    )


# ---------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    "cmd", ["serve", "send", "list", "status", "kill", "logs", "attach", "ping"]
)
def test_every_command_has_help_with_an_example(cmd: str) -> None:
    result = CliRunner().invoke(cli, [cmd, "--help"])
    assert result.exit_code == 0
    assert "Example" in result.output


@pytest.mark.parametrize(
    "args, words",
    [
        (["kill"], "name sessions to kill"),
        (["kill", "--idle-for", "soon"], "not a duration"),
        (["serve", "--env", "NOEQUALS"], "is not NAME=VALUE"),
        (["serve", "--memory-limit", "lots"], "is not a number"),
        (["list", "--state", "sleepy"], "sleepy"),
    ],
)
def test_usage_errors_exit_2_with_a_message(args: list[str], words: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["--state-dir", str(tmp_path), *args])
    assert result.exit_code == 2, result.output
    assert words in result.output


def test_durations() -> None:
    assert parse_duration("90") == 90
    assert parse_duration("90s") == 90
    assert parse_duration("10m") == 600
    assert parse_duration("1h30m") == 5400
    assert parse_duration("1d") == 86400


# ---------------------------------------------------------------- list, status


def test_list_table_is_sorted_with_whole_keys_and_totals(supervisor) -> None:
    long_key = "telegram:-1001234567890:thread:98765:user:424242"
    with supervisor.client() as client:
        for key in ("zeta", "alpha", long_key):
            client.run(key, "pid")
        # Busy until the test ends its turn, however long `list` takes.
        req = client.submit(Kind.SEND, {"text": "sleep 600"}, session="middle")
        while client.next().body.get("data", {}).get("state") != "running":
            pass
        result = hs(supervisor, "list")
        lines = result.stdout.splitlines()
        assert result.returncode == 0
        assert lines[0].split()[:3] == ["SESSION", "STATE", "PID"]
        keys = [line.split()[0] for line in lines[1:-1]]
        assert keys[0] == "middle"  # busy first
        assert keys[1:3] == ["alpha", long_key]  # whole: cut only on a narrow terminal
        assert "4 session(s): 1 busy, 3 idle" in lines[-1] and "runtime probe" in lines[-1]
        assert "\x1b[" not in result.stdout  # no colour when not a terminal
        client.cancel("middle", req)
        while client.next().kind is Kind.EVENT:
            pass


def test_list_json_filters_and_numbers(supervisor) -> None:
    with supervisor.client() as client:
        client.run("tg:1", "pid")
        client.run("tg:2", "sh echo hi")
        client.run("web:1", "pid")
    rows = json.loads(hs(supervisor, "list", "--json", "--prefix", "tg:").stdout)
    assert [r["key"] for r in rows] == ["tg:1", "tg:2"]
    for r in rows:
        assert isinstance(r["pid"], int) and isinstance(r["rss"], int) and r["rss"] > 1_000_000
        assert isinstance(r["started"], float) and abs(r["started"] - time.time()) < 60
        assert isinstance(r["cpu_percent"], float) and r["turns"] == 1
        assert r["runtime"] == "probe"
    assert json.loads(hs(supervisor, "list", "--json", "--state", "busy").stdout) == []


def test_status_describes_the_supervisor(supervisor) -> None:
    with supervisor.client() as client:
        client.run("a", "pid")
    out = hs(supervisor, "status").stdout
    assert f"pid {supervisor.pid}" in out
    assert f"ipc://{supervisor.state_dir}/control.sock" in out
    assert "sessions:  1 (1 idle)" in out
    info = json.loads(hs(supervisor, "status", "--json").stdout)
    assert info["pid"] == supervisor.pid and info["sessions"] == {"idle": 1}
    assert info["rss"] > 0 and info["fds"] > 0


def test_a_supervisor_that_does_not_answer_times_out_clearly(supervisor) -> None:
    os.kill(supervisor.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        result = hs(supervisor, "--timeout", "1", "ping")
        assert time.monotonic() - started < 10
        assert result.returncode == 1
        assert "did not answer within 1s" in result.stderr
    finally:
        os.kill(supervisor.pid, signal.SIGCONT)


# ---------------------------------------------------------------- kill


def test_kill_all_idle_for_and_purge(supervisor) -> None:
    with supervisor.client() as client:
        for key in ("k1", "k2", "k3"):
            client.run(key, "write notes.txt kept")
        time.sleep(4.0)
        client.run("k3", "pid")  # k3 is fresh
    result = hs(supervisor, "kill", "--idle-for", "3s")
    assert result.returncode == 0
    assert sorted(result.stdout.splitlines()) == sorted(
        [line for line in result.stdout.splitlines() if line.startswith(("k1:", "k2:"))]
    )
    assert "k3" not in result.stdout
    states = {r["key"]: r["state"] for r in json.loads(hs(supervisor, "list", "--json").stdout)}
    assert states == {"k1": "exited", "k2": "exited", "k3": "idle"}

    k1_dir = supervisor.data_dir / "sessions" / session_dir_name("k1")
    refused = hs(supervisor, "kill", "k1", "--purge")
    assert refused.returncode == 1 and "--yes" in refused.stderr
    assert k1_dir.exists()
    purged = hs(supervisor, "kill", "k1", "--purge", "--yes")
    assert purged.returncode == 0 and "data purged" in purged.stdout
    assert not k1_dir.exists()

    everything = hs(supervisor, "kill", "--all")
    assert everything.returncode == 0
    assert "k3: stopped" in everything.stdout and "k2: not running" in everything.stdout
    assert hs(supervisor, "kill", "ghost").returncode == 1


# ---------------------------------------------------------------- logs


def test_logs_keep_every_line_of_a_worker_killed_right_after_printing(supervisor_factory) -> None:
    env = dict(os.environ, PYTHONPATH=RUNTIMES)
    # Unsealed: a sealed worker is its PID namespace's init, which cannot
    # SIGKILL itself as this runtime does.
    sup = supervisor_factory(
        "--agent", "hs_printer:make", "--min-uptime", "0", "--sealed", "off", env=env
    )
    with sup.client() as client:
        with pytest.raises(Exception, match="SIGKILL"):
            client.run("noisy", "print-and-die 20000")
    lines = hs(sup, "logs", "noisy", "-n", "100000").stdout.splitlines()
    printed = [line for line in lines if line.startswith("line ")]
    assert printed == [f"line {i:06d} of 20000" for i in range(20000)]


def test_logs_rotate_at_line_boundaries_and_follow_across_rotation(supervisor_factory) -> None:
    env = dict(os.environ, PYTHONPATH=RUNTIMES)
    sup = supervisor_factory("--agent", "hs_printer:make", "--log-max-bytes", "4096", env=env)
    with sup.client() as client:
        client.run("rot", "print 10")
    follower = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hermes_sup.cli",
            "--state-dir",
            str(sup.state_dir),
            "logs",
            "rot",
            "-f",
            "-n",
            "0",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(
        target=lambda: [lines.put(line.rstrip("\n")) for line in follower.stdout], daemon=True
    ).start()
    try:
        # Following starts once the follower has asked: until one of our
        # marker lines reaches it, print another (a slow start loses none).
        with sup.client() as client:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                client.run("rot", "print 1")
                try:
                    if lines.get(timeout=1.0) == "line 000000 of 1":
                        break
                except queue.Empty:
                    pass
            while not lines.empty():
                lines.get_nowait()  # later markers
            client.run("rot", "print 1000")
        seen = []
        deadline = time.monotonic() + 60
        while len(seen) < 1000 and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1.0)
            except queue.Empty:
                continue
            if line.endswith(" of 1000"):
                seen.append(line)
        assert seen == [f"line {i:06d} of 1000" for i in range(1000)]
    finally:
        follower.send_signal(signal.SIGINT)
        follower.wait(10)
    log_dir = sup.data_dir / "sessions" / session_dir_name("rot")
    files = sorted(log_dir.glob("worker.log*"))
    assert len(files) == 4  # current + 3 backups
    for f in files:
        data = f.read_bytes()
        assert len(data) <= 4096 and data.endswith(b"\n")
        # Each line is stamped (supervisor/logs.py), then as printed.
        stamped = [split_stamp(line.decode()) for line in data.splitlines()]
        assert all(stamp is not None for stamp, _text in stamped)
        assert all(
            text.startswith("line ") or " INFO " in text or "worker start" in text
            for _stamp, text in stamped
        )


# ---------------------------------------------------------------- attach


def attach(sup, *args: str) -> pexpect.spawn:
    cmd = f"{sys.executable} -m hermes_sup.cli --state-dir {sup.state_dir} attach {' '.join(args)}"
    env = dict(os.environ, NO_COLOR="1")
    child = pexpect.spawn(cmd, encoding="utf-8", timeout=15, env=env, dimensions=(40, 120))
    return child


def test_attach_shows_everything_and_sends_turns(supervisor) -> None:
    with supervisor.client() as client:
        client.run("room", "sh echo before-attach")
        first = attach(supervisor, "room")
        second = attach(supervisor, "room", "--read-only")
        try:
            for child in (first, second):
                child.expect("attached to room")
                child.expect("before-attach")  # replayed history
            # A turn sent by another client (a front end) shows on both screens.
            client.run("room", "sh echo from-a-front-end")
            for child in (first, second):
                child.expect(r"» \[turn\] sh echo from-a-front-end")
                child.expect("from-a-front-end")
                child.expect("◂ exit 0")
            # The operator types a turn.
            first.sendline("env HERMES_SESSION_KEY")
            first.expect(r"» \[you\] env HERMES_SESSION_KEY")
            first.expect("◂ room")
            second.expect(r"» \[turn\] env HERMES_SESSION_KEY")
            # A reply streamed as tokens shows once, then its end marker.
            first.sendline("stream one two three")
            first.expect(r"» \[you\] stream one two three")
            first.expect("one two three")
            first.expect(r"◂ \(end of reply\)")
            # Read-only: typing sends nothing.
            second.sendline("pid")
            second.expect("read-only: input ignored")
            # Ctrl-C cancels the running turn, never the session.
            first.sendline("sleep 30")
            first.expect(r"» \[you\] sleep 30")
            first.sendintr()
            first.expect("cancelling the running turn")
            first.expect("◂ cancelled")
            # The worker dies and comes back: attach says so and keeps watching.
            pid = int(client.run("room", "pid").text)
            os.kill(pid, signal.SIGKILL)
            first.expect("worker (exited|backoff): killed by SIGKILL")
            until(lambda: client.sessions()[0]["state"] in ("exited",), timeout=5)
            client.run("room", "sh echo after-restart")
            first.expect(r"worker ready \(pid \d+\)")
            first.expect("after-restart")
            # Ctrl-D detaches and leaves the session alone.
            first.sendeof()
            first.expect("detached; the session keeps running")
            first.expect(pexpect.EOF)
            assert client.sessions()[0]["state"] == "idle"
        finally:
            for child in (first, second):
                child.close(force=True)


def test_attach_says_when_the_supervisor_goes_away(supervisor) -> None:
    with supervisor.client() as client:
        client.run("lonely", "pid")
    child = attach(supervisor, "lonely")
    try:
        child.expect("attached to lonely")
        supervisor.stop()
        child.expect("the supervisor went away")
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == 3
    finally:
        child.close(force=True)


# ---------------------------------------------------------------- completion


def test_shell_completion_offers_live_session_keys(supervisor) -> None:
    with supervisor.client() as client:
        client.run("alice", "pid")
        client.run("albert", "pid")
        client.run("bob", "pid")
    env = dict(
        os.environ,
        _HERMES_SUP_COMPLETE="bash_complete",
        COMP_WORDS="hermes-sup kill al",
        COMP_CWORD="2",
        HERMES_SUP_STATE_DIR=str(supervisor.state_dir),
    )
    result = subprocess.run(
        [sys.executable, "-m", "hermes_sup.cli"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    words = [line.split(",", 1)[1] for line in result.stdout.splitlines() if "," in line]
    assert sorted(words) == ["albert", "alice"]
