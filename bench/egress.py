"""What a session's egress proxy adds to a request, against the same request
made directly, in the same run.

The proxy (supervisor/proxy.py) runs on this process's asyncio loop as on
the supervisor's, with the default policy plus an allow rule for a small
HTTP server on 127.0.0.1 (on the same loop). A forked client (a child of
ours, as a worker is the supervisor's) hands the proxy a listener, as a
sealed worker does, then alternates, one request at a time, so that the
noise of a shared machine falls on all alike:

    direct    GET straight to the server (a new connection each)
    http      GET in absolute form through the proxy (a new connection each)
    connect   CONNECT through the proxy, then the same GET in the tunnel

Each is the whole request: connect, send, read to the end. The listener
is in the host's namespace here (a worker's is in its own; the proxy's
work is the same). p50 and p90 in ms, and what the proxy adds at p50,
in bench/results/egress.json. Goal: added p50 <= 1 ms on loopback.

    .venv/bin/python -m bench.egress [--requests 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import RESULTS, machine, pct
from hermes_sup.local.addresses import EGRESS_SOCKET
from hermes_sup.supervisor.egress import Policy
from hermes_sup.supervisor.proxy import EgressProxy
from hermes_sup.worker.egress import _send

BODY = b"x" * 512


async def upstream() -> asyncio.Server:
    """A minimal HTTP/1.0 server: one answer per connection."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY))
        await writer.drain()
        writer.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0)


def request(address: tuple[str, int], data: bytes, tunnel: bytes = b"") -> float:
    """Seconds for one whole request (and the answer, to its end)."""
    started = time.perf_counter()
    with socket.create_connection(address) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tunnel:
            s.sendall(tunnel)
            got = s.recv(4096)
            assert got.startswith(b"HTTP/1.1 200"), got
        s.sendall(data)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    took = time.perf_counter() - started
    assert answer.endswith(BODY), answer[:200]
    return took


def client(state: Path, port: int, count: int, w: int) -> None:
    """In the forked child: hand a listener over, then measure."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(512)
    proxy = listener.getsockname()
    assert _send(str(state / EGRESS_SOCKET), listener.fileno()) == b"ok\n"
    listener.close()
    get = b"GET /x HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n"
    absolute = b"GET http://127.0.0.1:%d/x HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n" % port
    connect = b"CONNECT 127.0.0.1:%d HTTP/1.1\r\n\r\n" % port
    times: dict[str, list[float]] = {"direct": [], "http": [], "connect": []}
    for i in range(count + count // 10):
        direct = request(("127.0.0.1", port), get)
        http = request(proxy, absolute)
        tunnelled = request(proxy, get, tunnel=connect)
        if i >= count // 10:  # the first tenth warms up
            times["direct"].append(direct)
            times["http"].append(http)
            times["connect"].append(tunnelled)
    os.write(w, json.dumps(times).encode())


async def measure(count: int) -> dict[str, list[float]]:
    server = await upstream()
    port = server.sockets[0].getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="egress-bench-") as tmp:
        state = Path(tmp)
        policy = Policy.from_lists("egress", [f"127.0.0.1/32:{port}"], [])
        proxy = EgressProxy(state, lambda: policy, lambda pid: "bench")
        proxy.open(asyncio.get_running_loop())
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(r)
                client(state, port, count, w)
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        loop = asyncio.get_running_loop()
        # Read to the end first: more than a pipe's buffer would hold the
        # child in its write, and us in waitpid.
        data = await loop.run_in_executor(None, _read_all, r)
        _, status = await loop.run_in_executor(None, os.waitpid, pid, 0)
        proxy.worker_gone(pid)
        proxy.close()
    server.close()
    if os.waitstatus_to_exitcode(status) != 0 or not data:
        raise SystemExit("the measuring child failed")
    times: dict[str, list[float]] = json.loads(data)
    return times


def _read_all(fd: int) -> bytes:
    data = b""
    while chunk := os.read(fd, 1 << 20):
        data += chunk
    os.close(fd)
    return data


def report(times: dict[str, list[float]]) -> dict[str, Any]:
    ms = {name: [t * 1000 for t in values] for name, values in times.items()}
    out: dict[str, Any] = {
        name: {"p50_ms": round(pct(v, 50), 3), "p90_ms": round(pct(v, 90), 3)}
        for name, v in ms.items()
    }
    floor = pct(ms["direct"], 50)
    for name in ("http", "connect"):
        out[name]["added_p50_ms"] = round(pct(ms[name], 50) - floor, 3)
        out[name]["ratio_p50"] = round(pct(ms[name], 50) / floor, 2)
    out["requests"] = len(ms["direct"])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args(argv)
    result = {"egress": report(asyncio.run(measure(args.requests))), "machine": machine()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "egress.json").write_text(json.dumps(result, indent=2) + "\n")
    json.dump(result["egress"], sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
