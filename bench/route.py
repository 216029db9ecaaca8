"""A routed turn against a direct one, in the same run (issue 20).

One supervisor (probe runtime, --tcp) and one router in front of it
(`hermes-sup route` with that node). Three ways to the same warm session,
alternating one turn at a time so the noise of a shared machine falls on
all alike:

    direct-ipc   the Python client on the supervisor's own ipc socket
    direct-tcp   the client over TCP + CURVE (a connection file)
    routed       the client on the router's ipc socket; the router forwards
                 over TCP + CURVE
    proxy        the floor: a bare zmq.proxy (C, its own process) from an ipc
                 socket to the node over TCP + CURVE, the client signing
                 with the node's key (no checks, no routing by key)

The router's cost is routed - direct-tcp; routed - proxy is what its
Python costs over the bare hop (the same transport to the node
plus one hop); routed - direct-ipc is what a local front end pays for
going through a router. p50 and p90 in ms; results in
bench/results/route.json.

    .venv/bin/python bench/route.py [--turns 2000]

With --failover N: two nodes on one shared data directory behind a
router, N sessions spread over them by key (each with one turn done);
node b is SIGKILLed, and every one of its sessions is sent a turn at once
through the router (asyncio client): the time from the kill to each
answer (the router's node_lost detection, a lease taken, a worker
started), p50 and the last, in bench/results/route_failover.json.

With --scale N: for 1, 2 and 3 nodes (--scale-nodes) behind one router,
each node on its own data directory, N new sessions per node are started
through the router (asyncio client, --in-flight at a time; each new key's
first turn is its spawn), then every session held is sent one turn. Spawns
a second and turns a second over all nodes and per node, spawn p50/p99,
and each node's sessions, RSS and fds, in bench/results/route_scale.json.
The simulated nodes share this machine's CPUs: the per-node figures with
more nodes are what a node gets of a shared machine, not of its own.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hermes_sup.client import Client, NotRunning, SupervisorError, Timeout
from hermes_sup.client.connection import Connection


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def hs(*args: str, **kw: object) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", *args], **kw)  # type: ignore[call-overload]


def wait_ping(make: object, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with make() as c:  # type: ignore[operator]
                c.ping()
                return
        except (NotRunning, Timeout):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def proxy_main(front: str, conn_file: str) -> None:
    """The floor's process: zmq.proxy between an ipc ROUTER and the node."""
    import zmq

    from hermes_sup.client.connection import Connection

    conn = Connection.from_file(conn_file)
    assert conn.curve is not None
    ctx = zmq.Context()
    # DEALER to DEALER: no routing frames to strip, for the one bench client.
    router = ctx.socket(zmq.DEALER)
    router.bind(front)
    dealer = ctx.socket(zmq.DEALER)
    dealer.curve_serverkey = conn.curve.server_public.encode()
    dealer.curve_publickey = conn.curve.public.encode()
    dealer.curve_secretkey = conn.curve.secret.encode()
    dealer.connect(conn.endpoint)
    zmq.proxy(router, dealer)


def start_cluster(
    root: Path, names: list[str], shared: bool, log: object
) -> dict[str, subprocess.Popen[bytes]]:
    """One supervisor per name (probe runtime, --tcp, `node = name`), on one
    shared data directory or each on its own, and a router in front of them
    (state directory root/r), once every node answers through it."""
    procs: dict[str, subprocess.Popen[bytes]] = {}
    lines = []
    for name in names:
        port = free_port()
        data = root / ("d" if shared else f"d{name}")
        (root / f"{name}.toml").write_text(f'node = "{name}"\n')
        procs[name] = hs(
            "hermes_sup.cli", "--state-dir", str(root / f"s{name}"), "serve", "--data-dir",
            str(data), "--tcp", str(port), "--config", str(root / f"{name}.toml"),
            "--log-level", "warning", stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        wait_ping(lambda n=name: Client(root / f"s{n}", timeout=2.0))  # type: ignore[misc]
        subprocess.run(
            [sys.executable, "-m", "hermes_sup.cli", "keys", "generate", f"router-{name}",
             "--endpoint", f"127.0.0.1:{port}", "-o", str(root / f"{name}.json"),
             "--data-dir", str(data)], check=True, capture_output=True,
        )  # fmt: skip
        lines.append(f'[[node]]\nname = "{name}"\nconnection = "{root / f"{name}.json"}"\n')
    (root / "nodes.toml").write_text("\n".join(lines))
    procs["router"] = hs(
        "hermes_sup.cli.route", "--nodes", str(root / "nodes.toml"), "--state-dir",
        str(root / "r"), "--poll", "0.2", "--log-level", "WARNING", stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    wait_ping(lambda: Client(root / "r", timeout=2.0))
    deadline = time.monotonic() + 60
    while True:
        with Client(root / "r", timeout=10.0) as c:
            nodes = c.status()["nodes"]
        if len(nodes) == len(names) and all(n["answered"] for n in nodes):
            return procs
        if time.monotonic() > deadline:
            raise RuntimeError(f"nodes not all live through the router: {nodes}")
        time.sleep(0.1)


def stop_all(procs: dict[str, subprocess.Popen[bytes]]) -> None:
    """SIGTERM each process (the router first), SIGKILL one that lingers."""
    for proc in reversed(list(procs.values())):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def scale(per_node: int, counts: list[int], in_flight: int, out: Path) -> None:
    """Spawns and turns a second, and what each node holds, with 1, 2, 3 nodes."""
    import asyncio

    results = []
    for count in counts:
        root = Path(tempfile.mkdtemp(prefix="hss-", dir="/tmp"))
        log = open(root / "log", "ab")  # noqa: SIM115
        procs: dict[str, subprocess.Popen[bytes]] = {}
        names = [chr(ord("a") + i) for i in range(count)]
        try:
            procs = start_cluster(root, names, False, log)
            keys = [f"sc:{i}" for i in range(per_node * count)]

            result = asyncio.run(measure_scale(root / "r", keys, count, in_flight))
            print(json.dumps(result), flush=True)
            results.append(result)
        finally:
            stop_all(procs)
            log.close()
            shutil.rmtree(root, ignore_errors=True)
    summary = {"per_node": per_node, "in_flight": in_flight, "runs": results}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")


async def measure_scale(
    router: Path, keys: list[str], count: int, in_flight: int
) -> dict[str, object]:
    """New sessions through the router, then one turn to each held session."""
    import asyncio

    from hermes_sup.client import AsyncClient

    async with AsyncClient(router, timeout=120.0) as c:
        gate = asyncio.Semaphore(in_flight)

        async def timed(key: str, text: str) -> float:
            async with gate:
                begin = time.perf_counter()
                reply = await c.run(key, text)
                assert reply.ok, reply
                return (time.perf_counter() - begin) * 1000

        begin = time.perf_counter()
        spawns = await asyncio.gather(*(timed(k, "hello") for k in keys))
        spawn_wall = time.perf_counter() - begin
        begin = time.perf_counter()
        turns = await asyncio.gather(*(timed(k, "hello") for k in keys))
        turn_wall = time.perf_counter() - begin
        status = await c.status()
    return {
        "nodes": count,
        "sessions": len(keys),
        "spawns_per_s": round(len(keys) / spawn_wall, 1),
        "spawns_per_s_per_node": round(len(keys) / spawn_wall / count, 1),
        "spawn_p50_ms": round(statistics.median(spawns), 1),
        "spawn_p99_ms": round(pct(spawns, 0.99), 1),
        "turns_per_s": round(len(keys) / turn_wall, 1),
        "turns_per_s_per_node": round(len(keys) / turn_wall / count, 1),
        "turn_p50_ms": round(statistics.median(turns), 2),
        "held": {
            n["name"]: {
                "sessions": n["status"]["node"]["sessions"],
                "rss_mib": round(n["status"]["rss"] / 2**20, 1),
                "fds": n["status"]["fds"],
            }
            for n in status["nodes"]
            if n["answered"]
        },
    }


def failover(sessions: int, out: Path) -> None:
    """Time from a node's SIGKILL to each of its keys answered again."""
    import asyncio
    import os

    from hermes_sup.client import AsyncClient
    from hermes_sup.cluster.placement import Candidate, rendezvous

    root = Path(tempfile.mkdtemp(prefix="hsf-", dir="/tmp"))
    procs: dict[str, subprocess.Popen[bytes]] = {}
    log = open(root / "log", "ab")  # noqa: SIM115
    try:
        procs = start_cluster(root, ["a", "b"], True, log)
        keys = [f"fo:{i}" for i in range(sessions)]
        on_b = [k for k in keys if rendezvous(k, [Candidate("a"), Candidate("b")]) == "b"]

        retries: dict[str, int] = {}
        floor: list[float] = []

        async def run() -> list[float]:
            async with AsyncClient(root / "r", timeout=120.0) as c:
                await asyncio.gather(*(c.run(k, "hello") for k in keys))
                # The floor: as many new sessions started at once on node a.
                fresh = [
                    k
                    for k in (f"floor:{i}" for i in range(20 * sessions))
                    if rendezvous(k, [Candidate("a"), Candidate("b")]) == "a"
                ][: len(on_b)]
                begin = time.perf_counter()

                async def timed(key: str) -> float:
                    await c.run(key, "hello")
                    return (time.perf_counter() - begin) * 1000

                floor[:] = await asyncio.gather(*(timed(k) for k in fresh))
                os.kill(procs["b"].pid, signal.SIGKILL)
                start = time.perf_counter()

                async def again(key: str) -> float:
                    while True:
                        try:
                            await c.run(key, "hello")
                            return (time.perf_counter() - start) * 1000
                        except SupervisorError as exc:  # node_lost while the router learns
                            retries[exc.code] = retries.get(exc.code, 0) + 1
                            await asyncio.sleep(0.01)

                return list(await asyncio.gather(*(again(k) for k in on_b)))

        times = asyncio.run(run())
        result = {
            "sessions": sessions,
            "moved": len(on_b),
            "p50_ms": round(statistics.median(times), 1),
            "last_ms": round(max(times), 1),
            "errors_before_served": retries,
            "floor_new_sessions_at_once_p50_ms": round(statistics.median(floor), 1),
            "floor_last_ms": round(max(floor), 1),
        }
        print(json.dumps(result, indent=2))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    finally:
        stop_all(procs)
        log.close()
        shutil.rmtree(root, ignore_errors=True)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=2000)
    parser.add_argument("--proxy", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--failover", type=int, default=0, metavar="N")
    parser.add_argument("--scale", type=int, default=0, metavar="N", help="sessions per node")
    parser.add_argument("--scale-nodes", default="1,2,3", help="node counts for --scale")
    parser.add_argument("--in-flight", type=int, default=32, help="requests at once (--scale)")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "route.json"
    )
    args = parser.parse_args()
    if args.proxy:
        proxy_main(*args.proxy)
        return
    if args.scale:
        counts = [int(n) for n in args.scale_nodes.split(",")]
        scale(args.scale, counts, args.in_flight, args.out.with_name("route_scale.json"))
        return
    if args.failover:
        failover(args.failover, args.out.with_name("route_failover.json"))
        return

    root = Path(tempfile.mkdtemp(prefix="hsr-", dir="/tmp"))
    procs: list[subprocess.Popen[bytes]] = []
    log = open(root / "log", "ab")  # noqa: SIM115
    try:
        port = free_port()
        (root / "node.toml").write_text('node = "a"\n')
        procs.append(
            hs(
                "hermes_sup.cli",
                "--state-dir",
                str(root / "s"),
                "serve",
                "--data-dir",
                str(root / "d"),
                "--tcp",
                str(port),
                "--config",
                str(root / "node.toml"),
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        )
        wait_ping(lambda: Client(root / "s", timeout=2.0))
        for name in ("router", "bench", "proxy"):
            subprocess.run(
                [sys.executable, "-m", "hermes_sup.cli", "keys", "generate", name, "--endpoint",
                 f"127.0.0.1:{port}", "-o", str(root / f"{name}.json"), "--data-dir",
                 str(root / "d")], check=True, capture_output=True,
            )  # fmt: skip
        (root / "nodes.toml").write_text(
            f'[[node]]\nname = "a"\nconnection = "{root / "router.json"}"\n'
        )
        procs.append(
            hs(
                "hermes_sup.cli.route",
                "--nodes",
                str(root / "nodes.toml"),
                "--state-dir",
                str(root / "r"),
                "--log-level",
                "WARNING",
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        )
        wait_ping(lambda: Client(root / "r", timeout=2.0))
        front = f"ipc://{root / 'proxy.sock'}"
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, "--proxy", front, str(root / "proxy.json")],
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        )
        node_key = Connection.from_file(root / "proxy.json").key
        proxied = Connection(front, node_key)
        wait_ping(lambda: Client(connection=proxied, timeout=2.0))
        clients = {
            "direct-ipc": Client(root / "s", timeout=30.0),
            "direct-tcp": Client.from_connection_file(root / "bench.json", timeout=30.0),
            "routed": Client(root / "r", timeout=30.0),
            "proxy": Client(connection=proxied, timeout=30.0),
        }
        key = "bench:route"
        times: dict[str, list[float]] = {name: [] for name in clients}
        for c in clients.values():  # warm: the worker, the sockets, the CURVE handshakes
            for _ in range(50):
                c.run(key, "hello")
        for _ in range(args.turns):
            for name, c in clients.items():
                start = time.perf_counter()
                c.run(key, "hello")
                times[name].append((time.perf_counter() - start) * 1000)
        for c in clients.values():
            c.close()
        result = {
            name: {
                "p50_ms": round(statistics.median(v), 3),
                "p90_ms": round(pct(v, 0.9), 3),
                "turns": len(v),
            }
            for name, v in times.items()
        }
        result["routed_minus_direct_tcp_p50_ms"] = round(
            result["routed"]["p50_ms"] - result["direct-tcp"]["p50_ms"], 3
        )
        result["routed_minus_proxy_p50_ms"] = round(
            result["routed"]["p50_ms"] - result["proxy"]["p50_ms"], 3
        )
        result["routed_minus_direct_ipc_p50_ms"] = round(
            result["routed"]["p50_ms"] - result["direct-ipc"]["p50_ms"], 3
        )
        print(json.dumps(result, indent=2))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    finally:
        for proc in reversed(procs):
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
