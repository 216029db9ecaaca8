"""bench/route.py's scale and failover modes, and bench/route_ab.py, run
tiny, so that they cannot rot between the runs that record BENCHMARKS.md
("Routed turns"). They assert what each measurement returns, never how
fast anything is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parent.parent


def bench(workdir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`python -m bench.route ARGS`, as documented, from the repository root."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.route", *args, "--out", str(workdir / "route.json")],
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def test_scale_measures_spawns_turns_and_what_each_node_holds(workdir) -> None:
    bench(workdir, "--scale", "2", "--scale-nodes", "1,2", "--in-flight", "2")
    result = json.loads((workdir / "route_scale.json").read_text())
    assert [run["nodes"] for run in result["runs"]] == [1, 2]
    for run in result["runs"]:
        assert run["sessions"] == 2 * run["nodes"]
        assert run["spawns_per_s"] > 0 and run["turns_per_s"] > 0
        # Every node answered, and together they hold every session.
        assert len(run["held"]) == run["nodes"]
        assert sum(node["sessions"] for node in run["held"].values()) == run["sessions"]


def test_failover_measures_a_dead_nodes_keys_served_again(workdir) -> None:
    bench(workdir, "--failover", "6")
    result = json.loads((workdir / "route_failover.json").read_text())
    assert result["sessions"] == 6 and result["last_ms"] >= result["p50_ms"] > 0


def test_route_ab_pairs_two_routers_in_front_of_one_node(workdir) -> None:
    # This install against itself: what it measures, not how fast.
    done = subprocess.run(
        [sys.executable, "-m", "bench.route_ab", sys.executable, "--turns", "5",
         "--warm", "2", "--out", str(workdir / "route_ab.json")],
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((workdir / "route_ab.json").read_text())
    assert {"this", "other", "direct"} <= set(result)
    assert all(result[side]["p50_ms"] > 0 for side in ("this", "other", "direct"))
    assert result["this_faster"].endswith("of 5")
    assert set(result["router_cpu_us_per_turn"]) == {"this", "other"}
