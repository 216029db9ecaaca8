"""Ray node agents on a real local Ray cluster (ray.cluster_utils.Cluster, two
raylets): `ray up` runs one supervisor per node as its agent's child, a
router follows the registry, turns are answered by key; a node that leaves
takes every process of ours with it; its in-flight turn is sent to the
other node, which shares the data directory and answers it from the turn
journal (`interrupted`: it started, and never runs again), and its keys are
served again on the other node."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from functools import partial
from importlib.util import find_spec
from pathlib import Path

import psutil
import pytest

from hermes_sup.client import Client, NotRunning, SupervisorError, Timeout
from hermes_sup.cluster.placement import Candidate, rendezvous
from hermes_sup.cluster.ray_nodes import NAME_LABEL

from . import waiting
from .conftest import processes_mentioning

SESSIONS = 20
LOOPBACK = "127.0.0.1"
SLOTS = "hermes_sup_slots"  # the resource the first test's agents reserve
pytestmark = [
    # Ray is looked up here and imported by the tests that run: every run
    # collects this module, and Ray's import is a cost only these should pay.
    pytest.mark.skipif(find_spec("ray") is None, reason="ray is not installed"),
    pytest.mark.e2e,  # real Ray raylets, supervisors and workers
]


def hs_ray(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hermes_sup.cli.ray", *args],
        capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL, env=env,
    )  # fmt: skip


def tree(pid: int) -> set[int]:
    """`pid` and its descendants now."""
    try:
        proc = psutil.Process(pid)
        return {pid, *(c.pid for c in proc.children(recursive=True))}
    except psutil.Error:
        return set()


def alive(pids: set[int]) -> set[int]:
    left = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left.add(pid)
        except psutil.Error:
            continue
    return left


def note(c: Client, key: str) -> str:
    """The session's note.txt, as its worker reads it (sh's output events)."""
    reply = c.run(key, "sh cat note.txt")
    return "".join(str(e.data) for e in reply.events if e.type == "output").strip()


wait_until = partial(waiting.wait_for, timeout=60.0, every=0.2)


def add_node(cluster, name: str, slots: float | None = None):  # noqa: ANN001, ANN201
    """A raylet on 127.0.0.1 named `name` for hermes-sup (its label),
    declaring `slots` of the SLOTS resource if given."""
    return cluster.add_node(
        num_cpus=1, node_ip_address=LOOPBACK, labels={NAME_LABEL: name},
        resources={SLOTS: slots} if slots else {},
    )  # fmt: skip


def free_slots(env: dict[str, str], address: str) -> tuple[float, float]:
    """(available, total) of the SLOTS resource, as Ray counts them."""
    code = (
        "import json, logging, ray; "
        f"ray.init(address={address!r}, logging_level=logging.ERROR, log_to_driver=False); "
        f"print(json.dumps([ray.available_resources().get({SLOTS!r}, 0), "
        f"ray.cluster_resources().get({SLOTS!r}, 0)]))"
    )
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env, check=True)  # fmt: skip
    available, total = json.loads(ran.stdout.strip().splitlines()[-1])
    return float(available), float(total)


@pytest.fixture
def ray_cluster(workdir: Path):
    """Two raylets on this machine, `alpha` (the head) and `beta`; everything
    of Ray's under workdir and on 127.0.0.1: Ray's own guess of the node's
    address is the loopback one (no cluster mode), so neither Ray nor our
    supervisors connect to another address of the host."""
    tmp = workdir / "ray"
    tmp.mkdir()
    local = {"RAY_TMPDIR": str(tmp), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    old = {name: os.environ.get(name) for name in local}
    os.environ.update(local)
    from ray import cluster_utils

    cluster = cluster_utils.Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1, "include_dashboard": False, "node_ip_address": LOOPBACK,
            "labels": {NAME_LABEL: "alpha"}, "resources": {SLOTS: 3},
        },
    )  # fmt: skip
    try:
        worker = add_node(cluster, "beta", slots=2)
        cluster.wait_for_nodes()
        yield cluster, worker, {**os.environ, **local}
        foreign = foreign_connections(str(workdir))
        assert not foreign, f"connections off the loopback: {foreign}"
    finally:
        cluster.shutdown()
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def foreign_connections(marker: str) -> list[str]:
    """TCP connections of our processes (and Ray's, under `marker`) to an
    address outside 127.0.0.0/8."""
    found = []
    for proc in processes_mentioning(marker):
        try:
            conns = proc.net_connections(kind="inet")
        except psutil.Error:
            continue
        for conn in conns:
            for addr in (conn.laddr, conn.raddr):
                if addr and not on_loopback(addr.ip):
                    found.append(f"{proc.pid} {conn.status} {conn.laddr} -> {conn.raddr}")
    return found


def on_loopback(ip: str) -> bool:
    """127.0.0.0/8 or ::1, also as an IPv4-mapped IPv6 address."""
    address = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def test_agents_route_turns_and_a_lost_node_leaves_nothing(ray_cluster, workdir: Path) -> None:
    cluster, worker, env = ray_cluster

    # One data directory for both nodes (session leases): a session's files
    # outlive its node.
    # Each agent reserves all of its node's slots, which weigh the node.
    made = hs_ray(env, "up", "--address", cluster.address, "--base-dir", str(workdir / "n"),
                  "--data-dir", str(workdir / "shared"), "--resource", SLOTS)  # fmt: skip
    assert made.returncode == 0, made.stderr + made.stdout
    infos = [json.loads(line) for line in made.stdout.splitlines() if line.startswith("{")]
    assert len(infos) == 2
    assert {i["name"]: i["capacity"] for i in infos} == {"alpha": 3.0, "beta": 2.0}
    assert free_slots(env, cluster.address) == (0.0, 5.0)
    by_ray_node = {info["ray_node"]: info for info in infos}
    lost = by_ray_node[worker.node_id]
    names = {info["name"] for info in infos}
    assert names == {"alpha", "beta"}  # their labels, not their NodeIDs
    assert all(info["endpoint"].startswith(f"tcp://{LOOPBACK}:") for info in infos), infos

    state_dir = workdir / "r"
    log_path = workdir / "router.log"
    with open(log_path, "ab") as log:
        router = subprocess.Popen(
            [sys.executable, "-m", "hermes_sup.cli.route", "--ray", cluster.address,
             "--state-dir", str(state_dir), "--poll", "0.5"],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    try:

        def answered() -> set[str]:
            assert router.poll() is None, log_path.read_text()
            try:
                with Client(state_dir, timeout=5.0) as c:
                    return {n["name"] for n in c.status()["nodes"] if n["answered"]}
            except (NotRunning, Timeout):
                return set()

        wait_until(lambda: answered() == names, what="both nodes through the router")
        weighted = [Candidate(i["name"], i["capacity"]) for i in infos]
        owner = {f"ray:{i}": rendezvous(f"ray:{i}", weighted) for i in range(SESSIONS)}
        with Client(state_dir, timeout=60.0) as c:
            for key in owner:
                assert c.run(key, "env HERMES_SESSION_KEY").text == key
                assert c.run(key, f"write note.txt of-{key}").text.startswith("wrote")
            rows = {row["key"]: row["node"] for row in c.sessions()}
            assert rows == owner
            assert set(rows.values()) == names

            # The head node's agent is SIGKILLed: its supervisor and workers go
            # with it (parent-death signal), Ray restarts the agent on the same
            # node, which registers its new supervisor; the router follows.
            head = next(i for i in infos if i is not lost)
            old = tree(head["pid"]) | {head["agent_pid"]}
            assert len(old) >= 3
            os.kill(head["agent_pid"], signal.SIGKILL)
            wait_until(lambda: not alive(old), what="the killed agent's processes gone")
            wait_until(lambda: answered() == names, what="the restarted agent through the router")
            for key in owner:
                assert note(c, key) == f"of-{key}"

            # The worker node leaves: its agent, supervisor and workers all go.
            ours = tree(lost["pid"]) | {lost["agent_pid"]}
            assert lost["pid"] in ours and len(ours) >= 3  # supervisor, zygote, workers
            doomed = [k for k, n in owner.items() if n == lost["name"]]
            turn = c.send(doomed[0], "sleep 60")
            next(iter(turn))  # running (or queued) there
            cluster.remove_node(worker)
            with pytest.raises(SupervisorError) as gone:
                turn.collect()
            # The other node shares the data: it takes the session once the
            # lost node's lease is free and answers from its turn journal.
            assert gone.value.code == "interrupted", gone.value
            assert c.turn_status(doomed[0], turn.id)["state"] == "ended"
            wait_until(lambda: not alive(ours), what="no process of ours on the lost node")
            for key in doomed:
                assert note(c, key) == f"of-{key}"  # its files, on the other node
            survivor = (names - {lost["name"]}).pop()
            rows = {row["key"]: row["node"] for row in c.sessions()}
            assert {rows[k] for k in doomed} == {survivor}
    finally:
        router.send_signal(signal.SIGTERM)
        try:
            router.wait(20)
        except subprocess.TimeoutExpired:
            router.kill()
            router.wait()
        down = hs_ray(env, "down", "--address", cluster.address)
        assert down.returncode == 0, down.stderr


@contextlib.contextmanager
def routed(cluster, env: dict[str, str], workdir: Path):  # noqa: ANN001, ANN201
    """A router following the registry; yields (its state dir, the names of
    the nodes it has answering)."""
    state_dir = workdir / "r"
    log_path = workdir / "router.log"
    with open(log_path, "ab") as log:
        router = subprocess.Popen(
            [sys.executable, "-m", "hermes_sup.cli.route", "--ray", cluster.address,
             "--state-dir", str(state_dir), "--poll", "0.5"],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip

    def answered() -> set[str]:
        assert router.poll() is None, log_path.read_text()
        try:
            with Client(state_dir, timeout=5.0) as c:
                return {n["name"] for n in c.status()["nodes"] if n["answered"]}
        except (NotRunning, Timeout):
            return set()

    try:
        yield state_dir, answered
    finally:
        router.send_signal(signal.SIGTERM)
        try:
            router.wait(20)
        except subprocess.TimeoutExpired:
            router.kill()
            router.wait()
        down = hs_ray(env, "down", "--address", cluster.address)
        assert down.returncode == 0, down.stderr


def note_or_none(state_dir: Path, key: str) -> str | None:
    """The session's note through the router, or None while it cannot be had."""
    try:
        with Client(state_dir, timeout=10.0) as c:
            return note(c, key)
    except (SupervisorError, Timeout):
        return None


def test_a_frozen_node_is_replaced_and_nodes_that_join_or_restart_get_their_agent(
    ray_cluster, workdir: Path
) -> None:
    """beta's supervisor is stopped (SIGSTOP): its agent's watchdog kills it,
    its locks go, and alpha serves its keys with their files; a raylet that
    joins gets an agent without `ray up`; beta's raylet restarted (a new
    NodeID) comes back as beta, on its own directories."""
    cluster, beta_node, env = ray_cluster
    base = workdir / "n"
    made = hs_ray(env, "up", "--address", cluster.address, "--base-dir", str(base),
                  "--data-dir", str(workdir / "shared"), "--ping-every", "0.5",
                  "--ping-timeout", "2", "--ping-misses", "3", "--host", LOOPBACK)  # fmt: skip
    assert made.returncode == 0, made.stderr + made.stdout
    infos = {i["name"]: i for i in map(json.loads, made.stdout.splitlines()[:-1])}
    assert set(infos) == {"alpha", "beta"}
    assert all(i["endpoint"].startswith(f"tcp://{LOOPBACK}:") for i in infos.values())
    with routed(cluster, env, workdir) as (state_dir, answered):
        wait_until(lambda: answered() == {"alpha", "beta"}, what="both nodes through the router")
        owner = {f"f:{i}": rendezvous(f"f:{i}", [Candidate(n) for n in infos]) for i in range(12)}
        with Client(state_dir, timeout=60.0) as c:
            for key in owner:
                assert c.run(key, f"write note.txt of-{key}").text.startswith("wrote")
        doomed = [k for k, n in owner.items() if n == "beta"]
        assert doomed

        frozen = infos["beta"]["pid"]
        os.kill(frozen, signal.SIGSTOP)
        stopped = time.monotonic()
        for key in doomed:
            wait_until(lambda: note_or_none(state_dir, key) == f"of-{key}", what=key)  # noqa: B023
        moved = time.monotonic() - stopped
        wait_until(lambda: not alive({frozen}), what="the frozen supervisor killed")
        assert "watchdog_killed" in (base / "beta" / "supervisor.log").read_text()
        print(f"frozen: {len(doomed)} keys served again {moved:.1f}s after SIGSTOP")
        with Client(state_dir, timeout=30.0) as c:
            rows = [row["key"] for row in c.sessions()]
        assert sorted(rows) == sorted(owner)  # each key once, on one node

        # `ray up` again with new settings: for agents started from now on.
        again = hs_ray(env, "up", "--address", cluster.address, "--base-dir", str(base),
                       "--data-dir", str(workdir / "shared"), "--capacity", "2")  # fmt: skip
        assert again.returncode == 0, again.stderr + again.stdout
        joined = time.monotonic()
        add_node(cluster, "gamma")
        wait_until(lambda: "gamma" in answered(), what="gamma's agent, without ray up")
        print(f"join: gamma served {time.monotonic() - joined:.1f}s after its raylet started")
        listed = hs_ray(env, "nodes", "--address", cluster.address)
        weights = {n["name"]: n["capacity"] for n in map(json.loads, listed.stdout.splitlines())}
        assert weights == {"alpha": 1.0, "beta": 1.0, "gamma": 2.0}, weights

        cluster.remove_node(beta_node)
        wait_until(lambda: "beta" not in answered(), what="beta gone")
        add_node(cluster, "beta")
        wait_until(lambda: "beta" in answered(), what="beta back under its name")
        for key in doomed:
            wait_until(lambda: note_or_none(state_dir, key) == f"of-{key}", what=key)  # noqa: B023
        assert sorted(p.name for p in base.iterdir()) == ["alpha", "beta", "gamma"]
        # Three supervisors ran on beta's own directories: the first, the one
        # after the watchdog's kill, and the restarted raylet's.
        started = (base / "beta" / "supervisor.log").read_text().count(" ready pid=")
        assert started >= 3, started
