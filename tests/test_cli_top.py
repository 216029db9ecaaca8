"""`hermes-sup top`: the table logic fed rows, and the real command on a
real terminal (tmux) against a real supervisor: it shows the live sessions,
sorts, filters, kills the selected one (after asking), attaches and comes
back, and quits."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys

import pytest

from hermes_sup.cli.top_table import Table

from .test_faults import until


def rows(*specs: tuple[str, float | None, int | None]) -> list[dict]:
    return [
        {"key": key, "state": "idle", "pid": 1, "cpu_percent": cpu, "rss": rss, "started": 100.0}
        for key, cpu, rss in specs
    ]


def test_the_selection_follows_its_session_through_a_resort_and_a_filter() -> None:
    table = Table()
    table.update(rows(("a", 1.0, 10), ("b", 50.0, 5), ("c", None, 7)))
    assert [r["key"] for r in table.rows] == ["b", "a", "c"]  # CPU, largest first, unknown last
    assert table.selected == "b"
    table.move(1)
    assert table.selected == "a"
    table.update(rows(("a", 90.0, 10), ("b", 50.0, 5), ("c", None, 7)))
    assert [r["key"] for r in table.rows] == ["a", "b", "c"] and table.selected == "a"
    table.sort_by("M")
    assert [r["key"] for r in table.rows] == ["a", "c", "b"] and table.selected == "a"
    table.filter_by("c", rows(("a", 1.0, 1), ("b", 1.0, 1), ("c", 1.0, 1)))
    assert [r["key"] for r in table.rows] == ["c"] and table.selected == "c"
    table.filter_by("zzz", [])
    assert table.rows == [] and table.selected is None
    table.move(1)  # nothing to select: no error


def test_lines_fit_the_width_and_mark_the_selection() -> None:
    table = Table()
    long_key = "telegram:" + "9" * 60
    table.update(rows((long_key, 3.0, 2048), ("b", 1.0, None)))
    header, lines = table.lines(80, now=160.0)
    assert header.startswith("KEY") and "CPU%▾" in header
    assert all(len(line) <= 80 for _, line in lines) and len(header) <= 80
    assert [selected for selected, _ in lines] == [True, False]
    assert "…" in lines[0][1]  # the long key cut in the middle, as list does
    assert "1m00s" in lines[0][1] and "2.0K" in lines[0][1]


TMUX = shutil.which("tmux")


@pytest.mark.skipif(TMUX is None and not os.environ.get("HSUP_REQUIRE_ALL"), reason="needs tmux")
def test_top_on_a_terminal_sorts_filters_kills_attaches_and_quits(supervisor, tmp_path) -> None:
    name = f"hsup-top-{os.getpid()}"
    socket = str(tmp_path / "tmux.sock")  # a tmux server of this test's own

    def tmux(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["tmux", "-S", socket, *args], capture_output=True, text=True, timeout=60
        )

    def screen() -> str:
        return tmux("capture-pane", "-p", "-t", name).stdout

    def keys(*pressed: str) -> None:
        tmux("send-keys", "-t", name, *pressed)

    with supervisor.client() as client:
        for key in ("alice", "bob", "carol"):
            client.open(key)
        command = shlex.join(
            [sys.executable, "-m", "hermes_sup.cli", "--state-dir", str(supervisor.state_dir),
             "top", "--interval", "0.5"]
        )  # fmt: skip
        started = tmux("new-session", "-d", "-s", name, "-x", "120", "-y", "24", command)
        assert started.returncode == 0, started.stderr
        try:
            assert until(lambda: all(k in screen() for k in ("alice", "bob", "carol")), 300)
            assert "3 session(s), 3 live" in screen()
            keys("N")
            assert until(lambda: "KEY▾" in screen() and "sorted by KEY" in screen(), 120)
            keys("End", "k")
            assert until(lambda: "kill carol? [y/N]" in screen(), 120)
            keys("y")
            assert until(lambda: "killed carol" in screen(), 300)
            live = {r["key"] for r in client.sessions() if r.get("pid")}
            assert live == {"alice", "bob"}  # the selected one, and only it
            keys("/", "b", "o", "Enter")
            assert until(lambda: "filter 'bo'" in screen() and "alice" not in screen(), 120)
            keys("a")
            assert until(lambda: "attached to bob" in screen(), 300)
            keys("C-d")
            assert until(lambda: "detached from bob" in screen(), 300)
            keys("q")
            assert until(lambda: tmux("has-session", "-t", name).returncode != 0, 120)
        finally:
            tmux("kill-server")
