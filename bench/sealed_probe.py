"""Sealed mode must not make the probe runtime slower: spawn p50, sealed
against unsealed, in one run.

    python -m bench.sealed_probe [--sessions 40] [--spares 0]

Two supervisors (probe runtime, one `--sealed on`, one `--sealed off`) run
side by side on this machine; new sessions are started on each in turn, one
at a time, and *spawn* is a new key's first `run("pid")` from send to reply
(the fork, the seal, the runtime, the hello, one turn), as a front end sees
it. Prints each mode's p50 and p90 and the ratio sealed/unsealed (goal:
within 1.2), and writes bench/results/sealed_probe.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.common import RESULTS, Sup, pct
from hermes_sup.client import Client


def spawn_ms(client: Client, key: str) -> float:
    """A new key's first turn, send to reply, in ms."""
    started = time.perf_counter()
    reply = client.run(key, "pid")
    took = (time.perf_counter() - started) * 1000
    assert reply.ok, reply
    return took


def main() -> int:
    """Spawns alternated between a sealed and an unsealed supervisor."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--sessions", type=int, default=40)
    parser.add_argument("--spares", type=int, default=0)
    args = parser.parse_args()
    # Where a service keeps them: data on disk in /var/lib, state (sockets)
    # in /run. (Under /tmp, each sealed worker would also make the mount
    # points of the data and state dirs inside its own /tmp, on disk.)
    if os.geteuid() == 0:
        base = Path(tempfile.mkdtemp(prefix="hsb-", dir="/var/lib"))
        run = Path(tempfile.mkdtemp(prefix="hsb-", dir="/run"))
    else:
        base = Path(tempfile.mkdtemp(prefix="hsb-", dir=os.path.expanduser("~")))
        run = Path(tempfile.mkdtemp(prefix="hsb-", dir=os.environ.get("XDG_RUNTIME_DIR", base)))
    for path in (base, run):
        path.chmod(0o711)  # sealed sessions run as other uids and pass through
    sups: dict[str, Sup] = {}
    try:
        for mode in ("off", "on"):
            (base / mode).mkdir()
            sups[mode] = Sup(
                "--sealed",
                mode,
                "--spare-workers",
                str(args.spares),
                root=base / mode,
                state=run / mode,
            )
        times: dict[str, list[float]] = {"off": [], "on": []}
        clients = {mode: sup.client(timeout=30) for mode, sup in sups.items()}
        for mode in sups:  # one warm-up each: first imports, first page faults
            spawn_ms(clients[mode], "warm-up")
        for i in range(args.sessions):
            order = ("off", "on") if i % 2 == 0 else ("on", "off")
            for mode in order:
                if args.spares:
                    time.sleep(0.05)  # let the pool refill
                times[mode].append(spawn_ms(clients[mode], f"k{i}"))
        for c in clients.values():
            c.close()
    finally:
        for sup in sups.values():
            sup.close()
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(run, ignore_errors=True)
    result = {
        mode: {"p50_ms": round(pct(t, 50), 2), "p90_ms": round(pct(t, 90), 2), "n": len(t)}
        for mode, t in times.items()
    }
    ratio = result["on"]["p50_ms"] / result["off"]["p50_ms"]
    summary = {
        "sealed": result["on"],
        "unsealed": result["off"],
        "ratio_p50": round(ratio, 3),
        "spares": args.spares,
        "euid": os.geteuid(),
        "load": os.getloadavg()[0],
    }
    print(json.dumps(summary, indent=2))
    out = RESULTS / "sealed_probe.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"spawn p50 sealed/unsealed = {ratio:.2f} (goal <= 1.2)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
