"""Ray node agents: one supervisor per Ray node, and a registry the router reads.

Theory of operation. `hermes-sup ray up` connects to a running Ray cluster
and starts, on every alive node, one detached `NodeAgent` actor pinned to
that node (NodeAffinitySchedulingStrategy, soft=False) and restarted by Ray
while the node lives (max_restarts=-1). Sessions are not Ray actors: an
actor per session costs about a second and 50 MiB, a fork 3 ms and 3 MiB.
The agent runs the node's `hermes-sup serve --tcp` as a CHILD process (a
supervisor cannot run inside a Ray worker, which has threads before our
zygote would start), through launcher.py so that the supervisor is killed
when the agent dies, however it dies.

Each agent makes a CURVE key pair for the router, enrolls it in its
supervisor's allowlist (`router-<node>`), and registers
`{node, endpoint, server key, router keys, remote HMAC key, capacity,
draining, ray_node}` in the registry: a named detached actor. It registers
again every few seconds, so a registry restarted by Ray is filled again.
The registry holds secrets: anyone who can run code in the Ray cluster can
read it, as they could run code on every node anyway.

`hermes-sup route --ray ADDRESS` reads the registry and keeps only entries
of nodes Ray reports alive.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .nodes import NodeSpec, data_id, spec_from_map

NAMESPACE = "hermes-sup"
REGISTRY = "hermes-sup-registry"
AGENT_PREFIX = "hermes-sup-agent-"
REREGISTER_SECONDS = 2.0


@ray.remote(num_cpus=0)
class Registry:
    """Node entries by node name (a named, detached actor)."""

    def __init__(self) -> None:
        self.entries: dict[str, dict[str, Any]] = {}

    def put(self, entry: dict[str, Any]) -> None:
        self.entries[entry["name"]] = entry

    def remove(self, name: str) -> None:
        self.entries.pop(name, None)

    def all(self) -> list[dict[str, Any]]:
        return list(self.entries.values())


def _registry() -> Any:
    return Registry.options(  # type: ignore[attr-defined]
        name=REGISTRY, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        max_restarts=-1,
    ).remote()  # fmt: skip


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@ray.remote(num_cpus=0)
class NodeAgent:
    """Runs and registers one node's supervisor; the supervisor is its child."""

    def __init__(
        self, name: str, base_dir: str, capacity: float, data_dir: str | None, serve_args: list[str]
    ) -> None:
        import zmq

        from hermes_sup.door import remote

        self.name = name
        self.ray_node = ray.get_runtime_context().get_node_id()
        host = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        root = Path(base_dir) / name
        state_dir = root / "s"
        data = Path(data_dir) if data_dir else root / "d"
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        config = root / "node.toml"
        config.write_text(f'node = "{name}"\n')
        port = _free_port(host)
        # A fresh key pair for the router at every start: the old one is revoked.
        client = f"router-{name}"
        server_public, _ = remote.server_keys(data)
        public, secret = zmq.curve_keypair()
        remote.revoke(data, client)
        remote.allow(data, client, public)
        self.entry: dict[str, Any] = {
            "name": name,
            "endpoint": remote.tcp_endpoint(host, port),
            "server_key": server_public.decode(),
            "hmac_key": remote.remote_hmac_key(data).hex(),
            "public": public.decode(),
            "secret": secret.decode(),
            "capacity": capacity,
            "draining": False,
            # Agents given one data directory (shared) say so: a lost node's
            # turn may then be sent to another (nodes.py).
            "shared_data": data_id(data) if data_dir else None,
            "ray_node": self.ray_node,
        }
        command = [
            sys.executable, "-m", "hermes_sup.cli", "--state-dir", str(state_dir),
            "serve", "--data-dir", str(data), "--tcp", f"{host}:{port}", "--config", str(config),
            *serve_args,
        ]  # fmt: skip
        self.log = open(root / "supervisor.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hermes_sup.cluster.launcher", str(os.getpid()), "--", *command],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        self.registry = _registry()
        ray.get(self.registry.put.remote(self.entry))
        self._stop = threading.Event()
        threading.Thread(target=self._keep, daemon=True, name="hermes-sup-agent").start()

    def _keep(self) -> None:
        """Re-register; if the supervisor died, so does the agent (Ray restarts it)."""
        while not self._stop.wait(REREGISTER_SECONDS):
            if self.proc.poll() is not None:
                os._exit(1)
            try:
                self.registry.put.remote(self.entry)
            except Exception:  # a registry being restarted: the next round puts it
                self.registry = _registry()

    def info(self) -> dict[str, Any]:
        """Where the supervisor is, and its pid (no secrets)."""
        public = {k: v for k, v in self.entry.items() if k not in ("secret", "hmac_key")}
        return {**public, "pid": self.proc.pid, "agent_pid": os.getpid()}

    def stop(self, timeout: float = 30.0) -> int | None:
        """Stop the supervisor gracefully (SIGTERM) and unregister."""
        self._stop.set()
        ray.get(self.registry.remove.remote(self.name))
        self.proc.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def node_name(node_id: str) -> str:
    return f"ray-{node_id[:12]}"


def up(
    base_dir: Path,
    capacity: float = 1.0,
    data_dir: Path | None = None,
    serve_args: list[str] | None = None,
    timeout: float = 120.0,
) -> list[dict[str, Any]]:
    """One agent per alive node (existing ones are kept); their info.

    Call after ray.init(address=..., namespace=NAMESPACE)."""
    agents = []
    for node in ray.nodes():  # type: ignore[no-untyped-call]
        if not node.get("Alive"):
            continue
        node_id = node["NodeID"]
        agent = NodeAgent.options(  # type: ignore[attr-defined]
            name=AGENT_PREFIX + node_id,
            namespace=NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            max_restarts=-1,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(node_name(node_id), str(base_dir), capacity, str(data_dir) if data_dir else None,
                 list(serve_args or []))  # fmt: skip
        agents.append(agent)
    return list(ray.get([a.info.remote() for a in agents], timeout=timeout))


def agents() -> list[Any]:
    """Handles of the agents of alive nodes."""
    found = []
    for node in ray.nodes():  # type: ignore[no-untyped-call]
        if node.get("Alive"):
            try:
                found.append(ray.get_actor(AGENT_PREFIX + node["NodeID"], namespace=NAMESPACE))
            except ValueError:
                continue
    return found


def down(timeout: float = 60.0) -> int:
    """Stop every agent's supervisor, then the agents and the registry."""
    handles = agents()
    if handles:
        ray.get([a.stop.remote() for a in handles], timeout=timeout)
    for a in handles:
        ray.kill(a, no_restart=True)
    try:
        ray.kill(ray.get_actor(REGISTRY, namespace=NAMESPACE), no_restart=True)
    except ValueError:
        pass
    return len(handles)


def read_registry(timeout: float = 10.0) -> list[NodeSpec]:
    """The registered nodes whose Ray node is alive."""
    try:
        registry = ray.get_actor(REGISTRY, namespace=NAMESPACE)
    except ValueError:
        return []  # nothing registered yet
    entries: list[dict[str, Any]] = ray.get(registry.all.remote(), timeout=timeout)
    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    specs = []
    for entry in entries:
        if entry.get("ray_node") in alive:
            fields = {k: v for k, v in entry.items() if k != "ray_node"}
            specs.append(spec_from_map(fields, f"ray registry entry {entry.get('name')!r}"))
    return specs


def connect(address: str) -> None:
    """Join the Ray cluster at `address` as a driver (quietly)."""
    import logging

    if not ray.is_initialized():
        ray.init(
            address=address, namespace=NAMESPACE, logging_level=logging.WARNING,
            log_to_driver=False,
        )  # fmt: skip


def registry_source(address: str) -> Any:
    """For the router: connect now (in the main thread), read on every poll."""
    connect(address)
    return read_registry


def wait_registered(count: int, timeout: float = 60.0) -> list[NodeSpec]:
    """Until `count` nodes are registered (for `ray up`)."""
    deadline = time.monotonic() + timeout
    specs: list[NodeSpec] = []
    while time.monotonic() < deadline:
        specs = read_registry()
        if len(specs) >= count:
            return specs
        time.sleep(0.2)
    return specs
