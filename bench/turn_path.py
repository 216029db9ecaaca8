"""A turn's path against its floor, before and after, in one run: round
trip p50 through the bare pyzmq proxy (bench/round_trip.py's floor) and
through hermes-sup under this install and another, with 1 session and with
64, round after round so that the machine's load falls on all of them.

    .venv/bin/python -m bench.turn_path /tmp/bv/bin/python --rounds 3

Each round measures the floor (1 and 64 echo workers), then each install
(`--once` under its python: a supervisor of its own, probe runtime), and
prints each one's p50 and its ratio to the floor measured in that round.
The other install runs this checkout's bench/ against its own hermes_sup.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

from bench.common import REPO, Sup

SESSIONS = (1, 64)


def once(count: int) -> dict[str, Any]:
    """This install's round trips (p50 ms) and supervisor CPU per message."""
    from bench.round_trip import routed

    sup = Sup()
    try:
        out: dict[str, Any] = {}
        for n in SESSIONS:
            got = routed(sup, n, count, 64)
            out[f"rtt{n}_p50_ms"] = got["latency"]["p50_ms"]
            out[f"sup_cpu_us{n}"] = got["cpu_us_per_message"]["router"]
        return out
    finally:
        sup.close()


def floor(count: int) -> dict[str, float]:
    """The bare proxy's round trip p50 (ms) with 1 and 64 echo workers."""
    from bench.round_trip import proxy_floor

    return {f"rtt{n}_p50_ms": proxy_floor(n, count, 64)["latency"]["p50_ms"] for n in SESSIONS}


def main() -> None:
    """Rounds of floor, this install, the other; or (--once) one install."""
    parser = argparse.ArgumentParser()
    parser.add_argument("other", nargs="?", help="the python of the other install")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--count", type=int, default=2000, help="round trips per figure")
    parser.add_argument("--once", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.once:
        print(json.dumps(once(args.count)))
        return
    sides = [("this", sys.executable), *([("other", args.other)] if args.other else [])]
    for r in range(args.rounds):
        base = floor(args.count)
        print(f"round {r + 1} floor " + " ".join(f"{k}={v:.3f}" for k, v in base.items()))
        for label, python in sides if r % 2 == 0 else sides[::-1]:
            run = subprocess.run(
                [python, "-m", "bench.turn_path", "--once", "--count", str(args.count)],
                capture_output=True,
                text=True,
                check=True,
                cwd=REPO,
            )
            got = json.loads(run.stdout.strip().splitlines()[-1])
            ratios = " ".join(
                f"rtt{n}={got[f'rtt{n}_p50_ms']:.3f}ms ({got[f'rtt{n}_p50_ms'] / base[f'rtt{n}_p50_ms']:.2f}x)"
                f" cpu{n}={got[f'sup_cpu_us{n}']:.0f}us"
                for n in SESSIONS
            )
            print(f"round {r + 1} {label:5} {ratios}", flush=True)


if __name__ == "__main__":
    main()
