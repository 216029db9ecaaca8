"""A routed turn against a direct one, in the same run.

One supervisor (probe runtime, --tcp) and one router in front of it
(`hermes-sup route` with that node). One warm session reached four ways,
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

    .venv/bin/python -m bench.route [--turns 2000]     # from the repository root

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
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO, Sup, answers, free_port, pct, stop, wait_until
from hermes_sup.client import AsyncClient, Client, SupervisorError
from hermes_sup.client.connection import Connection
from hermes_sup.cluster.placement import Candidate, rendezvous


def proxy_main(front: str, conn_file: str) -> None:
    """The floor's process: zmq.proxy between an ipc ROUTER and the node."""
    import zmq

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


class Cluster:
    """Supervisors (probe runtime, --tcp, `node = name`) behind one router,
    all on `root`, their output in root/log; `close` stops the router first."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.nodes: dict[str, Sup] = {}
        self.ports: dict[str, int] = {}
        self.data: dict[str, Path] = {}
        self.router: subprocess.Popen[bytes] | None = None

    def start(
        self,
        names: list[str],
        shared: bool,
        poll: str | None = "0.2",
        node_log_level: str | None = "warning",
    ) -> None:
        """One supervisor per name, on one shared data directory or each on
        its own, then the router (state directory root/r), once every node
        answers through it. `poll` is the router's --poll (None: its default)."""
        root = self.root
        lines = []
        for name in names:
            self.ports[name] = free_port()
            self.data[name] = root / ("d" if shared else f"d{name}")
            (root / f"{name}.toml").write_text(f'node = "{name}"\n')
            self.nodes[name] = Sup(
                "--tcp", str(self.ports[name]), "--config", str(root / f"{name}.toml"),
                root=root, state=root / f"s{name}", data=self.data[name], log=root / "log",
                log_level=node_log_level, timeout=60,
            )  # fmt: skip
            connection = self.key(f"router-{name}", name)
            lines.append(f'[[node]]\nname = "{name}"\nconnection = "{connection}"\n')
            if shared:  # one data directory: a dead node's keys are served by the other
                lines[-1] += 'shared_data = "d"\n'
        (root / "nodes.toml").write_text("\n".join(lines))
        cmd = [sys.executable, "-m", "hermes_sup.cli.route", "--nodes", str(root / "nodes.toml")]
        cmd += ["--state-dir", str(root / "r"), "--log-level", "WARNING"]
        cmd += ["--poll", poll] if poll else []
        with open(root / "log", "ab") as log:
            self.router = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        wait_until(lambda: answers(root / "r", timeout=2.0), "the router", self.router)
        deadline = time.monotonic() + 60
        while True:
            with Client(root / "r", timeout=10.0) as c:
                nodes = c.status()["nodes"]
            if len(nodes) == len(names) and all(n["answered"] for n in nodes):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"nodes not all live through the router: {nodes}")
            time.sleep(0.1)

    def key(self, name: str, node: str) -> Path:
        """A connection file (a client key) for `node` over TCP + CURVE."""
        path = self.root / f"{name}.json"
        subprocess.run(
            [sys.executable, "-m", "hermes_sup.cli", "keys", "generate", name,
             "--endpoint", f"127.0.0.1:{self.ports[node]}", "-o", str(path),
             "--data-dir", str(self.data[node])], check=True, capture_output=True,
        )  # fmt: skip
        return path

    def close(self) -> None:
        """SIGTERM the router, then each node; SIGKILL one that lingers."""
        if self.router is not None:
            stop(self.router, timeout=30)
        for sup in reversed(self.nodes.values()):
            sup.close()


def scale(per_node: int, counts: list[int], in_flight: int, out: Path) -> None:
    """Spawns and turns a second, and what each node holds, with 1, 2, 3 nodes."""
    results = []
    for count in counts:
        cluster = Cluster(Path(tempfile.mkdtemp(prefix="hss-", dir="/tmp")))
        names = [chr(ord("a") + i) for i in range(count)]
        try:
            cluster.start(names, shared=False)
            keys = [f"sc:{i}" for i in range(per_node * count)]

            result = asyncio.run(measure_scale(cluster.root / "r", keys, count, in_flight))
            print(json.dumps(result), flush=True)
            results.append(result)
        finally:
            cluster.close()
            shutil.rmtree(cluster.root, ignore_errors=True)
    summary = {"per_node": per_node, "in_flight": in_flight, "runs": results}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")


async def measure_scale(
    router: Path, keys: list[str], count: int, in_flight: int
) -> dict[str, object]:
    """New sessions through the router, then one turn to each held session."""
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
        "spawn_p50_ms": round(pct(spawns, 50), 1),
        "spawn_p99_ms": round(pct(spawns, 99), 1),
        "turns_per_s": round(len(keys) / turn_wall, 1),
        "turns_per_s_per_node": round(len(keys) / turn_wall / count, 1),
        "turn_p50_ms": round(pct(turns, 50), 2),
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
    cluster = Cluster(Path(tempfile.mkdtemp(prefix="hsf-", dir="/tmp")))
    try:
        cluster.start(["a", "b"], shared=True)
        keys = [f"fo:{i}" for i in range(sessions)]
        on_b = [k for k in keys if rendezvous(k, [Candidate("a"), Candidate("b")]) == "b"]

        retries: dict[str, int] = {}
        floor: list[float] = []

        async def run() -> list[float]:
            async with AsyncClient(cluster.root / "r", timeout=120.0) as c:
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
                os.kill(cluster.nodes["b"].proc.pid, signal.SIGKILL)
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
            "p50_ms": round(pct(times, 50), 1),
            "last_ms": round(max(times), 1),
            "errors_before_served": retries,
            "floor_new_sessions_at_once_p50_ms": round(pct(floor, 50), 1),
            "floor_last_ms": round(max(floor), 1),
        }
        print(json.dumps(result, indent=2))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    finally:
        cluster.close()
        shutil.rmtree(cluster.root, ignore_errors=True)


def round_trips(turns: int, out: Path) -> None:
    """One warm session reached four ways, one turn of each in turn."""
    cluster = Cluster(Path(tempfile.mkdtemp(prefix="hsr-", dir="/tmp")))
    proxy: subprocess.Popen[bytes] | None = None
    try:
        # The router polls its node at its default pace; the node logs at
        # its default level.
        cluster.start(["a"], shared=False, poll=None, node_log_level=None)
        root = cluster.root
        direct_tcp, proxy_key = cluster.key("bench", "a"), cluster.key("proxy", "a")
        front = f"ipc://{root / 'proxy.sock'}"
        with open(root / "log", "ab") as log:
            proxy = subprocess.Popen(
                [sys.executable, "-m", "bench.route", "--proxy", front, str(proxy_key)],
                stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
            )  # fmt: skip
        proxied = Connection(front, Connection.from_file(proxy_key).key)
        wait_until(lambda: answers(connection=proxied, timeout=2.0), "the proxy", proxy)
        clients = {
            "direct-ipc": Client(cluster.nodes["a"].state, timeout=30.0),
            "direct-tcp": Client.from_connection_file(direct_tcp, timeout=30.0),
            "routed": Client(root / "r", timeout=30.0),
            "proxy": Client(connection=proxied, timeout=30.0),
        }
        key = "bench:route"
        times: dict[str, list[float]] = {name: [] for name in clients}
        for c in clients.values():  # warm: the worker, the sockets, the CURVE handshakes
            for _ in range(50):
                c.run(key, "hello")
        for _ in range(turns):
            for name, c in clients.items():
                start = time.perf_counter()
                c.run(key, "hello")
                times[name].append((time.perf_counter() - start) * 1000)
        for c in clients.values():
            c.close()
        p50 = {name: round(pct(v, 50), 3) for name, v in times.items()}
        result: dict[str, object] = {
            name: {"p50_ms": p50[name], "p90_ms": round(pct(v, 90), 3), "turns": len(v)}
            for name, v in times.items()
        }
        for other in ("direct-tcp", "proxy", "direct-ipc"):
            name = f"routed_minus_{other.replace('-', '_')}_p50_ms"
            result[name] = round(p50["routed"] - p50[other], 3)
        print(json.dumps(result, indent=2))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    finally:
        if proxy is not None:
            stop(proxy, timeout=30)
        cluster.close()
        shutil.rmtree(cluster.root, ignore_errors=True)


def main() -> None:
    """Round trips, --scale, --failover, or (--proxy) the floor's process."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=2000)
    parser.add_argument("--proxy", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--failover", type=int, default=0, metavar="N")
    parser.add_argument("--scale", type=int, default=0, metavar="N", help="sessions per node")
    parser.add_argument("--scale-nodes", default="1,2,3", help="node counts for --scale")
    parser.add_argument("--in-flight", type=int, default=32, help="requests at once (--scale)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "route.json")
    args = parser.parse_args()
    if args.proxy:
        proxy_main(*args.proxy)
    elif args.scale:
        counts = [int(n) for n in args.scale_nodes.split(",")]
        scale(args.scale, counts, args.in_flight, args.out.with_name("route_scale.json"))
    elif args.failover:
        failover(args.failover, args.out.with_name("route_failover.json"))
    else:
        round_trips(args.turns, args.out)


if __name__ == "__main__":
    main()
