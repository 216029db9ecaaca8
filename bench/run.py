"""hermes-sup benchmarks, each measured next to its floor in the same run.

    make bench                              # everything (a few minutes)
    python -m bench.run --quick             # smaller counts, for a smoke run
    python -m bench.run --only spawn        # just spawns (no peers) next to the bare fork
    python -m bench.run --only round_trip   # just round trips next to the bare proxy

Run from the repository root. Prints a table and writes
bench/results/latest.json (latest-spawn.json, latest-round_trip.json with
--only). Machines here are shared and noisy: repeat, report p50 and p99,
and judge by ratios to a floor measured side by side, never by absolute
times. The measuring pieces are in bench/spawn.py and bench/round_trip.py;
this file chooses the counts and the order, and prints the table.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import random
import signal
import sys
import time
from typing import Any

import psutil

from bench.common import RESULTS, Sup, cpu_ticks, machine, pct, stolen_pct, summary
from bench.round_trip import ack_paired, proxy_floor, routed
from bench.spawn import (
    spawn_bare_fork,
    spawn_circus,
    spawn_hermes_sup,
    spawn_jupyter,
    spawn_multiprocessing,
    spawn_with_spares,
    spawn_without_spares,
    wait_for_spares,
)

# ---------------------------------------------------------------- memory


def memory_of(pids: list[int]) -> dict[str, float]:
    """p50 USS and PSS (MiB) of the given processes, and their minor page
    faults so far: for a worker forked from the zygote, nearly all of them
    are copy-on-write copies of its pages. Unlike a time, that count repeats
    within a few faults from run to run, so it shows small changes to what
    a worker touches where timings on this machine cannot."""
    uss, pss, faults = [], [], []
    for pid in pids:
        try:
            info = psutil.Process(pid).memory_full_info()
            with open(f"/proc/{pid}/stat") as f:
                faults.append(int(f.read().rsplit(")", 1)[1].split()[7]))  # minflt
        except (psutil.Error, OSError):
            continue
        uss.append(info.uss / 2**20)
        pss.append(info.pss / 2**20)
    return {
        "n": len(uss),
        "uss_mib_p50": pct(uss, 50),
        "pss_mib_p50": pct(pss, 50),
        "uss_mib_max": max(uss),
        "minor_faults_p50": pct(faults, 50),
    }


def supervisor_usage(sup: Sup) -> dict[str, float]:
    """The supervisor's own RSS (MiB) and open fds."""
    p = psutil.Process(sup.proc.pid)
    return {"rss_mib": p.memory_info().rss / 2**20, "fds": p.num_fds()}


# ---------------------------------------------------------------- hermes


def hermes_bench(count: int) -> dict[str, Any] | None:
    """Ready time and idle memory of hermes sessions (no model call needed)."""
    if importlib.util.find_spec("run_agent") is None:  # hermes-agent not installed
        return None
    sup = Sup("--agent", "hermes")
    try:
        times = []
        with sup.client() as c:
            for i in range(count):
                started = time.perf_counter()
                c.open(f"h{i}")
                while c.sessions(prefix=f"h{i}")[0]["state"] != "idle":
                    time.sleep(0.002)
                times.append(time.perf_counter() - started)
        time.sleep(1)
        return {"ready": summary(times), "memory": memory_of(sup.worker_pids())}
    finally:
        sup.close()


# ---------------------------------------------------------------- main


def main() -> int:
    """Every figure (or --only one) beside its floor; print and write the results."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="small counts (smoke run)")
    parser.add_argument("--skip-scale", action="store_true")
    parser.add_argument(
        "--only",
        choices=("spawn", "round_trip"),
        help="just this figure and its floor (spawn: without peers), for a quick check",
    )
    args = parser.parse_args()
    # Killed (a timeout's SIGTERM), still stop the supervisors and the floor's
    # processes in the `finally`s: they would outlive us otherwise.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    q = args.quick
    n_spawn = 50 if q else 200
    n_rt = 500 if q else 2000
    out: dict[str, Any] = {"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine()}
    gc.collect()

    sup = Sup()
    try:
        if args.only in (None, "spawn"):
            out["spawn"] = measure_spawns(sup, n_spawn, peers=args.only is None)
        if args.only in (None, "round_trip"):
            out["round_trip"] = measure_round_trips(sup, n_rt)
        if args.only is None:
            print("memory ...", flush=True)
            time.sleep(1)
            pids = sup.worker_pids()[:50]
            out["memory"] = {"probe_idle_50": memory_of(pids)}
    finally:
        sup.close()

    if args.only is None and not args.skip_scale:
        print("scale ...", flush=True)
        out["scale"] = scale(200 if q else 2000, n_rt // 10)
        out["memory"]["probe_idle_1000"] = out["scale"].pop("memory_at_1000", None)

    if args.only is None:
        print("hermes ...", flush=True)
        out["hermes"] = hermes_bench(5 if q else 20)

    RESULTS.mkdir(exist_ok=True)
    name = "latest.json" if args.only is None else f"latest-{args.only}.json"
    (RESULTS / name).write_text(json.dumps(out, indent=2))
    print_table(out)
    print(f"\nfull results: {RESULTS / name}")
    return 0


def measure_spawns(sup: Sup, n_spawn: int, peers: bool) -> dict[str, Any]:
    """Spawns of `sup` (default settings: spare workers on), of one with
    none and one with 2, next to the bare fork floor (and the peers)."""
    print("spawn ...", flush=True)
    ticks = cpu_ticks()
    floor = spawn_bare_fork(n_spawn)
    wait_for_spares(sup, 1)  # the default spares, ready, as on a serving machine
    ours = spawn_hermes_sup(sup, n_spawn, "sp")
    out: dict[str, Any] = {"bare_fork_floor": summary(floor), "hermes_sup": summary(ours)}
    if peers:
        out["forkserver_warm"] = summary(spawn_multiprocessing("forkserver", n_spawn))
        out["mp_spawn"] = summary(spawn_multiprocessing("spawn", max(10, n_spawn // 4)))
        # Peers from the `bench` extra, when it is installed.
        for name, measure in (("circus", spawn_circus), ("jupyter", spawn_jupyter)):
            times = measure(max(5, n_spawn // 10))
            if times is not None:
                out[name] = summary(times)
    out["ratio_p50_to_floor"] = out["hermes_sup"]["p50_ms"] / out["bare_fork_floor"]["p50_ms"]
    out["ratio_p99_to_floor"] = out["hermes_sup"]["p99_ms"] / out["bare_fork_floor"]["p99_ms"]
    out["hermes_sup_no_spares"] = spawn_without_spares(n_spawn)
    out["hermes_sup_2_spares"] = spawn_with_spares(n_spawn)
    out["cpu_stolen_pct"] = stolen_pct(ticks)
    return out


def measure_round_trips(sup: Sup, n_rt: int) -> dict[str, Any]:
    """Round trips and throughput with 1 and 64 sessions next to the bare
    proxy, and what the `running` acknowledgement costs one session."""
    print("round trips ...", flush=True)
    rt: dict[str, Any] = {}
    for sessions in (1, 64):
        rt[f"floor_{sessions}"] = proxy_floor(sessions, n_rt, 256)
        rt[f"hermes_sup_{sessions}"] = routed(sup, sessions, n_rt, 256)
        rt[f"ratio_p50_{sessions}"] = (
            rt[f"hermes_sup_{sessions}"]["latency"]["p50_ms"]
            / rt[f"floor_{sessions}"]["latency"]["p50_ms"]
        )
        rt[f"ratio_throughput_{sessions}"] = (
            rt[f"hermes_sup_{sessions}"]["throughput_per_s"]
            / rt[f"floor_{sessions}"]["throughput_per_s"]
        )
    rt["hermes_sup_1_no_ack"] = routed(sup, 1, n_rt, 256, ack=False)
    rt["ratio_p50_1_no_ack"] = (
        rt["hermes_sup_1_no_ack"]["latency"]["p50_ms"] / rt["floor_1"]["latency"]["p50_ms"]
    )
    rt["ack_paired"] = ack_paired(sup, n_rt // 2)
    return rt


def spawn_rows(s: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """The table's rows for the spawn figure."""
    rows = [
        (
            "spawn p50 ms (default spares)",
            f"{s['hermes_sup']['p50_ms']:.2f}",
            f"{s['bare_fork_floor']['p50_ms']:.2f} bare fork",
            f"{s['ratio_p50_to_floor']:.2f}x",
        ),
        (
            "spawn p99 ms (default spares)",
            f"{s['hermes_sup']['p99_ms']:.2f}",
            f"{s['bare_fork_floor']['p99_ms']:.2f} bare fork",
            f"{s['ratio_p99_to_floor']:.2f}x" if "ratio_p99_to_floor" in s else "",
        ),
    ]
    floor_p50 = s["bare_fork_floor"]["p50_ms"]
    none = s.get("hermes_sup_no_spares")
    if none:
        rows.append(
            (
                "  with --spare-workers 0: p50 (p99)",
                f"{none['p50_ms']:.2f} ({none['p99_ms']:.1f})",
                "",
                f"{none['p50_ms'] / floor_p50:.2f}x",
            )
        )
    for mode, label in (("spaced", "20 ms apart"), ("back_to_back", "back to back")):
        spared = s.get("hermes_sup_2_spares", {}).get(mode)
        if spared:
            rows.append(
                (
                    f"  with 2 spares, {label}: p50 (p99)",
                    f"{spared['p50_ms']:.2f} ({spared['p99_ms']:.1f})",
                    "",
                    f"{spared['p50_ms'] / floor_p50:.2f}x",
                )
            )
    if "cpu_stolen_pct" in s:
        rows.append(("  CPU stolen by the host, %", f"{s['cpu_stolen_pct']:.1f}", "", ""))
    for name, label in (
        ("forkserver_warm", "warm forkserver"),
        ("mp_spawn", "mp spawn"),
        ("circus", "circus watcher"),
        ("jupyter", "Jupyter kernel"),
    ):
        if name in s:
            rows.append(("", "", f"{s[name]['p50_ms']:.2f} {label}", ""))
    return rows


def round_trip_rows(r: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """The table's rows for the round-trip figure."""
    rows = []
    for n in (1, 64):
        ours, floor = r[f"hermes_sup_{n}"], r[f"floor_{n}"]
        rows.append(
            (
                f"round trip p50 ms, {n} sess",
                f"{ours['latency']['p50_ms']:.3f}",
                f"{floor['latency']['p50_ms']:.3f} bare proxy",
                f"{r[f'ratio_p50_{n}']:.2f}x",
            )
        )
        if n == 1 and "hermes_sup_1_no_ack" in r:
            rows.append(
                (
                    "  with ack: false",
                    f"{r['hermes_sup_1_no_ack']['latency']['p50_ms']:.3f}",
                    "",
                    f"{r['ratio_p50_1_no_ack']:.2f}x",
                )
            )
        rows.append(
            (
                f"throughput msg/s, {n} sess",
                f"{ours['throughput_per_s']:.0f}",
                f"{floor['throughput_per_s']:.0f} bare proxy",
                f"{r[f'ratio_throughput_{n}']:.2f}x",
            )
        )
        for part in ("router", "workers", "client"):
            mine, base = ours["cpu_us_per_message"][part], floor["cpu_us_per_message"][part]
            rows.append(
                (
                    f"  CPU us/msg {part}, {n} sess",
                    f"{mine:.0f}",
                    f"{base:.0f} bare proxy",
                    f"{mine / base:.1f}x" if base > 0 else "",
                )
            )
    paired = r.get("ack_paired")
    if paired:
        rows.append(
            (
                "  paired: ack / ack: false p50 ms",
                f"{paired['ack']['p50_ms']:.3f} / {paired['no_ack']['p50_ms']:.3f}",
                f"saving {paired['median_paired_saving_ms'] * 1e3:.0f} us",
                "",
            )
        )
    return rows


def print_table(out: dict[str, Any]) -> None:
    """The figures that matter, with their floors and the ratio between."""
    rows: list[tuple[str, str, str, str]] = [("figure", "hermes-sup", "floor/peer", "ratio")]
    if "spawn" in out:
        rows += spawn_rows(out["spawn"])
    if "round_trip" in out:
        rows += round_trip_rows(out["round_trip"])
    for name, mem in out.get("memory", {}).items():
        if mem:
            rows.append(
                (
                    f"USS MiB, {name}",
                    f"{mem['uss_mib_p50']:.2f}",
                    f"PSS {mem['pss_mib_p50']:.2f}",
                    f"{mem.get('minor_faults_p50', 0):.0f} faults",
                )
            )
    for size, sc in out.get("scale", {}).items():
        rows.append(
            (
                f"at {size}: spawn p99 / rtt p99 ms",
                f"{sc['spawn_last_batch']['p99_ms']:.1f} / {sc['round_trip']['p99_ms']:.1f}",
                f"sup {sc['supervisor']['rss_mib']:.0f} MiB, {sc['supervisor']['fds']} fds",
                "",
            )
        )
    h = out.get("hermes")
    if h:
        rows.append(("hermes ready p50 ms", f"{h['ready']['p50_ms']:.0f}", "", ""))
        rows.append(("hermes idle USS MiB", f"{h['memory']['uss_mib_p50']:.1f}", "", ""))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip())


def scale(total: int, pings: int) -> dict[str, Any]:
    """Spawn up to `total` idle sessions; at checkpoints measure spawn p99 of
    the last 100, round-trip p99 to random sessions, supervisor fds and RSS."""
    sup = Sup()
    result: dict[str, Any] = {}
    try:
        with sup.client() as c:
            done = 0
            for checkpoint in (100, 1000, 2000):
                if checkpoint > total:
                    break
                spawn = []
                for i in range(done, checkpoint):
                    started = time.perf_counter()
                    c.run(f"sc{i}", "x")
                    spawn.append(time.perf_counter() - started)
                done = checkpoint
                rtt = []
                for _ in range(pings):
                    key = f"sc{random.randrange(done)}"
                    started = time.perf_counter()
                    c.run(key, "x")
                    rtt.append(time.perf_counter() - started)
                result[str(checkpoint)] = {
                    "spawn_last_batch": summary(spawn[-100:]),
                    "round_trip": summary(rtt),
                    "supervisor": supervisor_usage(sup),
                }
                if checkpoint == 1000:
                    time.sleep(1)
                    result["memory_at_1000"] = memory_of(sup.worker_pids())
    finally:
        sup.close()
    return result


if __name__ == "__main__":
    sys.exit(main())
