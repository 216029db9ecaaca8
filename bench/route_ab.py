"""A routed turn through this install's router against another install's,
paired, as bench/ab.py pairs supervisors.

One supervisor (this install, probe runtime, --tcp) and two routers in
front of it: this install's and the other's (OTHER is its python, e.g. a
wrapper script `PYTHONPATH=<a checkout's hermes_sup tree> exec python
"$@"`). Turns to one warm session alternate between the two routers, the
order flipped every pair, so each turn of one has a twin of the other
taken a millisecond away under the same load; a direct TCP client to the
node is measured alongside as the floor. Both routers reach the same node
with the same key, so only the router differs.

Reports each side's p50 and p90 (ms), the median of the paired
differences (this - other), how often this side was faster, and each
router's CPU time per turn; with --out, the same as JSON.

    .venv/bin/python -m bench.route_ab /tmp/before/python [--turns 3000]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from bench.common import answers, free_port, pct, stop, wait_until
from hermes_sup.client import Client


def start(root: Path, other: str, log: object) -> dict[str, subprocess.Popen[bytes]]:
    """The node, and a router of each install in front of it."""
    port = free_port()
    (root / "node.toml").write_text('node = "a"\n')
    procs: dict[str, subprocess.Popen[bytes]] = {}
    procs["node"] = subprocess.Popen(
        [sys.executable, "-m", "hermes_sup.cli", "--state-dir", str(root / "s"), "serve",
         "--data-dir", str(root / "d"), "--tcp", str(port), "--config", str(root / "node.toml"),
         "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    wait_until(lambda: answers(root / "s"), "the node", procs["node"])
    for name in ("router", "bench"):
        subprocess.run(
            [sys.executable, "-m", "hermes_sup.cli", "keys", "generate", name, "--endpoint",
             f"127.0.0.1:{port}", "-o", str(root / f"{name}.json"), "--data-dir",
             str(root / "d")], check=True, capture_output=True,
        )  # fmt: skip
    (root / "nodes.toml").write_text(
        f'[[node]]\nname = "a"\nconnection = "{root / "router.json"}"\n'
    )
    for side, python in (("this", sys.executable), ("other", other)):
        procs[side] = subprocess.Popen(
            [python, "-m", "hermes_sup.cli.route", "--nodes", str(root / "nodes.toml"),
             "--state-dir", str(root / side), "--log-level", "WARNING"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        wait_until(lambda side=side: answers(root / side), f"{side}'s router", procs[side])
    return procs


def cpu(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("other", help="the python of the other install")
    parser.add_argument("--turns", type=int, default=3000, help="pairs of routed turns")
    parser.add_argument("--warm", type=int, default=200, help="turns each, not measured")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="hsab-", dir="/tmp"))
    log = open(root / "log", "ab")  # noqa: SIM115
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        procs = start(root, args.other, log)
        clients = {
            "this": Client(root / "this", timeout=30.0),
            "other": Client(root / "other", timeout=30.0),
            "direct": Client.from_connection_file(root / "bench.json", timeout=30.0),
        }
        key = "bench:route"
        for c in clients.values():  # the worker, the sockets, the CURVE handshakes
            for _ in range(args.warm):
                c.run(key, "hello")
        times: dict[str, list[float]] = {name: [] for name in clients}
        before = {side: cpu(procs[side].pid) for side in ("this", "other")}
        for i in range(args.turns):
            order = ("this", "other", "direct") if i % 2 == 0 else ("other", "this", "direct")
            for name in order:
                c = clients[name]
                started = time.perf_counter()
                c.run(key, "hello")
                times[name].append((time.perf_counter() - started) * 1000)
        spent = {side: cpu(procs[side].pid) - before[side] for side in before}
        for c in clients.values():
            c.close()
        diffs = [a - b for a, b in zip(times["this"], times["other"], strict=True)]
        result: dict[str, object] = {
            name: {
                "p50_ms": round(pct(v, 0.5), 3),
                "p90_ms": round(pct(v, 0.9), 3),
            }
            for name, v in times.items()
        }
        result["paired_difference_p50_ms"] = round(statistics.median(diffs), 3)
        result["this_faster"] = f"{sum(d < 0 for d in diffs)} of {len(diffs)}"
        result["router_cpu_us_per_turn"] = {
            side: round(s / args.turns * 1e6, 1) for side, s in spent.items()
        }
        print(json.dumps(result, indent=2))
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2) + "\n")
    finally:
        for proc in reversed(list(procs.values())):
            stop(proc)
        log.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
