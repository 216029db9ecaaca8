"""Failover on a real local Ray cluster (three raylets on 127.0.0.1, one
shared data directory, `ray up` with the default watchdog, a router).

    stop      one node's supervisor is stopped (SIGSTOP) for --freeze
              seconds while each of its keys is asked, again and again,
              for its note through the router: the time from the stop to
              each key answered again with its files (served elsewhere),
              and how many of the frozen node's workers were still alive
              when its first key was served elsewhere (0: never a key on
              two nodes)
    freeze    a whole node (its raylet and everything under it, its agent,
              its supervisor and workers) is stopped for --freeze seconds:
              the time to each of its keys answered again elsewhere (the
              node lease, `ray up --lease-time`), and whether the frozen
              node gave its sessions up on waking (`node_lease_expired`)
    join      a fourth raylet joins: the time until the router has its node
    restart   a raylet is removed and started again with its label: whether
              its node comes back under its name

    .venv/bin/python -m bench.ray_failover [--keys 30] [--freeze 30]

Results in bench/results/ray_failover.json. Everything listens and
connects on 127.0.0.1 only (Ray's own guess of the address too).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # Ray guesses 127.0.0.1

import psutil  # noqa: E402

from hermes_sup.client import Client, NotRunning, SupervisorError, Timeout  # noqa: E402
from hermes_sup.cluster.placement import Candidate, rendezvous  # noqa: E402
from hermes_sup.cluster.ray_nodes import NAME_LABEL  # noqa: E402

from .common import REPO, stop, wait_until  # noqa: E402

LOOPBACK = "127.0.0.1"


def running(pids: set[int]) -> set[int]:
    """Those of `pids` that run (zombies are not counted)."""
    left = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left.add(pid)
        except psutil.Error:
            continue
    return left


def serve_again(
    state_dir: Path, keys: list[str], stopped: float, workers: set[int]
) -> tuple[dict[str, float], int | None]:
    """Ask each key for its note until it answers (for up to 120 s): the
    seconds from `stopped` to each key's answer, and how many of `workers`
    ran when the first key answered."""
    served: dict[str, float] = {}
    alive_at_first: int | None = None
    while len(served) < len(keys) and time.monotonic() < stopped + 120:
        for key in keys:
            if key in served:
                continue
            try:
                with Client(state_dir, timeout=2.0) as c:
                    text = c.run(key, "sh cat note.txt")
            except (SupervisorError, Timeout):
                continue
            if "".join(str(e.data) for e in text.events if e.type == "output").strip():
                served[key] = time.monotonic() - stopped
                if alive_at_first is None:
                    alive_at_first = len(running(workers))
    return served, alive_at_first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=30)
    parser.add_argument("--freeze", type=float, default=30.0)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hsrf-", dir="/tmp"))
    os.environ["RAY_TMPDIR"] = str(root / "ray")
    (root / "ray").mkdir()
    from ray import cluster_utils

    def add(cluster: cluster_utils.Cluster, name: str):  # noqa: ANN202
        return cluster.add_node(num_cpus=1, node_ip_address=LOOPBACK, labels={NAME_LABEL: name})

    cluster = cluster_utils.Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": False,
                        "node_ip_address": LOOPBACK, "labels": {NAME_LABEL: "n1"}},
    )  # fmt: skip
    router = None
    results: dict[str, object] = {"keys": args.keys, "freeze_s": args.freeze}
    try:
        nodes = {"n2": add(cluster, "n2"), "n3": add(cluster, "n3")}
        cluster.wait_for_nodes()
        made = subprocess.run(
            [sys.executable, "-m", "hermes_sup.cli.ray", "up", "--address", cluster.address,
             "--base-dir", str(root / "n"), "--data-dir", str(root / "shared")],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        infos = {i["name"]: i for i in map(json.loads, made.stdout.splitlines()[:-1])}
        state_dir = root / "r"
        with open(root / "router.log", "ab") as log:
            router = subprocess.Popen(
                [sys.executable, "-m", "hermes_sup.cli.route", "--ray", cluster.address,
                 "--state-dir", str(state_dir), "--poll", "0.5"],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip

        def answering() -> set[str]:
            try:
                with Client(state_dir, timeout=5.0) as c:
                    return {n["name"] for n in c.status()["nodes"] if n["answered"]}
            except (NotRunning, Timeout):
                return set()

        wait_until(lambda: answering() == set(infos), "all nodes through the router", router)
        keys = [f"rf:{i}" for i in range(args.keys)]
        owner = {k: rendezvous(k, [Candidate(n) for n in infos]) for k in keys}
        with Client(state_dir, timeout=60.0) as c:
            for key in keys:
                c.run(key, f"write note.txt of-{key}")
        frozen = "n2"
        doomed = [k for k in keys if owner[k] == frozen]
        pid = infos[frozen]["pid"]
        workers = {p.pid for p in psutil.Process(pid).children(recursive=True)}
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        served, alive_at_first = serve_again(state_dir, doomed, stopped, workers)
        deadline = stopped + args.freeze
        killed = not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
        if time.monotonic() < deadline and not killed:
            time.sleep(deadline - time.monotonic())
        results["stop"] = {
            "keys_of_frozen_node": len(doomed),
            "served_again_s": sorted(round(v, 2) for v in served.values()),
            "all_served_s": round(max(served.values()), 2) if served else None,
            "frozen_workers_alive_at_first_takeover": alive_at_first,
            "watchdog_killed": "watchdog_killed"
            in (root / "n" / frozen / "supervisor.log").read_text(errors="replace"),
        }
        # A whole node frozen: its raylet (Ray may go on calling it alive),
        # everything under it, its agent and its supervisor's tree.
        wait_until(lambda: answering() == set(infos), "n2 back through the router", router, 120)
        whole = "n3"
        tree: set[int] = set()
        for handles in nodes[whole].all_processes.values():
            for handle in handles:
                tree.add(handle.process.pid)
        for top in [*tree, infos[whole]["agent_pid"], infos[whole]["pid"]]:
            with contextlib.suppress(psutil.Error):
                tree |= {top} | {p.pid for p in psutil.Process(top).children(recursive=True)}
        on_whole = [k for k in keys if owner[k] == whole]
        for one in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(one, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            whole_served, _ = serve_again(state_dir, on_whole, stopped, set())
            if time.monotonic() < stopped + args.freeze:
                time.sleep(stopped + args.freeze - time.monotonic())
        finally:
            for one in tree:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(one, signal.SIGCONT)
        wait_until(lambda: answering() == set(infos), "n3 back through the router", router, 120)
        results["freeze"] = {
            "keys_of_frozen_node": len(on_whole),
            "served_again_s": sorted(round(v, 2) for v in whole_served.values()),
            "all_served_s": round(max(whole_served.values()), 2) if whole_served else None,
            "gave_up_on_waking": "node_lease_expired"
            in (root / "n" / whole / "supervisor.log").read_text(errors="replace"),
        }
        joined = time.monotonic()
        add(cluster, "n4")
        wait_until(lambda: "n4" in answering(), "n4 through the router", router, 120)
        results["join_s"] = round(time.monotonic() - joined, 2)
        cluster.remove_node(nodes["n3"])
        wait_until(lambda: "n3" not in answering(), "n3 gone", router, 120)
        restarted = time.monotonic()
        add(cluster, "n3")
        wait_until(lambda: "n3" in answering(), "n3 back", router, 120)
        results["restart"] = {
            "back_under_its_name_s": round(time.monotonic() - restarted, 2),
            "node_dirs": sorted(p.name for p in (root / "n").iterdir()),
        }
    finally:
        if router is not None:
            stop(router)
        subprocess.run(
            [sys.executable, "-m", "hermes_sup.cli.ray", "down", "--address", cluster.address],
            capture_output=True, check=False,
        )  # fmt: skip
        cluster.shutdown()
    out = REPO / "bench" / "results" / "ray_failover.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
