"""Event fan-in: many sessions streaming at once, through one supervisor.

    python -m bench.fanin                        # 64 and 512 sessions, raw and paced
    python -m bench.fanin --sessions 64 --quick  # a smoke run

For each count of sessions, every session runs one streaming turn at the
same time and one reader takes every event:

- raw: each session's worker streams as fast as it can (`sh seq 1 M`, one
  `output` event a line), with coalescing off and on;
- paced: each session streams tokens at 50 a second (the probe's `stream`),
  coalescing on: what a service of that many conversations looks like.

Measured: events delivered a second (and lines or tokens: a coalesced event
carries several), the supervisor's CPU time per event, the lag from the
worker's emit (an event's `ts`; a merged event's is its first delta's) to
the reader's receipt, p50 and p99, and the supervisor's peak RSS. With
`--slow`, one more client starts a flood and never reads: the supervisor's
peak RSS then, against the same run without it.

The floor, in the same run: a bare ROUTER-to-ROUTER proxy in a few lines of
pyzmq forwarding the same number of streams' messages (each a small msgpack
map with a timestamp) from a few streamer processes, each holding one
socket per stream, to one reader. Readers on both sides unpack each
message's msgpack and nothing more (no signature check), so the difference
is the path in between. Writes bench/results/fanin.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import zmq

from bench.common import RESULTS, MemorySampler, ProxyFloor, Sup, cpu_seconds, pct
from hermes_sup.local import statedir
from hermes_sup.protocol import Kind, Message, encode

TOKENS_PER_S = 50  # the probe's `stream` pace (STREAM_DELAY)


# ------------------------------------------------------------------ the floor

# One process of the floor's streams: a DEALER per stream, each told `go`
# by the reader, then all of them sending in turn (raw: as fast as zmq
# takes them; paced: one each every 1/rate seconds), then `end`.
STREAMER = r"""
import sys, time, msgpack, zmq
endpoint, first, count, events, rate = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
ctx = zmq.Context()
socks = []
for i in range(first, first + count):
    s = ctx.socket(zmq.DEALER); s.setsockopt(zmq.ROUTING_ID, f"s{i}".encode()); s.connect(endpoint)
    s.send_multipart([b"", b"ready"])
    socks.append(s)
clients = [s.recv_multipart()[0] for s in socks]  # each one's `go`
pack = msgpack.packb
started = time.monotonic()
for n in range(events):
    if rate:
        time.sleep(max(0.0, started + n / rate - time.monotonic()))
    for s, c in zip(socks, clients):
        s.send_multipart([c, pack({"ts": time.time(), "kind": "event", "body": {"type": "output", "data": str(n)}})])
for s, c in zip(socks, clients):
    s.send_multipart([c, pack({"ts": time.time(), "kind": "reply", "body": {}})])
time.sleep(1)
"""


def floor(sessions: int, events: int, paced: bool) -> dict[str, Any]:
    """The same fan-in through a bare proxy (see the module docstring)."""
    # Room for every stream's burst at once: zmq's default high-water mark is 1,000.
    proxy = ProxyFloor("hsf-", hwm=100_000)
    reader = proxy.client
    reader.setsockopt(zmq.RCVHWM, 0)
    try:
        time.sleep(0.3)
        per = max(1, -(-sessions // 8))  # at most 8 streamer processes
        rate = TOKENS_PER_S if paced else 0
        for first in range(0, sessions, per):
            count = min(per, sessions - first)
            proxy.start(STREAMER, proxy.back, str(first), str(count), str(events), str(rate))
        reader.connect(proxy.front)
        time.sleep(1.0 + sessions * 0.004)  # the streams connect and say ready
        usage = Usage([proxy.procs[0].pid], [p.pid for p in proxy.procs[1:]])
        for i in range(sessions):
            reader.send_multipart([f"s{i}".encode(), b"go"])
        return usage.finish(read(reader, sessions, lambda frames: frames[1]), sessions)
    finally:
        proxy.close()


# --------------------------------------------------------------- hermes-sup


def hermes(
    sessions: int, events: int, paced: bool, coalesce_ms: float, slow: int = 0
) -> dict[str, Any]:
    """N sessions of one supervisor streaming at once (see the module docstring)."""
    tmp = Path(tempfile.mkdtemp(prefix="hsc-", dir="/tmp"))
    config = tmp / "hs.toml"
    # A reader of 512 streams may fall behind a burst: a queue large enough
    # that nothing is dropped, so every figure counts every event; but the
    # default queue when a client that never reads is what is measured.
    queue = "" if slow else "client_queue = 1000000\n"
    config.write_text(f"stream_coalesce_ms = {coalesce_ms}\n{queue}")
    sup = Sup("--config", str(config))
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    socks: list[zmq.Socket[bytes]] = []
    try:
        keys = [f"f{i}" for i in range(sessions)]
        with sup.client() as c:
            for k in keys:
                c.open(k)
            pids = [r["pid"] for r in c.sessions() if r["pid"]]
        key = statedir.read_key(sup.state)
        endpoint = statedir.endpoint(sup.state, statedir.CONTROL_SOCKET)
        reader = _dealer(ctx, endpoint, socks)
        if slow:  # a flood of `slow` lines for a client that never reads
            sleeper = _dealer(ctx, endpoint, socks)
            sleeper.setsockopt(zmq.RCVHWM, 1)
            flood = Message(Kind.SEND, {"text": f"sh seq 1 {slow}"}, session="slow")
            sleeper.send_multipart(encode(flood, key))
        if paced:
            text = "stream " + " ".join(["w"] * events)
        else:
            text = f"sh seq 1 {events}"
        usage = Usage([sup.proc.pid], pids)
        for k in keys:
            reader.send_multipart(encode(Message(Kind.SEND, {"text": text}, session=k), key))
        peak = MemorySampler({"supervisor": sup.proc.pid}, every=0.05, fds=False)
        got = read(reader, sessions, lambda frames: frames[2], skip_status=True)
        out = usage.finish(got, sessions)
        out["supervisor_peak_rss_mib"] = peak.stop()["supervisor"]["rss_peak_mib"]
        return out
    finally:
        for s in socks:
            s.close(0)
        ctx.term()
        sup.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _dealer(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, socks: list[zmq.Socket[bytes]]
) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(endpoint)
    socks.append(sock)
    return sock


# ------------------------------------------------------------------- reading


def read(
    sock: zmq.Socket[bytes],
    finals: int,
    payload_of: Callable[[list[bytes]], bytes],
    skip_status: bool = False,
) -> dict[str, Any]:
    """Read until `finals` final answers came: events, the lines or tokens
    they carry, and each event's lag from its `ts`."""
    lags: list[float] = []
    events = units = dropped = 0
    ended = 0
    first = last = 0.0
    unpack = msgpack.unpackb
    while ended < finals:
        if not sock.poll(120_000):
            raise RuntimeError(f"stalled: {ended} of {finals} streams ended, {events} events")
        frames = sock.recv_multipart()
        now = time.time()
        envelope = unpack(payload_of(frames))
        if envelope["kind"] != "event":
            ended += 1
            last = time.perf_counter()
            continue
        body = envelope["body"]
        if skip_status and body.get("type") == "status":
            continue
        if body.get("type") == "dropped":  # this reader fell behind (slow_consumer)
            dropped += body["data"]["count"]
            continue
        if not first:
            first = time.perf_counter()
        events += 1
        data = body.get("data")
        if isinstance(data, str):
            units += data.count("\n") + 1 if body["type"] == "output" else len(data.split())
        lags.append(now - envelope["ts"])
        last = time.perf_counter()
    seconds = max(1e-9, last - first)
    return {"events": events, "units": units, "dropped": dropped, "lags": lags, "seconds": seconds}


class Usage:
    """CPU time of the router (supervisor or proxy) and the streams."""

    def __init__(self, router: list[int], streams: list[int]) -> None:
        self.router, self.streams = router, streams
        self.before = (cpu_seconds(router), cpu_seconds(streams))

    def finish(self, got: dict[str, Any], sessions: int) -> dict[str, Any]:
        """The figures of what `read` got, with the CPU spent since the start."""
        router = cpu_seconds(self.router) - self.before[0]
        streams = cpu_seconds(self.streams) - self.before[1]
        events, lags = got["events"], got["lags"]
        return {
            "sessions": sessions,
            "events": events,
            "units": got["units"],
            "dropped": got["dropped"],
            "events_per_s": events / got["seconds"],
            "units_per_s": got["units"] / got["seconds"],
            "router_cpu_us_per_event": router / max(1, events) * 1e6,
            "streams_cpu_us_per_event": streams / max(1, events) * 1e6,
            "lag_p50_ms": pct(lags, 50) * 1000 if lags else None,
            "lag_p99_ms": pct(lags, 99) * 1000 if lags else None,
        }


# ---------------------------------------------------------------------- main


def fanin(sessions: int, raw_total: int, paced_seconds: float, slow: int) -> dict[str, Any]:
    """Every figure for one count of sessions."""
    per_session = max(20, raw_total // sessions)
    tokens = max(5, int(paced_seconds * TOKENS_PER_S))
    out: dict[str, Any] = {"sessions": sessions, "raw_events_per_session": per_session}
    out["floor_raw"] = floor(sessions, per_session, paced=False)
    out["raw_off"] = hermes(sessions, per_session, paced=False, coalesce_ms=0)
    out["raw_on"] = hermes(sessions, per_session, paced=False, coalesce_ms=10)
    out["floor_paced"] = floor(sessions, tokens, paced=True)
    out["paced_on"] = hermes(sessions, tokens, paced=True, coalesce_ms=10)
    if slow:
        out["paced_on_slow_consumer"] = hermes(sessions, tokens, True, 10, slow=slow)
    return out


def print_rows(result: dict[str, Any]) -> None:
    """One count of sessions' figures as a table."""
    n = result["sessions"]
    print(f"\n{n} sessions (raw: {result['raw_events_per_session']} lines each)")
    print(
        f"{'':28} {'events/s':>9} {'units/s':>9} {'router us/ev':>12} "
        f"{'lag p50':>8} {'lag p99':>8} {'peak RSS':>9}"
    )
    for name, row in result.items():
        if not isinstance(row, dict):
            continue
        rss = row.get("supervisor_peak_rss_mib")
        print(
            f"{name:28} {row['events_per_s']:9.0f} {row['units_per_s']:9.0f} "
            f"{row['router_cpu_us_per_event']:12.1f} {row['lag_p50_ms'] or 0:7.1f}ms "
            f"{row['lag_p99_ms'] or 0:7.1f}ms {'' if rss is None else f'{rss:7.1f}MiB':>9}"
        )


def main() -> int:
    """Measure each count of sessions; print and write fanin.json."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--raw-total", type=int, default=64_000, help="raw lines, all sessions")
    parser.add_argument("--paced-seconds", type=float, default=5.0)
    parser.add_argument(
        "--slow",
        type=int,
        default=0,
        metavar="LINES",
        help="also with a client that starts a flood of LINES and never reads",
    )
    parser.add_argument("--quick", action="store_true", help="tiny counts, for a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.raw_total, args.paced_seconds = 2000, 0.5
    results = []
    for n in args.sessions:
        result = fanin(n, args.raw_total, args.paced_seconds, args.slow)
        print_rows(result)
        results.append(result)
    RESULTS.mkdir(exist_ok=True)
    meta = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count()}
    (RESULTS / "fanin.json").write_text(json.dumps({"meta": meta, "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
