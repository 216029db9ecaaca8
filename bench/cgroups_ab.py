"""What a cgroup per session costs: spawn and round trip with cgroups on
against the same install with them off, paired in one run (bench/ab.py's
method: both supervisors at once, single requests alternated between them,
so a loaded machine's noise falls on both alike).

    .venv/bin/python -m bench.cgroups_ab [--spawns 200] [--round-trips 2000]

A spawn here is a new session's first turn answered: with cgroups, the
supervisor makes the group and writes its limits, and the forked child
enters it itself (one write per hierarchy: 3 on v1, 1 on v2). Spares are
off by default (--sup-args '--spare-workers 2' to measure them: a spare is
moved into its group when it is given its session). Goal: spawn p50 within
+1 ms. Needs a host where cgroups are in force (root on v1, or a delegated
v2 subtree); says so and stops otherwise.
"""

from __future__ import annotations

import argparse
import time

from bench.ab import alternate, report, timed_round_trip
from bench.common import Sup
from hermes_sup.client import Client


def run(spawns: int, round_trips: int, sup_args: list[str], keep: bool = False) -> None:
    """Both sides at once, each measurement alternated between them."""
    sides: dict[str, Sup] = {}
    clients: dict[str, Client] = {}
    try:
        sides["this"] = Sup("--cgroups", "auto", *sup_args)
        sides["other"] = Sup("--cgroups", "off", *sup_args)
        clients = {name: sup.client() for name, sup in sides.items()}
        cgroups = clients["this"].status()["cgroups"]
        if not cgroups["active"]:
            print(f"cgroups are not in force here ({cgroups['reason']}): nothing to compare")
            return
        print(
            f"this: cgroups {cgroups['version']} ({', '.join(cgroups['controllers'])}); other: off"
        )
        for c in clients.values():
            c.run("k", "x")

        def round_trip(name: str, i: int) -> float:
            return timed_round_trip(clients[name])

        def spawn(name: str, i: int) -> float:
            time.sleep(0.05)  # spares (if any) refill between spawns, as between sessions
            started = time.perf_counter()
            clients[name].run(f"sp{i}", "x")
            elapsed = time.perf_counter() - started
            if not keep:
                # Stopped again, so that the groups (and workers) do not pile up.
                clients[name].kill(f"sp{i}", force=True)
            return elapsed

        alternate(round_trip, 200)  # warm-up
        report("round trip (this: cgroups)", alternate(round_trip, round_trips), 1e6, "us")
        report("spawn (this: cgroups)", alternate(spawn, spawns), 1e3, "ms")
    finally:
        for c in clients.values():
            c.close()
        for sup in sides.values():
            sup.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spawns", type=int, default=200)
    parser.add_argument("--round-trips", type=int, default=2000)
    parser.add_argument(
        "--sup-args", default="--spare-workers 0", help="extra `serve` arguments for both"
    )
    parser.add_argument(
        "--keep", action="store_true", help="leave each spawned session running (no removals)"
    )
    args = parser.parse_args()
    run(args.spawns, args.round_trips, args.sup_args.split(), args.keep)


if __name__ == "__main__":
    main()
