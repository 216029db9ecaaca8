"""Same-run A/B of two installs of hermes-sup, so the noise of a shared
machine falls on both alike.

    # B: a second checkout installed in its own venv, e.g.
    git worktree add /tmp/before <commit> && python3 -m venv /tmp/bv \\
        && /tmp/bv/bin/pip install -e /tmp/before
    .venv/bin/python -m bench.ab /tmp/bv/bin/python --paired
    .venv/bin/python -m bench.ab /tmp/bv/bin/python --rounds 3

Settings A/B of one install (the cost of a setting, e.g. a sealed
session's network namespace): the same python on both sides, and each
side's own `serve` arguments:

    .venv/bin/python -m bench.ab .venv/bin/python --paired \\
        --this-args '--network egress' --other-args '--network host'

--paired (the sharper test) runs both supervisors at once and alternates
single requests between them: each round trip and each spawn of one has a
twin of the other taken a millisecond away, under the same load. It
reports each side's median, the median of the paired differences, how
often this side was faster, and the CPU and context switches per round
trip of each side's supervisor and worker. The client is this install's
for both, so it compares supervisors and workers, not clients.

Without it, each round runs `ab.py --once` under this interpreter, then
under the other: 200 spawns and 1,000 round trips with 1 and 64 sessions.
Run from the repository root: the other interpreter runs this checkout's
bench/ against its own install of hermes_sup.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable

from bench.common import REPO, Sup, context_switches, cpu_seconds, pct, summary
from bench.round_trip import routed
from bench.spawn import spawn_hermes_sup
from hermes_sup.client import Client
from hermes_sup.protocol import Kind


def once() -> dict[str, float]:
    """One round of the sequential A/B, under this interpreter's install."""
    sup = Sup()
    try:
        spawn = summary(spawn_hermes_sup(sup, 200, "sp"))["p50_ms"]
        one = routed(sup, 1, 1000, 256)
        many = routed(sup, 64, 1000, 256)
    finally:
        sup.close()
    return {
        "spawn_p50_ms": spawn,
        "rtt1_p50_ms": one["latency"]["p50_ms"],
        "throughput1": one["throughput_per_s"],
        "rtt64_p50_ms": many["latency"]["p50_ms"],
        "throughput64": many["throughput_per_s"],
        "sup_cpu_us1": one["cpu_us_per_message"]["router"],
        "worker_cpu_us1": one["cpu_us_per_message"]["workers"],
        "client_cpu_us1": one["cpu_us_per_message"]["client"],
        "sup_cpu_us64": many["cpu_us_per_message"]["router"],
    }


def paired(
    other: str,
    round_trips: int,
    spawns: int,
    sup_args: list[str],
    idle: int = 0,
    this_args: list[str] | None = None,
    other_args: list[str] | None = None,
) -> None:
    """Both supervisors at once, single requests alternated between them
    (`this_args`, `other_args`: each side's own `serve` arguments)."""
    sides: dict[str, Sup] = {}
    clients: dict[str, Client] = {}
    try:
        sides["this"] = Sup(*sup_args, *(this_args or []))
        sides["other"] = Sup(*sup_args, *(other_args or []), python=other)
        clients = {name: sup.client() for name, sup in sides.items()}
        pids = {}
        for name, c in clients.items():
            c.run("k", "x")
            pids[name] = [sides[name].proc.pid, c.sessions()[0]["pid"]]
            for i in range(idle):  # sessions left idle, as at scale
                c.run(f"idle{i}", "x")

        def round_trip(name: str) -> float:
            return timed_round_trip(clients[name])

        def spawn(name: str, i: int) -> float:
            time.sleep(0.01)  # spares (if any) refill between spawns
            started = time.perf_counter()
            clients[name].run(f"sp{i}", "x")
            return time.perf_counter() - started

        alternate(lambda name, i: round_trip(name), 300)  # warm-up
        before = {n: (cpu_seconds(p), sum(map(context_switches, p))) for n, p in pids.items()}
        rtt = alternate(lambda name, i: round_trip(name), round_trips)
        after = {n: (cpu_seconds(p), sum(map(context_switches, p))) for n, p in pids.items()}
        report("round trip", rtt, 1e6, "us")
        for name in sides:
            cpu = (after[name][0] - before[name][0]) / round_trips * 1e6
            ctx = (after[name][1] - before[name][1]) / round_trips
            print(f"  {name:5} supervisor+worker: {cpu:.0f} us CPU, {ctx:.2f} switches per trip")
        if spawns:
            report("spawn", alternate(spawn, spawns), 1e3, "ms")
    finally:
        for c in clients.values():
            c.close()
        for sup in sides.values():
            sup.close()


def timed_round_trip(client: Client, session: str = "k") -> float:
    """One turn of `session` (running), from its send until its answer."""
    started = time.perf_counter()
    client.submit(Kind.SEND, {"text": "x"}, session=session)
    while client.next().kind is Kind.EVENT:
        pass
    return time.perf_counter() - started


def alternate(measure: Callable[[str, int], float], n: int) -> dict[str, list[float]]:
    """`n` pairs of measurements of the sides "this" and "other", which of
    the two goes first alternating from pair to pair."""
    out: dict[str, list[float]] = {"this": [], "other": []}
    for i in range(n):
        order = ("this", "other") if i % 2 == 0 else ("other", "this")
        for name in order:
            out[name].append(measure(name, i))
    return out


def report(what: str, samples: dict[str, list[float]], scale: float, unit: str) -> None:
    """Each side's p50, the p50 of the paired differences, and the wins."""
    this, other = samples["this"], samples["other"]
    diffs = [(a - o) * scale for a, o in zip(this, other, strict=True)]
    faster = sum(d < 0 for d in diffs)
    print(
        f"{what}: this p50 {pct(this, 50) * scale:.1f} {unit}, other p50 "
        f"{pct(other, 50) * scale:.1f} {unit}; paired difference p50 "
        f"{pct(diffs, 50):+.1f} {unit}; this faster in {faster} of {len(diffs)}"
    )


def main() -> None:
    """Paired, sequential rounds, or (--once) one round of this install."""
    parser = argparse.ArgumentParser()
    parser.add_argument("other", nargs="?", help="the python of the other install")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--paired", action="store_true", help="both at once, request by request")
    parser.add_argument("--round-trips", type=int, default=3000)
    parser.add_argument("--spawns", type=int, default=200)
    parser.add_argument("--idle", type=int, default=0, help="idle sessions on each side first")
    parser.add_argument(
        "--sup-args", default="", help="extra `serve` arguments for both, e.g. '--spare-workers 2'"
    )
    parser.add_argument("--this-args", default="", help="`serve` arguments for this side only")
    parser.add_argument("--other-args", default="", help="`serve` arguments for the other only")
    parser.add_argument("--once", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.once:
        print(json.dumps(once()))
        return
    if not args.other:
        parser.error("name the other install's python")
    if args.paired:
        paired(
            args.other,
            args.round_trips,
            args.spawns,
            args.sup_args.split(),
            args.idle,
            args.this_args.split(),
            args.other_args.split(),
        )
        return
    for _ in range(args.rounds):
        for label, python in (("this", sys.executable), ("other", args.other)):
            out = subprocess.run(
                [python, "-m", "bench.ab", "--once"],
                capture_output=True,
                text=True,
                check=True,
                cwd=REPO,
            )
            figures = json.loads(out.stdout.strip().splitlines()[-1])
            print(label, " ".join(f"{k}={v:.2f}" for k, v in figures.items()), flush=True)


if __name__ == "__main__":
    main()
