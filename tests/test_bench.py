"""The benchmark suite's measuring pieces, run tiny, so that `make bench`
cannot rot unnoticed between the runs that record BENCHMARKS.md. These
assert what each measurement returns, never how fast anything is."""

from __future__ import annotations

from types import ModuleType

import psutil
import pytest

from bench.common import pct

from .conftest import wait_gone


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    """bench/run.py, with the measuring pieces it runs (its name marks the
    tests that use it e2e: they start supervisors and peers' workers)."""
    from bench import run

    return run


def test_floors_and_peers_measure(bench) -> None:
    for times in (
        bench.spawn_bare_fork(3),
        bench.spawn_multiprocessing("forkserver", 2),
        bench.spawn_multiprocessing("spawn", 1),
    ):
        assert times and all(t > 0 for t in times)
    floor = bench.proxy_floor(2, 20, 4)
    assert floor["throughput_per_s"] > 0 and floor["latency"]["n"] == 20
    assert set(floor["cpu_us_per_message"]) == {"router", "workers", "client"}


def test_hermes_sup_measures_and_leaves_nothing(bench) -> None:
    sup = bench.Sup()
    try:
        spawns = bench.spawn_hermes_sup(sup, 3, "t")
        assert len(spawns) == 3 and all(t > 0 for t in spawns)
        routed = bench.routed(sup, 2, 20, 4)
        assert routed["throughput_per_s"] > 0 and routed["latency"]["p50_ms"] > 0
        assert routed["cpu_us_per_message"]["router"] >= 0
        pids = sup.worker_pids()
        assert len(pids) == 5  # 3 spawned + 2 routed sessions
        memory = bench.memory_of(pids)
        assert memory["n"] == 5 and memory["uss_mib_p50"] > 0
        assert memory["minor_faults_p50"] > 0  # a forked worker copies pages
        root, pid = sup.root, sup.proc.pid
    finally:
        sup.close()
    assert not root.exists() and not psutil.pid_exists(pid)
    assert wait_gone(str(root), timeout=5) == []  # workers and zygote went with it


@pytest.fixture(scope="module")
def fanin(bench: ModuleType) -> ModuleType:
    """bench/fanin.py (through `bench`, so that its tests are e2e too)."""
    from bench import fanin

    return fanin


def test_fanin_measures_the_floor_and_the_supervisor(fanin) -> None:
    floor = fanin.floor(2, 20, paced=False)
    assert floor["events"] == 40 and floor["lag_p99_ms"] >= 0
    raw = fanin.hermes(2, 20, paced=False, coalesce_ms=0)
    assert raw["events"] == raw["units"] == 40 and raw["dropped"] == 0
    assert raw["router_cpu_us_per_event"] >= 0 and raw["supervisor_peak_rss_mib"] > 0
    paced = fanin.hermes(2, 5, paced=True, coalesce_ms=10, slow=2000)
    assert paced["units"] == 10 and paced["lag_p50_ms"] is not None


def test_percentiles_are_nearest_rank() -> None:
    # The smallest value with at least p% of them at or below it: never an
    # interpolation, and never a rank rounded down.
    assert pct([5, 1, 4, 2, 3], 50) == 3
    assert pct(list(range(1, 11)), 50) == 5
    assert pct(list(range(1, 201)), 99) == 198
    assert pct(list(range(1, 61)), 99) == 60
    assert pct(list(range(1, 2001)), 90) == 1800
    assert pct([7.0], 1) == pct([7.0], 100) == 7.0


def test_the_idle_bench_counts_the_live_workers_it_measures() -> None:
    """bench/idle.py: the live workers are counted at the moment of
    measurement (not assumed from what was asked), the full supervisor is
    stopped and timed, and nothing is left running."""
    import sys

    from bench.idle import measure

    mine = psutil.Process()
    got = measure(sys.executable, 3, 0.2)
    assert got["live_at_start_of_window"] == 3 and got["live_at_end_of_window"] == 3
    assert got["stop_s"] > 0 and got["full_cpu_pct"] >= 0
    _, alive = psutil.wait_procs(mine.children(recursive=True), timeout=30)
    assert not alive, alive
