"""Round trips and turns a second through the HTTP endpoint, beside floors.

- round trip (`round_trips`): one turn ("x", echoed) with one request in
  flight through every path of the stack, interleaved in a fresh random
  order each round so that every path sees the same load: the Python
  client over ZeroMQ, the endpoint (non-streaming and streaming, httpx
  with keep-alive, and a raw-socket client), the echo and bridge floors,
  the same on uvloop, and with an A/B another version's endpoint;
- turns/s (`turns_per_second`): non-streaming chat completions at one
  concurrency through the endpoint, the floors and the Python client,
  each run `repeats` times in turn.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from bench.common import cpu_seconds, load_now, pct, summary
from bench.http_stack import COMPLETIONS, KEY_HEADER, Stack, chat_body, warm
from hermes_sup.client import AsyncClient

# ---------------------------------------------------------------- round trips


class RawHttp:
    """A keep-alive HTTP/1.1 client in a few lines over one socket, for
    non-streaming requests: what is left of the round trip once the HTTP
    client's own cost (httpx's) is taken out."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.head = f"Host: {host}:{port}\r\nContent-Type: application/json\r\n"
        self.head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.buffer = b""

    def post(self, path: str, body: bytes, headers: dict[str, str]) -> bytes:
        """POST `body` and return the answer's body (200 only)."""
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        request = f"POST {path} HTTP/1.1\r\n{self.head}{extra}Content-Length: {len(body)}\r\n\r\n"
        self.sock.sendall(request.encode() + body)
        while b"\r\n\r\n" not in self.buffer:
            self._read()
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        while len(self.buffer) < length:
            self._read()
        answer, self.buffer = self.buffer[:length], self.buffer[length:]
        if status != 200:
            raise RuntimeError(f"{status}: {answer[:200]!r}")
        return answer

    def _read(self) -> None:
        piece = self.sock.recv(65536)
        if not piece:
            raise ConnectionError("the server closed the connection")
        self.buffer += piece

    def close(self) -> None:
        """Close the connection."""
        self.sock.close()


def round_trips(stack: Stack, rounds: int, warmup: int = 30) -> dict[str, Any]:
    """One turn at a time through each path, interleaved: each round runs
    every variant once, in a fresh random order."""
    zmq_client = stack.client()
    endpoint = httpx.Client(base_url=stack.url, headers=stack.auth, timeout=120)
    echo = httpx.Client(base_url=stack.echo_url, timeout=120)
    bridge = httpx.Client(base_url=stack.bridge_url, timeout=120)
    uv_endpoint = httpx.Client(base_url=stack.uv_url, headers=stack.auth, timeout=120)
    uv_echo = httpx.Client(base_url=stack.uv_echo_url, timeout=120)
    uv_bridge = httpx.Client(base_url=stack.uv_bridge_url, timeout=120)

    def post(client: httpx.Client, key: str) -> Callable[[], None]:
        def call() -> None:
            r = client.post(COMPLETIONS, json=chat_body("x"), headers={KEY_HEADER: key})
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "x"

        return call

    def stream(client: httpx.Client, key: str) -> Callable[[], None]:
        def call() -> None:
            with client.stream(
                "POST", COMPLETIONS, json=chat_body("x", True), headers={KEY_HEADER: key}
            ) as r:
                assert r.status_code == 200
                lines = [line for line in r.iter_lines() if line]
            assert lines[-1] == "data: [DONE]", lines

        return call

    raw_endpoint = RawHttp(stack.url, stack.auth)
    raw_echo = RawHttp(stack.echo_url, {})
    raw_uv_endpoint = RawHttp(stack.uv_url, stack.auth)
    body = json.dumps(chat_body("x")).encode()

    def raw(client: RawHttp, key: str) -> Callable[[], None]:
        def call() -> None:
            answer = json.loads(client.post(COMPLETIONS, body, {KEY_HEADER: key}))
            assert answer["choices"][0]["message"]["content"] == "x"

        return call

    def zmq_turn() -> None:
        assert zmq_client.run("rt-zmq", "x").text == "x"

    b_endpoint = None
    if stack.b_url is not None:
        b_endpoint = httpx.Client(base_url=stack.b_url, headers=stack.auth, timeout=120)
    variants: dict[str, Callable[[], None]] = {
        "zmq": zmq_turn,
        "http": post(endpoint, "rt-http"),
        "http_stream": stream(endpoint, "rt-stream"),
        "echo_floor": post(echo, "rt-echo"),
        "echo_floor_stream": stream(echo, "rt-echo"),
        "bridge_floor": post(bridge, "rt-bridge"),
        "http_raw_client": raw(raw_endpoint, "rt-raw"),
        "echo_floor_raw_client": raw(raw_echo, "rt-echo"),
        "http_uvloop": post(uv_endpoint, "rt-uv-http"),
        "http_uvloop_stream": stream(uv_endpoint, "rt-uv-stream"),
        "http_uvloop_raw_client": raw(raw_uv_endpoint, "rt-uv-raw"),
        "echo_floor_uvloop": post(uv_echo, "rt-echo"),
        "bridge_floor_uvloop": post(uv_bridge, "rt-uv-bridge"),
    }
    raw_b = RawHttp(stack.b_url, stack.auth) if stack.b_url is not None else None
    if b_endpoint is not None and raw_b is not None:
        # The same three kinds of request as this endpoint's, for a CPU
        # figure to set beside its own.
        variants["http_b"] = post(b_endpoint, "rt-http-b")
        variants["http_b_stream"] = stream(b_endpoint, "rt-stream-b")
        variants["http_b_raw_client"] = raw(raw_b, "rt-raw-b")
    times: dict[str, list[float]] = {name: [] for name in variants}
    servers = {"endpoint": stack.endpoint.pid, "supervisor": stack.sup.proc.pid}
    servers |= {"echo": stack.echo.pid, "bridge": stack.bridge.pid}
    servers |= {"uv_endpoint": stack.uv_endpoint.pid, "uv_echo": stack.uv_echo.pid}
    servers |= {"uv_bridge": stack.uv_bridge.pid}
    if stack.b_endpoint is not None:
        servers["endpoint_b"] = stack.b_endpoint.pid
    rng = random.Random(17)
    order = list(variants)
    try:
        for i in range(warmup + rounds):
            if i == warmup:
                cpu_before = {name: cpu_seconds([pid]) for name, pid in servers.items()}
                load = load_now()
            rng.shuffle(order)
            for name in order:
                started = time.perf_counter()
                variants[name]()
                if i >= warmup:
                    times[name].append(time.perf_counter() - started)
        cpu = {name: cpu_seconds([pid]) - cpu_before[name] for name, pid in servers.items()}
    finally:
        for c in (endpoint, echo, bridge, uv_endpoint, uv_echo, uv_bridge, b_endpoint):
            if c is not None:
                c.close()
        for r in (raw_endpoint, raw_echo, raw_uv_endpoint, raw_b):
            if r is not None:
                r.close()
        zmq_client.close()
    out: dict[str, Any] = {"load": load, **{name: summary(t) for name, t in times.items()}}
    zmq_p50 = out["zmq"]["p50_ms"]
    # Per round, the same turn's time through HTTP minus through zmq.
    added = [name for name in variants if name.startswith(("http", "bridge"))]
    for name in added:
        out[name]["added_p50_ms"] = out[name]["p50_ms"] - zmq_p50
        paired = [a - b for a, b in zip(times[name], times["zmq"], strict=True)]
        out[name]["paired_added_p50_ms"] = pct(paired, 50) * 1000
    # CPU each server spent per request it served in the measured rounds.
    out["cpu_us_per_request"] = {
        "endpoint (http, http_stream, http_raw_client)": cpu["endpoint"] / (3 * rounds) * 1e6,
        "echo floor (echo, echo stream, echo raw)": cpu["echo"] / (3 * rounds) * 1e6,
        "bridge floor": cpu["bridge"] / rounds * 1e6,
        "endpoint on uvloop (3 requests a round)": cpu["uv_endpoint"] / (3 * rounds) * 1e6,
        "echo floor on uvloop": cpu["uv_echo"] / rounds * 1e6,
        "bridge floor on uvloop": cpu["uv_bridge"] / rounds * 1e6,
        "supervisor (the 9 turns of a round)": cpu["supervisor"] / (9 * rounds) * 1e6,
    }
    if "http_b" in times:
        # This endpoint against B's, request by request in the same round.
        out["ab"] = {}
        pairs = (("http", "http_b"), ("http_stream", "http_b_stream"))
        for mine, theirs in (*pairs, ("http_raw_client", "http_b_raw_client")):
            diffs = [a - b for a, b in zip(times[mine], times[theirs], strict=True)]
            out["ab"][mine] = {
                "this_p50_ms": out[mine]["p50_ms"],
                "b_p50_ms": out[theirs]["p50_ms"],
                "paired_diff_p50_ms": pct(diffs, 50) * 1000,
                "this_faster_share": sum(d < 0 for d in diffs) / len(diffs),
            }
        out["cpu_us_per_request"]["endpoint B (http_b, http_b_stream, http_b_raw_client)"] = (
            cpu["endpoint_b"] / (3 * rounds) * 1e6
        )
    return out


# ---------------------------------------------------------------- turns/s


async def _turns_http(
    url: str, headers: dict[str, str], keys: list[str], total: int
) -> tuple[float, int]:
    """`total` non-streaming turns, one session per task; (seconds, done)."""
    left = [total]
    connector = aiohttp.TCPConnector(limit=len(keys) + 2)
    async with aiohttp.ClientSession(url, headers=headers, connector=connector) as http:

        async def worker(key: str) -> int:
            n = 0
            while left[0] > 0:
                left[0] -= 1
                async with http.post(
                    COMPLETIONS, json=chat_body("x"), headers={KEY_HEADER: key}
                ) as r:
                    body = await r.json()
                    assert r.status == 200 and body["choices"][0]["message"]["content"] == "x"
                n += 1
            return n

        started = time.perf_counter()
        done = await asyncio.gather(*(worker(k) for k in keys))
        return time.perf_counter() - started, sum(done)


async def _turns_zmq(state_dir: Path, keys: list[str], total: int) -> tuple[float, int]:
    left = [total]
    async with AsyncClient(state_dir, timeout=120) as client:

        async def worker(key: str) -> int:
            n = 0
            while left[0] > 0:
                left[0] -= 1
                assert (await client.run(key, "x")).text == "x"
                n += 1
            return n

        started = time.perf_counter()
        done = await asyncio.gather(*(worker(k) for k in keys))
        return time.perf_counter() - started, sum(done)


def turns_per_second(stack: Stack, concurrency: int, total: int, repeats: int) -> dict[str, Any]:
    """Turns/s at `concurrency` through the endpoint, the echo floor, the
    bridge floor and the Python client (AsyncClient), each run `repeats`
    times in turn; the median of each, and the CPU per turn of each server."""
    keys = [f"tp{concurrency}-{i}" for i in range(concurrency)]
    for url, headers in ((stack.url, stack.auth), (stack.bridge_url, {})):
        asyncio.run(warm(url, headers, keys, concurrency))
    runs: dict[str, Callable[[], tuple[float, int]]] = {
        "echo_floor": lambda: asyncio.run(_turns_http(stack.echo_url, {}, keys, total)),
        "http": lambda: asyncio.run(_turns_http(stack.url, stack.auth, keys, total)),
        "http_uvloop": lambda: asyncio.run(_turns_http(stack.uv_url, stack.auth, keys, total)),
        "bridge_floor": lambda: asyncio.run(_turns_http(stack.bridge_url, {}, keys, total)),
        "zmq": lambda: asyncio.run(_turns_zmq(stack.state, keys, total)),
    }
    server = {"echo_floor": stack.echo.pid, "http": stack.endpoint.pid}
    server |= {"http_uvloop": stack.uv_endpoint.pid}
    server |= {"bridge_floor": stack.bridge.pid}
    rates: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    client_cpu: dict[str, list[float]] = {name: [] for name in runs}
    load = load_now()
    for _ in range(repeats):
        for name, run in runs.items():
            pids = [stack.sup.proc.pid] + ([server[name]] if name in server else [])
            before = [cpu_seconds([p]) for p in pids]
            mine = time.process_time()
            seconds, done = run()
            mine = time.process_time() - mine
            spent = [cpu_seconds([p]) - b for p, b in zip(pids, before, strict=True)]
            rates[name].append(done / seconds)
            cpu[name].append(sum(spent) / done * 1e6)
            client_cpu[name].append(mine / done * 1e6)
    out: dict[str, Any] = {"load": load, "concurrency": concurrency, "turns": total}
    for name in runs:
        out[name] = {
            "turns_per_s": statistics.median(rates[name]),
            "all_turns_per_s": rates[name],
            "server_cpu_us_per_turn": statistics.median(cpu[name]),
            "client_cpu_us_per_turn": statistics.median(client_cpu[name]),
        }
    # The load here moves within seconds: each repeat's rate is divided by
    # the floor's from the same repeat, and the median of those is the ratio.
    floor = rates["echo_floor"]
    for name in ("http", "http_uvloop", "bridge_floor", "zmq"):
        out[name]["ratio_to_echo_floor"] = statistics.median(
            r / f for r, f in zip(rates[name], floor, strict=True)
        )
    out["http"]["ratio_to_zmq"] = statistics.median(
        r / z for r, z in zip(rates["http"], rates["zmq"], strict=True)
    )
    return out
