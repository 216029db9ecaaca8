"""The HTTP endpoint's figures, each beside a floor in the same run.

    python -m bench.http_bench                  # everything (6 - 10 minutes)
    python -m bench.http_bench --quick          # smaller counts
    python -m bench.http_bench --profile PY_SPY # also sample the servers with py-spy
    python -m bench.http_bench --parts round_trip --ab DIR   # A/B against another version

Run from the repository root. Prints its figures and writes
bench/results/http.json (with --profile, also the collapsed stacks in
bench/results/http-profile-*.txt, for flamegraph.pl). What it measures,
all with the probe runtime:

- round trip (bench/http_latency.py): one turn ("x", echoed) with one
  request in flight, through the Python client over ZeroMQ, through the
  endpoint (non-streaming and streaming `POST /v1/chat/completions`,
  keep-alive httpx), and through the two floors of bench/http_floor.py (an
  echo app, and a bridge app that only calls `AsyncClient.run`),
  interleaved in a random order each round, so that every variant sees
  the same load;
- streams (bench/http_streams.py): N streaming chat completions held at
  once (one session each), each a probe `stream` of W words, checked in
  order; beside the same N turns read through one `AsyncClient`; with the
  endpoint's and the supervisor's memory;
- turns/s (bench/http_latency.py): non-streaming chat completions at
  concurrency 1 and 16, against the echo app (the floor), the bridge app
  and the Python client;
- with `--profile` (bench/http_profile.py), where each server's CPU goes;
- with `--ab DIR`, another version's endpoint (DIR/hermes_sup) served beside
  this one against the same supervisor, its round trips interleaved with
  the others: the paired difference of each request's time and this side's
  share of wins, so that two versions are compared under the same load.

The servers (bench/http_stack.py) are all children of this process,
stopped (by pid) when it ends. The machine is shared: judge by the ratios
to the floors, never by absolute times.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, RESULTS
from bench.http_latency import round_trips, turns_per_second
from bench.http_profile import profile_server
from bench.http_stack import Stack
from bench.http_streams import streams


def report(results: dict[str, Any]) -> None:
    """Print the figures of a run."""
    rt = results.get("round_trip")
    if rt:
        print(f"round trip, one in flight (load {rt['load']['loadavg'][0]:.1f}):")
        for name in rt:
            if name in ("load", "cpu_us_per_request", "ab"):
                continue
            r = rt[name]
            added = f"  +{r['added_p50_ms']:.2f} ms p50" if "added_p50_ms" in r else ""
            paired = f" (paired {r['paired_added_p50_ms']:.2f})" if "added_p50_ms" in r else ""
            print(
                f"  {name:18} p50 {r['p50_ms']:6.2f}  p90 {r['p90_ms']:6.2f}  "
                f"p99 {r['p99_ms']:6.2f} ms{added}{paired}"
            )
        for name, us in rt["cpu_us_per_request"].items():
            print(f"  cpu {name}: {us:.0f} us/request")
        for name, ab in rt.get("ab", {}).items():
            print(
                f"  A/B {name}: this p50 {ab['this_p50_ms']:.2f} ms, B {ab['b_p50_ms']:.2f} ms, "
                f"paired difference p50 {ab['paired_diff_p50_ms']:+.3f} ms, "
                f"this faster in {ab['this_faster_share']:.0%}"
            )
    for server, prof in results.get("profile", {}).items():
        if not prof.get("samples"):
            print(f"profile of {server}: {prof}")
            continue
        print(f"profile of {server} ({prof['samples']} busy samples, {prof['idle_samples']} idle):")
        for name, share in prof["share_pct"].items():
            print(f"  {share:5.1f}%  {name}")
        for leaf, share in list(prof["top_leaves_pct"].items())[:8]:
            print(f"  {share:5.1f}%  leaf {leaf}")
    st = results.get("streams")
    if st:
        parts = [("runs", st["runs"])]
        parts += [(f"{k} {p}", v[p]) for k, v in st.items() if k.startswith("chat_") for p in v]
        for name, s_ in parts:
            print(
                f"streams {name}: {s_['outcomes']} of {s_['streams']}, peak "
                f"{s_['peak_open_at_once']} open at once, {s_['wall_s']:.1f} s "
                f"(load {s_['load']['loadavg'][0]:.1f}), errors {s_['errors']}"
            )
            for proc, m in s_["memory"].items():
                print(
                    f"  {proc}: RSS {m['rss_before_mib']:.0f} -> peak {m['rss_peak_mib']:.0f} "
                    f"-> {m['rss_after_mib']:.0f} MiB, fds peak {m['fds_peak']}"
                )
    for tp in results.get("turns_per_s", []):
        print(f"turns/s at concurrency {tp['concurrency']} (load {tp['load']['loadavg'][0]:.1f}):")
        for name in ("echo_floor", "http", "http_uvloop", "bridge_floor", "zmq"):
            r = tp[name]
            ratio = (
                f"  {r['ratio_to_echo_floor']:.2f}x the echo floor" if name != "echo_floor" else ""
            )
            print(
                f"  {name:12} {r['turns_per_s']:7.0f} turns/s, "
                f"CPU/turn: server {r['server_cpu_us_per_turn']:.0f} us, "
                f"client {r['client_cpu_us_per_turn']:.0f} us{ratio}"
            )


PARTS = ("round_trip", "turns", "streams")


def run_all(
    rounds: int,
    stream_counts: tuple[int, ...],
    words: int,
    turns: int,
    repeats: int,
    profile: str | None,
    concurrencies: tuple[int, ...] = (1, 16),
    parts: tuple[str, ...] = PARTS,
    stream_timeout: float = 120.0,
    ab_source: Path | None = None,
) -> dict[str, Any]:
    """The figures named in `parts`, on one stack; returns the results."""
    stack = Stack(ab_source=ab_source)
    try:
        results: dict[str, Any] = {
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "commit": _commit(),
        }
        if "round_trip" in parts:
            results["round_trip"] = round_trips(stack, rounds)
        if profile:
            turns_ = max(50, rounds // 4)
            results["profile"] = {
                "endpoint": profile_server(
                    stack, profile, stack.endpoint.pid, stack.url, stack.auth, turns_
                ),
                "bridge_floor": profile_server(
                    stack, profile, stack.bridge.pid, stack.bridge_url, {}, turns_
                ),
            }
            if stack.b_endpoint is not None and stack.b_url is not None:
                results["profile"]["endpoint_b"] = profile_server(
                    stack, profile, stack.b_endpoint.pid, stack.b_url, stack.auth, turns_
                )
        if "turns" in parts:
            results["turns_per_s"] = [
                turns_per_second(stack, c, turns, repeats) for c in concurrencies
            ]
        if "streams" in parts and stream_counts:
            results["streams"] = streams(stack, stream_counts, words, timeout=stream_timeout)
        return results
    finally:
        stack.close()


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        )
        return out.stdout.strip()
    except OSError:
        return ""


def main() -> None:
    """Run the parts asked for; print them and write http.json."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.http_bench", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="smaller counts, for a smoke run")
    parser.add_argument("--rounds", type=int, help="round-trip rounds (default 1,000; quick 200)")
    parser.add_argument(
        "--streams", help="SSE streams at once, comma-separated (default 250,1000; quick 100)"
    )
    parser.add_argument(
        "--stream-timeout", type=float, default=120.0, help="seconds, then a stream is unfinished"
    )
    parser.add_argument("--words", type=int, default=20, help="words each stream carries")
    parser.add_argument("--turns", type=int, help="turns per turns/s run (default 500; quick 200)")
    parser.add_argument("--repeats", type=int, default=10, help="turns/s runs of each, alternated")
    parser.add_argument(
        "--parts",
        default=",".join(PARTS),
        help=f"which figures, comma-separated (default {','.join(PARTS)})",
    )
    parser.add_argument(
        "--profile",
        nargs="?",
        const=shutil.which("py-spy") or "py-spy",
        metavar="PY_SPY",
        help="sample the endpoint with py-spy (path to it, if not on PATH)",
    )
    parser.add_argument(
        "--ab",
        type=Path,
        metavar="DIR",
        help="also serve another version's endpoint (DIR/hermes_sup, e.g. from `git archive "
        "COMMIT | tar -x -C DIR/hermes_sup`) against the same supervisor, and pair its round "
        "trips with this one's",
    )
    args = parser.parse_args()
    results = run_all(
        rounds=args.rounds or (200 if args.quick else 1000),
        stream_counts=tuple(
            int(n) for n in (args.streams or ("100" if args.quick else "250,1000")).split(",") if n
        ),
        stream_timeout=args.stream_timeout,
        words=args.words,
        turns=args.turns or (200 if args.quick else 500),
        repeats=args.repeats,
        profile=args.profile,
        parts=tuple(p.strip() for p in args.parts.split(",") if p.strip()),
        ab_source=args.ab,
    )
    report(results)
    RESULTS.mkdir(exist_ok=True)
    for server, prof in results.get("profile", {}).items():  # for flamegraph.pl
        (RESULTS / f"http-profile-{server}.txt").write_text(prof.pop("raw", ""))
    (RESULTS / "http.json").write_text(json.dumps(results, indent=2))
    print(f"wrote {RESULTS / 'http.json'}")


if __name__ == "__main__":
    main()
