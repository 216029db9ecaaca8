"""Unreachable means replaced, safely: two real supervisors on one shared
data directory with `--lease-time`, behind a real router, one of them
reached through a TCP proxy. A whole-node freeze (SIGSTOP of the node's
supervisor and every process under it) and a partition (the proxy
stopped) each leave the node's keys served again by the other node, with
their history, every turn sent with its id and resent until answered, and
run once. How long each took is printed (BENCHMARKS.md, docs/cluster.md
give the measured times); nothing here is timed."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator

import psutil
import pytest

from hermes_sup.client import Client, Reply, SupervisorError, Timeout
from hermes_sup.supervisor.node_lease import read_deadline

from . import waiting
from .test_cli_remote import hs
from .test_clients import free_port
from .test_route import owner, router_over
from .waiting import wait_for

pytestmark = pytest.mark.e2e

LEASE_TIME = "5"

# A TCP forwarder: every connection to LISTEN is piped to TARGET. Stopping
# its process (SIGSTOP) is a partition: connections stay open, nothing passes.
PROXY = """
import socket, sys, threading
listen, target = int(sys.argv[1]), int(sys.argv[2])
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("127.0.0.1", listen))
server.listen(16)
def pump(src, dst):
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    for s in (src, dst):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
while True:
    conn, _ = server.accept()
    up = socket.create_connection(("127.0.0.1", target))
    threading.Thread(target=pump, args=(conn, up), daemon=True).start()
    threading.Thread(target=pump, args=(up, conn), daemon=True).start()
"""


@pytest.fixture
def leased_cluster(supervisor_factory, workdir):
    """Nodes a and b on one shared data directory with node leases; the
    router reaches a through a proxy (yielded third; the directory fourth)."""
    shared = workdir / "shared"
    shared.mkdir(mode=0o700)
    sups, lines = {}, []
    proxy_port = free_port()
    proxy = None
    try:
        for name in ("a", "b"):
            port = free_port()
            root = workdir / name
            root.mkdir()
            config = root / "node.toml"
            config.write_text(f'node = "{name}"\n')
            # The shared directory under a path of each node's own, as two
            # hosts mount it: supervisors on one host and one path would
            # share one cgroup subtree (named by the path), and each one's
            # start and stop clears the other's groups.
            mount = workdir / f"mnt-{name}"
            mount.symlink_to(shared)
            sups[name] = supervisor_factory(
                "--tcp", str(port), "--config", str(config), "--data-dir", str(mount),
                "--lease-time", LEASE_TIME, root=root,
            )  # fmt: skip
            reach = proxy_port if name == "a" else port
            conn = workdir / f"router-{name}.json"
            made = hs("keys", "generate", f"router-{name}", "--endpoint", f"127.0.0.1:{reach}",
                      "-o", str(conn), "--data-dir", str(shared))  # fmt: skip
            assert made.returncode == 0, made.stderr
            lines.append(f'[[node]]\nname = "{name}"\nconnection = "{conn}"\nshared_data = "s"\n')
            if name == "a":
                proxy = subprocess.Popen([sys.executable, "-c", PROXY, str(proxy_port), str(port)])
        with router_over(workdir, lines) as router:
            yield sups, router, proxy, shared
    finally:
        if proxy is not None:
            proxy.send_signal(signal.SIGCONT)
            proxy.kill()
            proxy.wait()


@contextlib.contextmanager
def frozen(pid: int) -> Iterator[list[psutil.Process]]:
    """SIGSTOP a process and everything under it (a whole node's processes);
    SIGCONT them all on the way out, whatever happens."""
    top = psutil.Process(pid)
    procs = [top, *top.children(recursive=True)]
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGSTOP)
    try:
        yield procs
    finally:
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGCONT)


def served_again(
    c: Client, key: str, text: str, logs: Callable[[], str] = str
) -> tuple[float, Reply, int]:
    """Send one turn (one id) and resend it until it is answered: the
    seconds it took, its reply, and how many sends it took."""
    turn_id = uuid.uuid4().hex
    started = time.monotonic()
    sends = 0
    while True:
        sends += 1
        try:
            reply = c.send(key, text, turn_id=turn_id).collect()
            return time.monotonic() - started, reply, sends
        except (SupervisorError, Timeout) as exc:
            code = getattr(exc, "code", "timeout")
            assert code in ("node_lost", "moved", "timeout"), f"{exc}\n{logs()}"
            time.sleep(0.2)


def lines_of(c: Client, key: str, name: str, logs: Callable[[], str] = str) -> list[str]:
    try:
        reply = c.run(key, f"sh cat {name}")
    except SupervisorError as exc:
        raise AssertionError(f"{exc}\n{logs()}") from None
    return "".join(str(e.data) for e in reply.events if e.type == "output").split()


def where(c: Client, key: str) -> list[str]:
    return [row["node"] for row in c.sessions() if row["key"] == key and row["state"] != "exited"]


def test_a_frozen_node_and_a_cut_off_node_are_replaced_with_each_turn_run_once(
    leased_cluster,
) -> None:
    sups, router, proxy, shared = leased_cluster

    def logs() -> str:
        return router.log() + "".join(s.log_path.read_text()[-6000:] for s in sups.values())

    on_a = [k for k in (f"fault:{i}" for i in range(60)) if owner(k) == "a"][:2]
    frozen_key, cut_key = on_a
    with Client(router.state_dir, timeout=30.0) as c:
        for key in on_a:
            assert c.run(key, f"write note.txt of-{key}").text.startswith("wrote")
            assert where(c, key) == ["a"]

        # Both nodes hold a node lease, renewed while the router pings them.
        for name in ("a", "b"):
            waiting.wait_for(lambda n=name: read_deadline(shared, n), what=f"{name}'s node lease")
        # A whole-node freeze: a's supervisor, zygote and workers stopped.
        with frozen(sups["a"].pid):
            took, reply, sends = served_again(c, frozen_key, "sh echo ran >> runs.txt", logs)
            assert reply.ok
            print(f"\nfreeze: served again after {took:.1f}s ({sends} sends)")
            assert where(c, frozen_key) == ["b"]
        # a wakes: it finds its lease ran out and gives up what it held
        # (its old worker killed), and comes back to the router.
        router.wait_nodes({"a", "b"})
        assert lines_of(c, frozen_key, "runs.txt", logs) == ["ran"]  # run once
        assert lines_of(c, frozen_key, "note.txt", logs) == [f"of-{frozen_key}"]  # its history came

        # A partition: the router cannot reach a, which stays up.
        if where(c, cut_key) != ["a"]:
            assert c.run(cut_key, "env HERMES_SESSION_KEY").text == cut_key
        assert where(c, cut_key) == ["a"]
        proxy.send_signal(signal.SIGSTOP)
        try:
            took, reply, sends = served_again(c, cut_key, "sh echo ran >> runs.txt", logs)
            assert reply.ok
            print(f"partition: served again after {took:.1f}s ({sends} sends)")
            # The list is asked of both nodes through the router: b's row may
            # still be the one it made while a held the key; it settles to
            # the live session on b while a stays cut off.
            try:
                wait_for(lambda: where(c, cut_key) == ["b"], timeout=60)
            except AssertionError:
                raise AssertionError(f"{c.sessions()}\n{logs()}") from None
        finally:
            proxy.send_signal(signal.SIGCONT)
        router.wait_nodes({"a", "b"})
        assert lines_of(c, cut_key, "runs.txt", logs) == ["ran"]
        assert lines_of(c, cut_key, "note.txt", logs) == [f"of-{cut_key}"]
        # Each key live on one node only, and a's log says why it let go.
        for key in on_a:
            assert where(c, key) == ["b"]
    assert "node_lease_expired" in sups["a"].log_path.read_text()
