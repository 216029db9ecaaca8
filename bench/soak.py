"""Soak: mixed load and faults against one real supervisor for N minutes.

    make soak                                   # 30 minutes
    python -m bench.soak --minutes 5            # shorter
    python -m bench.soak --replot               # redraw the plot from the last soak.json

A supervisor with the probe runtime, spare workers on and a configuration
file, driven for `--minutes` by many sessions at once: short turns,
streaming ones (`stream`), `sh` output, approvals (`ask`, answered, or left
to the probe's approval timeout or the turn timeout), bounded output floods
(one 20 MB line, thousands of lines, the worker's own log). Meanwhile, at
random: SIGKILL of a worker (only pids that this supervisor's `list` names
and that descend from it), clients closed while their turn runs, `kill`
and `kill --purge` of sessions, and `reload` after rewriting the file
between two valid settings.

Every turn sent is recorded with its outcome: a reply, an error with its
code, or, for a client closed mid-turn, whether the supervisor still gave
the turn its final answer (seen by a watcher of every session). A turn
with no final answer by the end of the load plus `--grace` is lost; the
goal is none. The supervisor's RSS and open fds are read from /proc every
`--sample` seconds; the goal is that they stay flat (the slope of RSS over
the second half of the load, in KiB a minute, is reported).

Writes bench/results/soak.json and bench/results/soak.png and prints a
short summary. Exits 1 if a turn was lost. The turns and what is recorded
of them are in bench/soak_load.py, the faults in bench/soak_faults.py, the
summary and the plot in bench/soak_report.py; this file runs them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.common import RESULTS, Sup, proc_usage
from bench.soak_faults import LONGEST_TURN, killer, reloader, stopper, write_config
from bench.soak_load import Soak, driver, watcher
from bench.soak_report import log_summary, plot, print_summary, report
from hermes_sup.client import AsyncClient, ClientError


async def sampler(soak: Soak, client: AsyncClient, every: float, stop: asyncio.Event) -> None:
    """The supervisor's RSS, fds, threads and CPU, and its session counts."""
    pid = soak.sup.proc.pid
    while not stop.is_set():
        rss, fds, threads, cpu = proc_usage(pid)
        sample: dict[str, float] = {
            "t": round(soak.now(), 2),
            "rss_kib": rss,
            "fds": fds,
            "threads": threads,
            "cpu_s": cpu,
            "load1": os.getloadavg()[0],
        }
        try:
            info = await asyncio.wait_for(client.status(), 10)
            sample["sessions_live"] = sum(
                n for state, n in info["sessions"].items() if state != "exited"
            )
            sample["sessions_total"] = info["total_sessions"]
            sample["spares"] = info["spare_workers"]
            sample["queued"] = info["queued"]
        except (ClientError, TimeoutError):
            pass
        soak.samples.append(sample)
        try:
            await asyncio.wait_for(stop.wait(), every)
        except TimeoutError:
            pass


# ---------------------------------------------------------------- the run


async def soak_run(args: argparse.Namespace, sup: Sup, config: Path) -> Soak:
    """The load and the faults for `--minutes`, then the drain and a settle:
    everything the report needs, recorded in the returned `Soak`."""
    load = args.minutes * 60
    started = time.monotonic()
    soak = Soak(sup, started, started + load, random.Random(args.seed))
    keys = [f"soak-{i:02d}" for i in range(args.sessions)]
    timeout = LONGEST_TURN + args.grace  # no request gives up before the drain does
    clients = [AsyncClient(sup.state, timeout=timeout) for _ in range(args.clients)]
    chaos_client = AsyncClient(sup.state, timeout=60)
    stop_sampling = asyncio.Event()
    side: set[asyncio.Task[None]] = set()
    background = [
        asyncio.create_task(watcher(soak, timeout)),
        asyncio.create_task(sampler(soak, chaos_client, args.sample, stop_sampling)),
    ]
    await asyncio.sleep(0.5)  # the watch is in place before the first turn
    load_tasks = [
        asyncio.create_task(driver(soak, clients[i % len(clients)], keys, side, timeout))
        for i in range(args.drivers)
    ]
    load_tasks += [
        asyncio.create_task(killer(soak, chaos_client, (2, 8))),
        asyncio.create_task(stopper(soak, chaos_client, keys, (5, 15))),
        asyncio.create_task(reloader(soak, config, (15, 30))),
    ]
    # The load ends at load_until; every turn still out then has `grace`
    # seconds (plus the longest turn) to get its final answer.
    deadline = soak.load_until + LONGEST_TURN + args.grace
    await asyncio.sleep(max(0.0, soak.load_until - time.monotonic()))
    pending = [t for t in [*load_tasks, *side] if not t.done()]
    if pending:
        await asyncio.wait(pending, timeout=max(0.1, deadline - time.monotonic()))
    for task in [*load_tasks, *side]:
        if not task.done():
            task.cancel()
    await asyncio.gather(*load_tasks, *side, return_exceptions=True)
    soak.drained_at = soak.now()
    for rec in soak.turns:
        if rec.outcome == "pending":
            rec.outcome = "lost"
    # A little longer: the watcher hears the last finals, the sampler sees
    # the supervisor settle with no load.
    await asyncio.sleep(args.settle)
    stop_sampling.set()
    for task in background:
        task.cancel()
    await asyncio.gather(*background, return_exceptions=True)
    for c in [*clients, chaos_client]:
        await c.close()
    return soak


def main() -> int:
    """Soak one supervisor (or --replot); exit 1 if a turn was lost."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="length of the load (30)")
    parser.add_argument("--drivers", type=int, default=10, help="turns in flight at once (10)")
    parser.add_argument("--sessions", type=int, default=24, help="session keys used (24)")
    parser.add_argument("--clients", type=int, default=4, help="client connections shared (4)")
    parser.add_argument(
        "--grace",
        type=float,
        default=30.0,
        help="seconds past the longest turn for the last answers (30)",
    )
    parser.add_argument("--sample", type=float, default=3.0, help="seconds between samples (3)")
    parser.add_argument(
        "--settle",
        type=float,
        default=15.0,
        help="seconds sampled after the drain, with no load (15)",
    )
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--replot", action="store_true", help="only redraw soak.png from the last soak.json"
    )
    args = parser.parse_args()
    if args.replot:
        print(plot(json.loads((RESULTS / "soak.json").read_text()), RESULTS / "soak.png"))
        return 0
    if args.seed is None:
        args.seed = random.randrange(1 << 30)
    confdir = Path(tempfile.mkdtemp(prefix="hss-", dir=os.environ.get("HSB_DIR", "/tmp")))
    config = confdir / "soak.toml"
    write_config(config, "A")
    print(f"soak: {args.minutes:g} min, seed {args.seed}", flush=True)
    sup = Sup("--config", str(config))
    try:
        soak = asyncio.run(soak_run(args, sup, config))
        log = log_summary(sup.log)
        RESULTS.mkdir(exist_ok=True)
        shutil.copy(sup.log, RESULTS / "soak-supervisor.log")
    finally:
        sup.close()
        shutil.rmtree(confdir, ignore_errors=True)
    result = report(soak, args, log)
    (RESULTS / "soak.json").write_text(json.dumps(result, indent=1))
    plot_path = plot(result, RESULTS / "soak.png")
    print_summary(result, plot_path)
    return 1 if result["summary"]["lost"] else 0


if __name__ == "__main__":
    sys.exit(main())
