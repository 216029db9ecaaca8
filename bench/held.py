"""Held conversations: what a supervisor costs while it holds many, most of
them hibernated, and a few active.

    python -m bench.held                      # 100, 1,000 and 10,000 held
    python -m bench.held --sizes 100,2000 --python /tmp/bv/bin/python

One supervisor (probe runtime) grows its table step by step. Each step's
new conversations each take one turn and then hibernate (the configuration
file says `idle_timeout = 2` while they grow; it is reloaded to an hour for
the active ones, so those stay live). At each step, with `--active`
conversations live, it measures the supervisor's memory (RSS and USS), its
CPU while nothing is sent (`--idle-seconds`), and the round trip of turns
spread over the active conversations (p50 and p99), so the figures at 100
and at 10,000 held are taken on one machine minutes apart. The flatness
across steps is the figure; absolute times move with the machine's load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from bench.common import Sup, load_now, machine, pct
from hermes_sup.client import AsyncClient, Client

MIB = 1024 * 1024


def _config(path: Path, idle_timeout: float) -> None:
    path.write_text(f"idle_timeout = {idle_timeout}\n")


def _reload(sup: Sup, path: Path, idle_timeout: float) -> None:
    """Rewrite the configuration file and have the supervisor re-read it."""
    _config(path, idle_timeout)
    with sup.client() as c:
        c.reload()


async def _turns(state: Path, keys: list[str], concurrency: int) -> list[float]:
    """One turn to each key (`concurrency` at a time); their round trips."""
    times: list[float] = []
    gate = asyncio.Semaphore(concurrency)
    async with AsyncClient(state, timeout=120) as client:

        async def one(key: str) -> None:
            async with gate:
                started = time.perf_counter()
                reply = await client.run(key, "ping")
                times.append(time.perf_counter() - started)
                if reply.text != "ping":
                    raise RuntimeError(f"{key}: {reply.text!r}")

        await asyncio.gather(*(one(k) for k in keys))
    return times


def _counts(sup: Sup) -> dict[str, int]:
    with sup.client() as c:
        return dict(c.status()["sessions"])


def _wait_hibernated(sup: Sup, held: int) -> None:
    """Until every held conversation is hibernated (or exited)."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        with sup.client() as c:
            rows = c.sessions(prefix="held-")
        live = [r for r in rows if r["state"] not in ("hibernated", "exited")]
        if len(rows) >= held and not live:
            return
        time.sleep(1.0)
    raise RuntimeError(f"held conversations still live: {len(live)}")


def _supervisor_usage(pid: int, seconds: float) -> dict[str, float]:
    proc = psutil.Process(pid)
    info = proc.memory_full_info()
    before = proc.cpu_times()
    time.sleep(seconds)
    after = proc.cpu_times()
    cpu = (after.user + after.system) - (before.user + before.system)
    return {
        "rss_mib": round(info.rss / MIB, 1),
        "uss_mib": round(info.uss / MIB, 1),
        "idle_cpu_pct": round(100 * cpu / seconds, 2),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [int(x) for x in args.sizes.split(",")]
    results: dict[str, Any] = {"machine": machine(), "active": args.active, "steps": []}
    sup = None
    try:
        config = Path(os.environ.get("HSB_DIR", "/tmp")) / f"held-{os.getpid()}.toml"
        _config(config, 2)
        sup = Sup("--config", str(config), python=args.python, timeout=120)
        active = [f"active-{i}" for i in range(args.active)]
        held = 0
        for size in sizes:
            _reload(sup, config, 2)
            started = time.monotonic()
            asyncio.run(_turns(sup.state, [f"held-{i}" for i in range(held, size)], 16))
            _wait_hibernated(sup, size)
            grow = time.monotonic() - started
            held = size
            _reload(sup, config, 3600)
            asyncio.run(_turns(sup.state, active, 8))  # live (woken) under the long timeout
            with Client(sup.state) as c:
                pid = c.status()["pid"]
            usage = _supervisor_usage(pid, args.idle_seconds)
            times: list[float] = []
            for _ in range(args.rounds):
                times += asyncio.run(_turns(sup.state, active, 8))
            step = {
                "held": size,
                "grow_s": round(grow, 1),
                "states": _counts(sup),
                **usage,
                "turn_p50_ms": round(pct(times, 50) * 1000, 2),
                "turn_p99_ms": round(pct(times, 99) * 1000, 2),
                "turns": len(times),
                "load": load_now(),
            }
            results["steps"].append(step)
            print(json.dumps(step), flush=True)
    finally:
        if sup is not None:
            sup.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100,1000,10000")
    parser.add_argument("--active", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=10, help="turns per active conversation")
    parser.add_argument("--idle-seconds", type=float, default=20.0)
    parser.add_argument("--python", default=sys.executable, help="the install to measure")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results = run(args)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
