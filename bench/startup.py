"""How long a `hermes-sup` command takes to start, beside its floors.

Each command runs as a fresh process, again and again, the commands taken
in turn (interleaved, as hyperfine's --shuffle would) so that a burst of
load on a shared machine falls on all of them alike. The floors: a bare
interpreter, and one that imports what any client command needs
(click, zmq, msgpack). Reported: the median and the minimum wall time of
each, and each median over the second floor's.

    python -m bench.startup [--runs 30]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent


def commands() -> dict[str, tuple[list[str], dict[str, str]]]:
    """What is timed: name -> (argv, extra environment)."""
    cli = str(BIN / "hermes-sup")
    line = "hermes-sup se"
    complete = {
        "_HERMES_SUP_COMPLETE": "bash_complete",
        "COMP_LINE": line,
        "COMP_POINT": str(len(line)),
        "COMP_WORDS": line,
        "COMP_CWORD": "1",
    }
    return {
        "python -c pass": ([sys.executable, "-c", "pass"], {}),
        "import click, zmq, msgpack": (
            [sys.executable, "-c", "import click, zmq, msgpack"],
            {},
        ),
        "hermes-sup --version": ([cli, "--version"], {}),
        "hermes-sup <Tab> (bash)": ([cli], complete),
        "hermes-sup --help": ([cli, "--help"], {}),
        "hermes-sup send --help": ([cli, "send", "--help"], {}),
    }


def main() -> None:
    """Time every command and print the table (and JSON with --json)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    table = commands()
    times: dict[str, list[float]] = {name: [] for name in table}
    for _ in range(args.runs):
        for name, (argv, extra) in table.items():
            env = {**os.environ, **extra}
            started = time.perf_counter()
            subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, check=True)
            times[name].append(time.perf_counter() - started)
    floor = statistics.median(times["import click, zmq, msgpack"])
    results = {
        name: {
            "median_ms": statistics.median(t) * 1000,
            "min_ms": min(t) * 1000,
            "over_floor": statistics.median(t) / floor,
        }
        for name, t in times.items()
    }
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"{'command':32} {'median':>9} {'min':>9}  x floor   ({args.runs} runs each)")
    for name, r in results.items():
        print(f"{name:32} {r['median_ms']:7.1f}ms {r['min_ms']:7.1f}ms  {r['over_floor']:5.2f}")


if __name__ == "__main__":
    main()
