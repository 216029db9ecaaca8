"""Ray node agents: one supervisor per Ray node, and a registry the router reads.

Theory of operation. `hermes-sup ray up` connects to a running Ray cluster
and starts the keeper, a detached actor that gives every alive node, and
every node that joins later (it looks every few seconds), one detached
`NodeAgent` actor pinned to that node (NodeAffinitySchedulingStrategy,
soft=False) and restarted by Ray while the node lives (max_restarts=-1).
A node is named by its label or its host (ray_nodes.py), never by its
NodeID, so a restarted raylet's supervisor has its old state and sessions.
Sessions are not Ray actors: an actor per session costs about a second and 50 MiB, a fork 3 ms and 3 MiB.
The agent runs the node's `hermes-sup serve --tcp` as a CHILD process (a
supervisor cannot run inside a Ray worker, which has threads before our
zygote would start), through launcher.py so that the supervisor is killed
when the agent dies, however it dies. The agent's watchdog (watchdog.py)
kills a supervisor that stops answering pings; the agent then exits, and
Ray restarts it.

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
from dataclasses import asdict
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .nodes import NodeConfigError, NodeSpec, data_id, spec_from_map
from .ray_nodes import AgentPlan, name_alive, node_address, plan_agents
from .watchdog import Watchdog, WatchdogSettings, lease_left, ping_supervisor

NAMESPACE = "hermes-sup"
REGISTRY = "hermes-sup-registry"
AGENT_PREFIX = "hermes-sup-agent-"
KEEPER = "hermes-sup-keeper"
REREGISTER_SECONDS = 2.0
JOIN_SECONDS = 2.0  # how often the keeper looks for nodes without an agent


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
        self,
        name: str,
        base_dir: str,
        capacity: float,
        data_dir: str | None,
        serve_args: list[str],
        watchdog: dict[str, Any] | None = None,
        host: str | None = None,
    ) -> None:
        import zmq

        from hermes_sup.door import remote

        self.name = name
        self.ray_node = ray.get_runtime_context().get_node_id()
        # The operator's, else the address Ray knows for this node (its
        # raylet's --node-ip-address), not a guess from in here.
        host = host or node_address(ray.nodes(), self.ray_node)  # type: ignore[no-untyped-call]
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
        settings = WatchdogSettings(**(watchdog or {}))
        self.watchdog = Watchdog(
            self.proc.pid,
            settings,
            lambda timeout: ping_supervisor(state_dir, timeout),
            # A shared data directory's node lease (ray up --lease-time).
            lease_left=(lambda: lease_left(data, name)) if data_dir else lambda: None,
        )
        self.registry = _registry()
        ray.get(self.registry.put.remote(self.entry))
        self._stop = threading.Event()
        threading.Thread(target=self._keep, daemon=True, name="hermes-sup-agent").start()

    def _keep(self) -> None:
        """Watch the supervisor and re-register. A supervisor that exited,
        or that the watchdog killed, takes the agent with it: Ray restarts
        the agent, which starts a new one."""
        registered = time.monotonic()
        while not self._stop.wait(self.watchdog.settings.every):
            if self.proc.poll() is not None:
                os._exit(1)
            why = self.watchdog.check()
            if self._stop.is_set():
                return
            if why is not None:
                self.log.write(
                    f"hermes-sup-agent: watchdog_killed pid={self.proc.pid} reason={why!r}\n".encode()
                )
                self.log.flush()
                self.proc.wait()
                os._exit(1)
            if time.monotonic() - registered >= REREGISTER_SECONDS:
                registered = time.monotonic()
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


@ray.remote(num_cpus=0)
class Keeper:
    """Gives every alive node an agent, nodes that join included: it looks
    at Ray's node list every JOIN_SECONDS (a named, detached actor that
    `ray up` starts, and Ray restarts with the same settings)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.agents: dict[str, Any] = {}  # by Ray NodeID
        self.problems: set[str] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._keep, daemon=True, name="hermes-sup-keeper").start()

    def settings(self) -> dict[str, Any]:
        """The settings it starts agents with."""
        return self.config

    def skipped(self) -> list[str]:
        """Why nodes have no agent, as of the last look (sorted)."""
        return sorted(self.problems)

    def _keep(self) -> None:
        while True:
            time.sleep(JOIN_SECONDS)
            try:
                self.reconcile()
            except Exception as exc:  # the GCS briefly away: the next round
                print(f"hermes-sup-keeper: reconcile failed: {exc}", file=sys.stderr)

    def reconcile(self) -> list[Any]:
        """Start an agent on each alive node without one, let go of those
        of nodes gone; the handles of the alive nodes' agents."""
        with self._lock:
            plans, problems = plan_agents(
                ray.nodes(),  # type: ignore[no-untyped-call]
                self.config["capacity"],
                self.config.get("resource"),
            )
            for problem in set(problems) - self.problems:
                print(f"hermes-sup-keeper: {problem}", file=sys.stderr)
            self.problems = set(problems)
            wanted = {plan.node_id: plan for plan in plans}
            for node_id in set(self.agents) - set(wanted):
                # Its raylet is gone (a restarted one has a new NodeID): its
                # agent, pinned there, would wait forever for it.
                ray.kill(self.agents.pop(node_id), no_restart=True)
            for node_id, plan in wanted.items():
                if node_id not in self.agents:
                    self.agents[node_id] = _start_agent(plan, self.config)
            return [self.agents[node_id] for node_id in wanted]


def _start_agent(plan: AgentPlan, config: dict[str, Any]) -> Any:
    return NodeAgent.options(  # type: ignore[attr-defined]
        name=AGENT_PREFIX + plan.node_id,
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        max_restarts=-1,
        resources=plan.reserve,
        scheduling_strategy=NodeAffinitySchedulingStrategy(plan.node_id, soft=False),
    ).remote(
        plan.name,
        config["base_dir"],
        plan.capacity,
        config["data_dir"],
        list(config["serve_args"]),
        config["watchdog"],
        config.get("host"),
    )


def _keeper(config: dict[str, Any], timeout: float) -> Any:
    """The keeper, with these settings. Ray restarts an actor with the
    arguments it was made with, so new settings make a new keeper (the
    agents already running are kept: theirs are detached actors)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            keeper = Keeper.options(  # type: ignore[attr-defined]
                name=KEEPER, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                max_restarts=-1,
            ).remote(config)  # fmt: skip
            if ray.get(keeper.settings.remote(), timeout=timeout) == config:
                return keeper
            ray.kill(keeper, no_restart=True)
        except (ValueError, ray.exceptions.RayActorError):
            # The old keeper is still being let go (its name, or a handle to it).
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def up(
    base_dir: Path,
    capacity: float = 1.0,
    data_dir: Path | None = None,
    serve_args: list[str] | None = None,
    timeout: float = 120.0,
    watchdog: WatchdogSettings | None = None,
    resource: str | None = None,
    host: str | None = None,
) -> list[dict[str, Any]]:
    """One agent per alive node (existing ones are kept), and the keeper
    that gives nodes joining later theirs; the agents' info. NodeConfigError
    if two alive nodes would have one name, or a node none.

    Call after ray.init(address=..., namespace=NAMESPACE)."""
    settings = watchdog or WatchdogSettings()
    settings.check()
    _, problems = name_alive(ray.nodes())  # type: ignore[no-untyped-call]
    if problems:
        raise NodeConfigError("; ".join(problems))
    if resource is not None and not resource.strip():
        raise NodeConfigError("--resource needs a resource name")
    config = {
        "base_dir": str(base_dir),
        "capacity": capacity,
        "data_dir": str(data_dir) if data_dir else None,
        "serve_args": list(serve_args or []),
        "watchdog": asdict(settings),
        "resource": resource,
        "host": host,
    }
    keeper = _keeper(config, timeout)
    handles = ray.get(keeper.reconcile.remote(), timeout=timeout)
    return list(ray.get([a.info.remote() for a in handles], timeout=timeout))


def skipped(timeout: float = 30.0) -> list[str]:
    """Why alive nodes have no agent (the keeper's last look), if it runs."""
    try:
        keeper = ray.get_actor(KEEPER, namespace=NAMESPACE)
    except ValueError:
        return []
    return list(ray.get(keeper.skipped.remote(), timeout=timeout))


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
    """Stop the keeper (no agent started again), every agent's supervisor,
    then the agents and the registry."""
    try:
        ray.kill(ray.get_actor(KEEPER, namespace=NAMESPACE), no_restart=True)
    except ValueError:
        pass
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
