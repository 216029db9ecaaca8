"""An idle supervisor's CPU with N live idle sessions, against an empty one
measured at the same time; and how long stopping those N workers takes.

    .venv/bin/python -m bench.idle --sessions 1000 --window 30
    .venv/bin/python -m bench.idle --sessions 1000 --other /tmp/bv/bin/python

Two supervisors run side by side on the same machine, so the machine's
noise falls on both: one empty, one holding `--sessions` live workers
(probe runtime, each having run one turn, `--idle-timeout 0`: none
hibernates). Their CPU over the same window is the figure, as a ratio
(acceptance: at most 2x). The count of live workers is checked at the
moment of measurement and printed. Then the full one is sent SIGTERM and
the time until it has exited, its workers stopped, is the stop figure.
`--other` runs the full side under another install's python too, in the
same run (its own empty floor beside it), for a before and after.
"""

from __future__ import annotations

import argparse
import json
import signal
import time
from typing import Any

from bench.common import Sup, cpu_seconds


def live_count(sup: Sup) -> int:
    """Sessions with a worker alive now, as `list` says and /proc agrees."""
    with sup.client(timeout=600) as c:
        rows = c.sessions()
    return sum(
        1 for r in rows if r.get("pid") and r.get("state") in ("idle", "busy") and alive(r["pid"])
    )


def alive(pid: int) -> bool:
    """Whether a process with this pid exists now."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return b") Z" not in f.read()
    except OSError:
        return False


def measure(
    python: str, sessions: int, window: float, extra: list[str] | None = None
) -> dict[str, Any]:
    """The ratio of a full supervisor's idle CPU to an empty one's, and the
    time to stop the full one, under `python`'s install (`extra`: more
    `serve` arguments for both)."""
    extra = extra or []
    empty = Sup("--idle-timeout", "0", *extra, python=python)
    full = Sup("--idle-timeout", "0", "--max-sessions", str(sessions + 16), *extra, python=python)
    try:
        started = time.perf_counter()
        with full.client(timeout=600) as client:
            for i in range(sessions):
                client.run(f"idle-{i}", "x")
        filled_s = time.perf_counter() - started
        time.sleep(3.0)  # what the last turns left behind settles
        live = live_count(full)
        pids = [empty.proc.pid, full.proc.pid]
        before = [cpu_seconds([p]) for p in pids]
        time.sleep(window)
        after = [cpu_seconds([p]) for p in pids]
        live_after = live_count(full)
        empty_cpu, full_cpu = ((a - b) / window for a, b in zip(after, before, strict=True))
        stop_started = time.perf_counter()
        full.proc.send_signal(signal.SIGTERM)
        full.proc.wait(600)
        stop_s = time.perf_counter() - stop_started
    finally:
        full.close()
        empty.close()
    return {
        "python": python,
        "serve_args": " ".join(extra),
        "sessions_asked": sessions,
        "live_at_start_of_window": live,
        "live_at_end_of_window": live_after,
        "fill_s": round(filled_s, 1),
        "empty_cpu_pct": round(empty_cpu * 100, 3),
        "full_cpu_pct": round(full_cpu * 100, 3),
        "ratio": round(full_cpu / empty_cpu, 2) if empty_cpu > 0 else None,
        "stop_s": round(stop_s, 2),
    }


def main() -> None:
    """Print one JSON line per install measured."""
    import sys

    parser = argparse.ArgumentParser()
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--window", type=float, default=30.0, help="seconds of idle measured")
    parser.add_argument("--other", help="another install's python, measured in the same run")
    parser.add_argument(
        "--sup-args", default="", help="`serve` arguments for every supervisor started"
    )
    args = parser.parse_args()
    for python in [sys.executable, *([args.other] if args.other else [])]:
        got = measure(python, args.sessions, args.window, args.sup_args.split())
        print(json.dumps(got), flush=True)


if __name__ == "__main__":
    main()
