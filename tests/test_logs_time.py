"""Timestamps on every stored log line, and `logs --since/--until/-t`
(issue 18): the stamps as stored, the choosing by time in the supervisor
and on disk, the CLI's parsing of times, and a real supervisor with a
runtime that prints to its stdout (the session log)."""

from __future__ import annotations

import json
import math
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest
from click.testing import CliRunner

from hermes_sup.cli.logs import Window, parse_time
from hermes_sup.cli.main import cli
from hermes_sup.client import SupervisorError
from hermes_sup.protocol import ErrorCode, Kind, RemoteProtocolError, session_dir_name
from hermes_sup.supervisor.logread import (
    PREFIX_WIDTH,
    format_stamp,
    requested_lines,
    split_stamp,
    stamp_seconds,
    tail,
)
from hermes_sup.supervisor.logs import SessionLog

from .test_cli_commands import hs
from .test_faults import RUNTIMES, until

STAMPED = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z (.*)$")
NOW = 1_796_114_301.5  # 2026-12-01T08:38:21.5Z


# ------------------------------------------------------------ parsing times


def test_parse_time_reads_rfc3339_dates_durations_and_epoch_seconds() -> None:
    assert parse_time("2026-12-01T08:38:21.5Z", NOW) == NOW
    assert parse_time("2026-12-01t08:38:21.5z", NOW) == NOW  # RFC 3339 allows lower case
    assert parse_time("2026-12-01T10:38:21.5+02:00", NOW) == NOW
    assert parse_time("2026-12-01 08:38:21.500000+00:00", NOW) == NOW
    # Without an offset: local time, as docker reads it.
    local = datetime(2026, 12, 1).timestamp()
    assert parse_time("2026-12-01", NOW) == local
    assert parse_time("10m", NOW) == NOW - 600
    assert parse_time("2h", NOW) == NOW - 7200
    assert parse_time("1d", NOW) == NOW - 86400
    assert parse_time("1h30m", NOW) == NOW - 5400
    assert parse_time(" 90s ", NOW) == NOW - 90
    # A bare number is seconds since the epoch, as docker reads it.
    assert parse_time("1796114301.5", NOW) == NOW
    assert parse_time("0", NOW) == 0.0


@pytest.mark.parametrize(
    "text", ["", "yesterday", "10x", "-5m", "2026-13-01", "2026-12-01T25:00:00Z", "1e9", "m"]
)
def test_parse_time_refuses_what_is_not_a_time(text: str) -> None:
    with pytest.raises(ValueError, match="is not a time: use an RFC 3339 time"):
        parse_time(text, NOW)


def test_a_malformed_since_is_a_usage_error_naming_the_option() -> None:
    for option in ("--since", "--until"):
        result = CliRunner().invoke(cli, ["logs", "k", option, "last tuesday"])
        assert result.exit_code == 2, result.output
        assert f"Invalid value for '{option}'" in result.output
        assert "'last tuesday' is not a time" in result.output


def test_stamps_are_fixed_width_utc_and_sort_as_text() -> None:
    assert format_stamp(NOW) == "2026-12-01T08:38:21.500000Z"
    assert stamp_seconds(format_stamp(NOW)) == NOW
    # Down to the microsecond, or up; a float a hair off one counts as on it.
    assert format_stamp(1.0000015) == "1970-01-01T00:00:01.000001Z"
    assert format_stamp(1.0000015, up=True) == "1970-01-01T00:00:01.000002Z"
    assert format_stamp(1796114301.123456, up=True).endswith(".123456Z")
    # Clamped to what a stamp holds.
    assert format_stamp(-5.0) == "1970-01-01T00:00:00.000000Z"
    assert format_stamp(1e20) == "9999-12-31T23:59:59.999999Z"
    times = [0.0, 1.0, 59.999999, 60.0, 1e9, NOW, NOW + 0.000001]
    stamps = [format_stamp(t) for t in times]
    assert sorted(stamps) == stamps and {len(s) for s in stamps} == {27}
    assert split_stamp(f"{stamps[-1]} hello there") == (stamps[-1], "hello there")
    assert split_stamp("hello there") == (None, "hello there")
    assert split_stamp("2026-12-01T08:38:21.5Z not ours") == (
        None,
        "2026-12-01T08:38:21.5Z not ours",
    )


def test_window_keeps_unstamped_lines_only_without_since() -> None:
    stamp = format_stamp(NOW)
    assert Window(None, None).keeps(None) and Window(None, NOW).keeps(None)
    assert not Window(NOW - 1, None).keeps(None)
    assert Window(NOW, NOW).keeps(stamp)  # both ends included
    assert not Window(NOW + 0.000001, None).keeps(stamp)
    assert not Window(None, NOW - 0.000001).keeps(stamp)


# ------------------------------------------------------------ stored lines


def lines_of(path: Path) -> list[str]:
    return path.read_text().splitlines()


def test_every_stored_line_is_stamped_and_tail_strips_the_stamp(tmp_path: Path) -> None:
    log = SessionLog(tmp_path / "worker.log")
    before = time.time()
    assert log.feed(b"one\ntwo\nthr") == [b"one", b"two"]
    assert log.feed(b"ee\n") == [b"three"]
    assert log.finish() == []
    log.feed(b"no newline at the end")
    assert log.finish() == [b"no newline at the end"]
    after = time.time()
    log.close()
    stored = lines_of(tmp_path / "worker.log")
    assert [STAMPED.match(line).group(1) for line in stored] == [  # type: ignore[union-attr]
        "one",
        "two",
        "three",
        "no newline at the end",
    ]
    stamps = [stamp_seconds(line[: PREFIX_WIDTH - 1]) for line in stored]
    assert stamps == sorted(stamps)
    assert before - 0.000001 <= stamps[0] and stamps[-1] <= after + 0.000001
    assert log.last_stamp() == stored[-1][: PREFIX_WIDTH - 1]
    path = tmp_path / "worker.log"
    assert tail(path, 10) == ["one", "two", "three", "no newline at the end"]
    assert tail(path, 10, timestamps=True) == stored
    assert tail(path, 2) == ["three", "no newline at the end"]


def test_a_short_write_of_stamped_lines_goes_on_where_it_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stamp and the lines go out in one writev; when it writes only part
    (a disk filling up), the rest follows, nothing twice, nothing lost."""
    from hermes_sup.supervisor import logs

    real = os.writev

    def short(fd: int, buffers) -> int:  # noqa: ANN001
        return real(fd, [bytes(b"".join(bytes(b) for b in buffers)[:40])])

    monkeypatch.setattr(logs.os, "writev", short)
    log = SessionLog(tmp_path / "worker.log")
    log.feed(b"first line\nsecond line\nthird\n")
    log.feed(b"alone\n")
    log.close()
    stored = lines_of(tmp_path / "worker.log")
    assert [split_stamp(line)[1] for line in stored] == [
        "first line",
        "second line",
        "third",
        "alone",
    ]
    assert all(STAMPED.match(line) for line in stored)


def write_stamped(path: Path, lines: list[tuple[float | None, str]]) -> None:
    """A log as the supervisor stores it; None: a line from before stamps."""
    with open(path, "a") as fh:
        for when, text in lines:
            fh.write(f"{format_stamp(when)} {text}\n" if when is not None else f"{text}\n")


def test_since_and_until_choose_lines_and_n_counts_after(tmp_path: Path) -> None:
    path = tmp_path / "worker.log"
    write_stamped(path, [(None, "old a"), (None, "old b")])
    write_stamped(path, [(NOW + i, f"line {i}") for i in range(10)])
    assert tail(path, 100) == ["old a", "old b"] + [f"line {i}" for i in range(10)]
    # Both ends included; lines from before stamps are older than any time.
    assert tail(path, 100, since=NOW + 3, until=NOW + 5) == ["line 3", "line 4", "line 5"]
    assert tail(path, 100, since=NOW + 8) == ["line 8", "line 9"]
    assert tail(path, 100, until=NOW + 1) == ["old a", "old b", "line 0", "line 1"]
    assert tail(path, 100, since=NOW + 2.5, until=NOW + 3.5) == ["line 3"]
    assert tail(path, 2, until=NOW + 5) == ["line 4", "line 5"]
    assert tail(path, 100, since=NOW + 20) == []
    assert tail(path, 100, since=NOW + 5, until=NOW + 4) == []
    # With the stamps: the stored line; an unstamped one as it is.
    assert tail(path, 100, until=NOW, timestamps=True) == [
        "old a",
        "old b",
        f"{format_stamp(NOW)} line 0",
    ]


def test_the_window_reaches_into_rotated_files(tmp_path: Path) -> None:
    log = SessionLog(tmp_path / "worker.log", max_bytes=200, backups=3)
    for i in range(12):
        log.feed(f"line {i:02d} {'x' * 20}\n".encode())
    log.close()
    files = sorted(tmp_path.glob("worker.log*"))
    assert len(files) == 4
    stored = []
    for f in [tmp_path / f"worker.log.{i}" for i in (3, 2, 1)] + [tmp_path / "worker.log"]:
        data = f.read_bytes()
        assert len(data) <= 200 and data.endswith(b"\n")
        stored += data.decode().splitlines()
    assert all(STAMPED.match(line) for line in stored)
    kept = [line for line in tail(tmp_path / "worker.log", 100)]
    assert kept == [f"line {i:02d} {'x' * 20}" for i in range(12 - len(kept), 12)]
    middle = stamp_seconds(stored[len(stored) // 2][: PREFIX_WIDTH - 1])
    after = tail(tmp_path / "worker.log", 100, since=middle, timestamps=True)
    assert after == [line for line in stored if line[: PREFIX_WIDTH - 1] >= format_stamp(middle)]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"since": "yesterday"}, "'since' must be a finite number of seconds since the epoch"),
        ({"until": True}, "'until' must be a finite number"),
        ({"since": math.nan}, "'since' must be a finite number"),
        ({"since": math.inf}, "'since' must be a finite number"),
        ({"timestamps": "yes"}, "'timestamps' must be bool"),
    ],
)
def test_a_bad_time_field_is_a_bad_field_error(tmp_path: Path, body: dict, message: str) -> None:
    with pytest.raises(RemoteProtocolError, match=message) as caught:
        requested_lines(tmp_path / "worker.log", body, 3)
    assert caught.value.code == ErrorCode.BAD_FIELD


def test_requested_lines_reads_the_new_fields(tmp_path: Path) -> None:
    path = tmp_path / "worker.log"
    write_stamped(path, [(NOW + i, f"line {i}") for i in range(5)])
    assert requested_lines(path, {"since": NOW + 3}, 3) == ["line 3", "line 4"]
    assert requested_lines(path, {"since": int(NOW + 2), "until": None}, 3) == [
        "line 2",
        "line 3",
        "line 4",
    ]
    assert requested_lines(path, {"until": NOW + 1, "timestamps": True}, 3) == [
        f"{format_stamp(NOW)} line 0",
        f"{format_stamp(NOW + 1)} line 1",
    ]
    assert requested_lines(path, {"lines": 1, "until": NOW + 1}, 3) == ["line 1"]


# ------------------------------------------------------ a real supervisor


def printed(text: str) -> list[str]:
    """The lines the printer runtime printed, in `text`, in order."""
    return [line for line in text.splitlines() if re.search(r"line \d{6} of \d+$", line)]


FIRST = [f"line {i:06d} of 3" for i in range(3)]
SECOND = [f"line {i:06d} of 5" for i in range(5)]


@pytest.fixture
def two_batches(supervisor_factory):
    """A supervisor whose session `ts` printed FIRST, then, after `marker`
    (a time between the two batches as stored), SECOND."""
    env = dict(os.environ, PYTHONPATH=RUNTIMES)
    sup = supervisor_factory("--agent", "hs_printer:make", env=env)
    log_path = sup.data_dir / "sessions" / session_dir_name("ts") / "worker.log"

    def stored_through(last: str) -> bool:
        return log_path.exists() and last in log_path.read_text()

    with sup.client() as client:
        assert client.run("ts", "print 3").text == "printed 3"
        assert until(lambda: stored_through(FIRST[-1]), timeout=30)
        marker = time.time()
        # The next stamp is read from the clock after this one: past it.
        assert until(lambda: time.time() > marker + 0.001)
        assert client.run("ts", "print 5").text == "printed 5"
        assert until(lambda: stored_through(SECOND[-1]), timeout=30)
    return sup, marker, log_path


@pytest.mark.e2e
def test_logs_choose_lines_by_time_and_show_stamps_live_and_from_disk(two_batches) -> None:
    sup, marker, log_path = two_batches
    stored = log_path.read_text().splitlines()
    # Every stored line has its stamp, and the stamps follow the marker.
    assert stored and all(STAMPED.match(line) for line in stored), stored
    text_of = {STAMPED.match(line).group(1): line for line in stored}  # type: ignore[union-attr]
    assert all(text_of[t][:27] < format_stamp(marker) for t in FIRST)
    assert all(text_of[t][:27] > format_stamp(marker) for t in SECOND)
    iso = datetime.fromtimestamp(marker).astimezone().isoformat()

    def variants() -> dict[str, subprocess.CompletedProcess[str]]:
        return {
            "plain": hs(sup, "logs", "ts", "-n", "1000"),
            "since": hs(sup, "logs", "ts", "--since", repr(marker)),
            "since_iso": hs(sup, "logs", "ts", "--since", iso),
            "until": hs(sup, "logs", "ts", "--until", repr(marker)),
            "until_n": hs(sup, "logs", "ts", "--until", repr(marker), "-n", "2"),
            "t": hs(sup, "logs", "ts", "-t", "-n", "1000"),
            "json": hs(sup, "logs", "ts", "--json", "--since", repr(marker)),
            "day": hs(sup, "logs", "ts", "--since", "1d", "-t"),
            "none": hs(sup, "logs", "ts", "--since", "1d", "--until", "2026-01-01"),
        }

    live = variants()
    for name, result in live.items():
        assert result.returncode == 0, (name, result.stderr)
    # Without -t the output is what it was: the text as printed, no stamps.
    plain = live["plain"].stdout.splitlines()
    assert plain == [STAMPED.match(line).group(1) for line in stored]  # type: ignore[union-attr]
    assert printed(live["plain"].stdout) == FIRST + SECOND
    assert printed(live["since"].stdout) == SECOND
    assert live["since_iso"].stdout == live["since"].stdout
    assert printed(live["until"].stdout) == FIRST
    assert live["until_n"].stdout.splitlines() == FIRST[-2:]  # -n counts after choosing
    # -t: the line as stored, stamp first.
    assert live["t"].stdout.splitlines() == stored
    assert live["day"].stdout.splitlines() == stored
    assert live["none"].stdout == ""
    objects = [json.loads(line) for line in live["json"].stdout.splitlines()]
    assert [o["line"] for o in objects if o["line"] in SECOND] == SECOND
    assert all(o["ts"] >= marker for o in objects)
    assert objects[-1]["ts"] == stamp_seconds(text_of[SECOND[-1]][:27])
    # The same with the supervisor down, read from its data directory.
    sup.stop()
    data = ["--data-dir", str(sup.data_dir)]
    offline = {name: hs(sup, *result.args[5:], *data) for name, result in live.items()}
    for name, result in offline.items():
        assert result.returncode == 0, (name, result.stderr)
        assert result.stdout == live[name].stdout, name
    # Following the file ends by itself too once --until has passed.
    ends = hs(sup, "logs", "ts", *data, "-f", "-n", "0", "--until", repr(time.time() + 1))
    assert ends.returncode == 0 and ends.stdout == "", ends.stderr


@pytest.mark.e2e
def test_a_bad_since_field_in_a_raw_request_is_a_bad_field_error(two_batches) -> None:
    sup, marker, _log_path = two_batches
    with sup.client() as client:
        for body, field in (({"since": "10m"}, "since"), ({"until": [1]}, "until")):
            req = client.submit(Kind.LOGS, body, session="ts")
            with pytest.raises(SupervisorError) as caught:
                client.answer(req)
            assert caught.value.code == "bad_field"
            assert f"'logs' body field {field!r} must be a finite number" in caught.value.message
        # The supervisor serves on, and a good request works.
        req = client.submit(Kind.LOGS, {"since": marker, "timestamps": True}, session="ts")
        lines = client.answer(req).body["lines"]
        assert all(STAMPED.match(line) for line in lines)
        assert printed("\n".join(STAMPED.match(line).group(1) for line in lines)) == SECOND


def follow(sup, *args: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "hermes_sup.cli", "--state-dir", str(sup.state_dir), "logs"]
    return subprocess.Popen(
        [*cmd, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.mark.e2e
def test_follow_sends_live_lines_with_their_stamps(two_batches) -> None:
    sup, _marker, log_path = two_batches
    proc = follow(sup, "ts", "-f", "-t", "-n", "0")
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(
        target=lambda: [lines.put(line.rstrip("\n")) for line in proc.stdout], daemon=True
    ).start()
    got: list[str] = []
    try:
        with sup.client() as client:
            # Following starts once the follower has asked: print until a
            # batch reaches it.
            deadline = time.monotonic() + 60
            while not got and time.monotonic() < deadline:
                client.run("ts", "print 2")
                try:
                    while True:
                        got.append(lines.get(timeout=1.0))
                except queue.Empty:
                    pass
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()  # never left behind, even hung
            proc.wait()
    assert proc.returncode == 0
    stored = log_path.read_text().splitlines()
    assert got and all(line in stored for line in got), (got, stored)
    assert [STAMPED.match(line).group(1) for line in got if line.endswith(" of 2")]
    assert not set(FIRST + SECOND) & {STAMPED.match(line).group(1) for line in got}


@pytest.mark.e2e
def test_follow_ends_by_itself_after_until(two_batches) -> None:
    sup, marker, _log_path = two_batches
    # An --until already past: the lines it chooses, and no follow at all.
    done = hs(sup, "logs", "ts", "-f", "--until", repr(marker))
    assert done.returncode == 0 and printed(done.stdout) == FIRST
    # An --until to come: the follow stops once it has passed (a line
    # stored after it, or the clock), having shown nothing stored later.
    stop_at = time.time() + 3
    proc = follow(sup, "ts", "-f", "-t", "-n", "0", "--until", repr(stop_at))
    try:
        deadline = time.monotonic() + 120
        with sup.client() as client:
            while proc.poll() is None and time.monotonic() < deadline:
                client.run("ts", "print 2")
                time.sleep(0.2)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    stamps = [line[:27] for line in out.splitlines()]
    assert all(STAMPED.match(line) for line in out.splitlines())
    assert all(stamp <= format_stamp(stop_at) for stamp in stamps), (stamps, stop_at)
