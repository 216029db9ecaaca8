"""The HTTP endpoint's benchmark (bench/http_bench.py), run tiny, so that it
cannot rot between the runs that record BENCHMARKS.md. These assert what
each measurement returns (counts, streams in order, structure), never how
fast anything is."""

from __future__ import annotations

import psutil
import pytest

from .conftest import wait_gone

# Starts a real supervisor, its workers, the endpoint and the floor apps.
pytestmark = pytest.mark.e2e


def test_http_bench_measures_every_path_and_leaves_nothing() -> None:
    # The benchmark's modules are imported by the tests that use them: their
    # HTTP clients (aiohttp, httpx) are most of what collecting this module
    # costs, and every run collects it.
    from bench.http_latency import round_trips, turns_per_second
    from bench.http_stack import Stack
    from bench.http_streams import streams

    stack = Stack()
    try:
        rt = round_trips(stack, rounds=5, warmup=2)
        for name in ("zmq", "http", "http_stream", "echo_floor", "bridge_floor", "http_uvloop"):
            assert rt[name]["n"] == 5 and rt[name]["p50_ms"] > 0
        assert set(rt["http"]) >= {"added_p50_ms", "paired_added_p50_ms", "p90_ms", "p99_ms"}
        assert all(us >= 0 for us in rt["cpu_us_per_request"].values())

        tp = turns_per_second(stack, concurrency=2, total=10, repeats=1)
        for name in ("echo_floor", "http", "http_uvloop", "bridge_floor", "zmq"):
            assert tp[name]["turns_per_s"] > 0 and tp[name]["client_cpu_us_per_turn"] >= 0
        assert tp["http"]["ratio_to_echo_floor"] > 0

        st = streams(stack, counts=(4,), words=3, runs=2, timeout=60, gate=0.5)
        # 4 chat streams (a session each), through the endpoint and through
        # the Python client, and 4 runs-events streams (2 runs, 2 watchers).
        for figures in (st["chat_4"]["http"], st["chat_4"]["zmq"], st["runs"]):
            # Every stream carried w0, w1, w2 in order, then its end; none failed.
            assert figures["streams"] == 4 and figures["outcomes"] == {"complete": 4}
            assert figures["failed"] == 0 and figures["errors"] == {}
            assert 1 <= figures["peak_open_at_once"] <= 4
        assert st["runs"]["peak_open_at_once"] == 4  # all connected before the first token
        assert st["runs"]["watchers_per_run"] == 2
        assert st["chat_4"]["http"]["memory"]["endpoint"]["rss_peak_mib"] > 0
        assert st["chat_4"]["http"]["memory"]["supervisor"]["fds_peak"] > 0
        pids = [p.pid for p in stack.procs]
        root = stack.root
    finally:
        stack.close()
    assert not root.exists()
    assert not any(psutil.pid_exists(pid) for pid in pids)
    assert wait_gone(str(root), timeout=5) == []  # workers went with their supervisor


def test_profile_summary_charges_samples_to_the_deepest_known_frame() -> None:
    from bench.http_profile import summarize_profile

    loop = "<module> (httpapi/__main__.py:5);run (httpapi/serve.py:148);_run_once (asyncio/base_events.py:1922)"
    raw = "\n".join(
        [
            f"{loop};run_asgi (uvicorn/protocols/http/httptools_impl.py:422);write (asyncio/selector_events.py:1057) 3",
            f"{loop};chat_completions (httpapi/chat.py:150);send (zmq/sugar/socket.py:713) 1",
            f"{loop};select (selectors.py:468) 10",
        ]
    )
    prof = summarize_profile(raw, turns=2)
    assert prof["samples"] == 4 and prof["idle_samples"] == 10
    assert prof["share_pct"] == {"uvicorn": 75.0, "pyzmq": 25.0}
    assert prof["samples_per_turn"] == 2


def test_a_stream_is_judged_by_order_and_end() -> None:
    from bench.http_streams import verdict

    expected = ["w0", " w1", " w2"]
    assert verdict(expected, expected, ended=True) == "complete"
    assert verdict(["w0 w1", " w2"], expected, ended=True) == "complete"  # merged
    assert verdict(["w0", " w2"], expected, ended=True) == "gaps"
    assert verdict([" w1", "w0"], expected, ended=True) == "out_of_order"
    assert verdict(expected, expected, ended=False) == "unfinished"
