"""`hermes-sup route` with real processes: two supervisors on TCP + CURVE
behind a real router process, driven by the unchanged Python client through
the router's state directory (issue 20)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from hermes_sup.client import AsyncClient, Client, NotRunning, SupervisorError, Timeout
from hermes_sup.cluster.placement import Candidate, rendezvous
from hermes_sup.protocol import Kind

from . import waiting
from .test_cli_remote import hs
from .test_clients import free_port

NODES = ("a", "b")
SESSIONS = 60


class RouterProcess:
    """A real `route` process on its own state directory (`extra`: more
    `route` options)."""

    def __init__(self, root: Path, nodes_file: Path, *extra: str) -> None:
        self.state_dir = root / "r"
        self.data_dir = root / "rd"  # its CURVE keys, for remote front ends
        self.port = free_port()
        self.log_path = root / "router.log"
        self._log = open(self.log_path, "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hermes_sup.cli.route", "--nodes", str(nodes_file),
             "--state-dir", str(self.state_dir), "--poll", "0.2",
             "--tcp", str(self.port), "--data-dir", str(self.data_dir), *extra],
            stdout=self._log, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_nodes(self, live: set[str], timeout: float = 30.0) -> dict:
        """Until `status` through the router shows exactly `live` answering."""
        deadline = time.monotonic() + timeout
        status: dict = {}
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log()
            try:
                with Client(self.state_dir, timeout=5.0) as c:
                    status = c.status()
                if {n["name"] for n in status["nodes"] if n["answered"]} == live:
                    return status
            except (NotRunning, Timeout):
                pass
            time.sleep(0.1)
        raise AssertionError(f"nodes {live} not live through the router: {status}\n{self.log()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"router did not stop on SIGTERM:\n{self.log()}") from None
        self._log.close()


@contextlib.contextmanager
def router_over(
    workdir: Path, lines: list[str], *extra: str, nodes: tuple[str, ...] = NODES
) -> Iterator[RouterProcess]:
    """A router over the nodes in `lines` (nodes.toml entries), once it sees every one of `nodes`."""
    nodes_file = workdir / "nodes.toml"
    nodes_file.write_text("\n".join(lines))
    router = RouterProcess(workdir, nodes_file, *extra)
    try:
        router.wait_nodes(set(nodes))
        yield router
    finally:
        router.stop()


@pytest.fixture
def cluster(supervisor_factory, workdir):
    """Two supervisors (a, b) on TCP, each with a key enrolled for the router."""
    sups = {}
    lines = []
    for name in NODES:
        port = free_port()
        root = workdir / name
        root.mkdir()
        config = root / "node.toml"
        config.write_text(f'node = "{name}"\n')  # the name the router knows it by
        sup = supervisor_factory("--tcp", str(port), "--config", str(config), root=root)
        conn = workdir / f"router-{name}.json"
        made = hs("keys", "generate", "router", "--endpoint", f"127.0.0.1:{port}",
                  "-o", str(conn), "--data-dir", str(sup.data_dir))  # fmt: skip
        assert made.returncode == 0, made.stderr
        lines.append(f'[[node]]\nname = "{name}"\nconnection = "{conn}"\n')
        sups[name] = sup
    with router_over(workdir, lines) as router:
        yield sups, router


def owner(key: str, live: tuple[str, ...] = NODES) -> str | None:
    return rendezvous(key, [Candidate(n) for n in live])


def test_turns_list_and_node_loss_through_the_router(cluster) -> None:
    sups, router = cluster
    keys = [f"chat:{i}" for i in range(SESSIONS)]
    with Client(router.state_dir, timeout=60.0) as c:
        assert c.ping().pid == router.proc.pid  # the router answers ping itself
        # Every session gets its own value; each turn runs where its key lives.
        for key in keys:
            c.open(key, env={"ROUTE_PROBE": f"value-of-{key}"})
        turns = [(key, c.send(key, "env ROUTE_PROBE")) for key in keys]
        for key, turn in turns:
            assert turn.collect().text == f"value-of-{key}"
        rows = {row["key"]: row for row in c.sessions()}
        assert set(rows) == set(keys)
        for key in keys:
            assert rows[key]["node"] == owner(key), key
        assert {rows[k]["node"] for k in keys} == set(NODES)
        # Each supervisor holds only its own share: no key ran on both.
        for name, sup in sups.items():
            with sup.client() as direct:
                held = {row["key"] for row in direct.sessions()}
            assert held == {k for k in keys if owner(k) == name}

        # In-flight turns on b, then b dies (SIGKILL): they end with node_lost.
        on_b = [k for k in keys if owner(k) == "b"][:5]
        running = [c.send(key, "sleep 60") for key in on_b]
        for turn in running:
            first = next(iter(turn))  # the supervisor's `running` (or queued) status
            assert first is not None
        os.kill(sups["b"].pid, signal.SIGKILL)
        sups["b"].proc.wait()
        for turn in running:
            with pytest.raises(SupervisorError) as lost:
                turn.collect()
            assert lost.value.code == "node_lost", lost.value
        router.wait_nodes({"a"})
        # b's keys keep their one history, on b's own data: while b is
        # away they are refused, naming b, never started anew on a.
        for key in on_b:
            with pytest.raises(SupervisorError) as away:
                c.run(key, "env HERMES_SESSION_KEY")
            assert away.value.code == "home_unavailable", away.value
            assert "node b" in str(away.value)
        rows = {row["key"]: row for row in c.sessions()}
        assert not set(on_b) & set(rows)
        assert all(rows[k]["node"] == "a" for k in keys if owner(k) == "a")

        # b comes back: a watch of all sessions opened meanwhile covers it too.
        watch = c.submit(Kind.WATCH, {}, None)
        assert c.next().body["type"] == "watching"
        sups["b"].start()
        router.wait_nodes(set(NODES))
        back = (
            "back:on-b"
            if owner("back:on-b") == "b"
            else next(f"back:{i}" for i in range(100) if owner(f"back:{i}") == "b")
        )
        with Client(router.state_dir, timeout=60.0) as other:
            assert other.run(back, "env HERMES_SESSION_KEY").text == back
            assert {r["key"]: r["node"] for r in other.sessions()}[back] == "b"
            # b's keys are served on b again, with their history: each is
            # listed once, on b (no second session anywhere).
            assert other.run(on_b[0], "env ROUTE_PROBE").text == f"value-of-{on_b[0]}"
            listed = [r for r in other.sessions() if r["key"] in on_b]
            assert sorted((r["key"], r["node"]) for r in listed) == sorted((k, "b") for k in on_b)
        while True:
            msg = c.next()
            assert msg.re == watch
            if msg.body["type"] == "reply" and msg.session == back:
                break


def test_a_send_with_ack_false_gets_no_running_event_through_the_router(cluster) -> None:
    """The router forwards a send's payload unchanged, so a node sees its
    `ack: false` and leaves out the `running` event (one message fewer a
    turn, both hops); a send without it still gets one."""
    _, router = cluster
    with Client(router.state_dir, timeout=30.0) as c:
        assert c.run("ack:1", "hello").ok  # the worker is up: the next turn runs at once

        def events(body: dict) -> list[str]:
            sent = c.submit(Kind.SEND, body, "ack:1")
            seen = []
            while True:
                msg = c.next()
                assert msg.re == sent, msg
                if msg.kind is not Kind.EVENT:
                    return seen
                data = msg.body.get("data")
                state = data.get("state") if isinstance(data, dict) else None
                seen.append(state or msg.body["type"])

        assert events({"text": "hello"})[0] == "running"
        assert "running" not in events({"text": "hello", "ack": False})


@pytest.fixture
def shared_cluster(supervisor_factory, workdir):
    """Two supervisors (a, b) on ONE shared data directory (session leases)."""
    shared = workdir / "shared"
    sups = {}
    lines = []
    for name in NODES:
        port = free_port()
        root = workdir / name
        root.mkdir()
        config = root / "node.toml"
        config.write_text(f'node = "{name}"\n')
        sup = supervisor_factory(
            "--tcp", str(port), "--config", str(config), "--data-dir", str(shared), root=root
        )
        sup.tcp_port = port
        conn = workdir / f"router-{name}.json"
        made = hs("keys", "generate", f"router-{name}", "--endpoint", f"127.0.0.1:{port}",
                  "-o", str(conn), "--data-dir", str(shared))  # fmt: skip
        assert made.returncode == 0, made.stderr
        lines.append(f'[[node]]\nname = "{name}"\nconnection = "{conn}"\nshared_data = "shared"\n')
        sups[name] = sup
    with router_over(workdir, lines) as router:
        yield sups, router


def note(c: Client, key: str) -> str:
    """The session's note.txt, as its worker reads it (sh's output events)."""
    reply = c.run(key, "sh cat note.txt")
    return "".join(str(e.data) for e in reply.events if e.type == "output").strip()


def node_row(c: Client, name: str) -> dict:
    """What a node says of itself (its `node` map) in `status` through the router."""
    row = next(n for n in c.status()["nodes"] if n["name"] == name)
    return row["status"]["node"] if row["answered"] else {}


def test_drain_through_the_router_and_node_loss_on_a_shared_data_dir_keep_each_sessions_files(
    shared_cluster, workdir
) -> None:
    pytest.importorskip("hermes_sup.supervisor.leases", reason="needs session leases")

    sups, router = shared_cluster
    keys = [f"note:{i}" for i in range(20)]
    on_b = [k for k in keys if owner(k) == "b"]
    with Client(router.state_dir, timeout=60.0) as c:
        for key in keys:
            assert c.run(key, f"write note.txt of-{key}").text.startswith("wrote")

        # A turn is running on b when b is drained through the router (its
        # operator's local socket): the router passes the drain to b, which
        # takes it from the router's key (enrolled as router-b). The command
        # returns once b stopped its sessions as they went idle.
        running = c.send(on_b[0], "sleep 2")
        next(iter(running))
        drained = hs("--state-dir", str(router.state_dir), "drain", "--node", "b", "--wait")
        assert drained.returncode == 0, drained.stderr
        assert "node b draining" in drained.stdout, drained.stdout
        assert "drained: no session left" in drained.stdout
        # The running turn finished on b, with its answer.
        assert running.collect().ok
        held = node_row(c, "b")
        assert (held["draining"], held["sessions"]) == (True, 0)
        # Their next messages are answered on a, whose worker finds their files.
        for key in on_b:
            assert note(c, key) == f"of-{key}"
        # New keys that hash to b go to a.
        fresh = [k for k in (f"new:{i}" for i in range(40)) if owner(k) == "b"][:3]
        for key in fresh:
            assert c.run(key, "env HERMES_SESSION_KEY").text == key
        rows = {row["key"]: row for row in c.sessions()}
        assert {rows[k]["node"] for k in on_b + fresh} == {"a"}
        assert {rows[k]["state"] for k in keys} == {"idle"}

        # Nobody else may drain: a front end of b's TCP socket whose key is
        # not a router's, or any front end of the router's TCP socket.
        web_b = workdir / "web-b.json"
        made = hs("keys", "generate", "web", "--endpoint", f"127.0.0.1:{sups['b'].tcp_port}", "-o",
                  str(web_b), "--data-dir", str(workdir / "shared"))  # fmt: skip
        assert made.returncode == 0, made.stderr
        web_r = workdir / "web-r.json"
        made = hs("keys", "generate", "router-web", "--endpoint", f"127.0.0.1:{router.port}",
                  "-o", str(web_r), "--data-dir", str(router.data_dir))  # fmt: skip
        assert made.returncode == 0, made.stderr
        for conn in (web_b, web_r):
            with Client.from_connection_file(conn, timeout=30.0) as far:
                with pytest.raises(SupervisorError) as refused:
                    far.request(Kind.DRAIN, {"on": False, "node": "b"})
                assert refused.value.code == "unknown_kind", refused.value
        assert node_row(c, "b")["draining"] is True

        # a dies with a turn running; b (drain ended through the router)
        # shares the data: the router sends it the turn, which b answers
        # from the session's turn journal (`interrupted`: it started on a,
        # and never runs again); b takes every key over, files and all.
        # (The operator's command, through the router's local socket.)
        ended = hs("route", "--state-dir", str(router.state_dir), "drain", "b", "--off")
        assert ended.returncode == 0, ended.stderr
        assert "node b: taking new sessions again" in ended.stdout, ended.stdout
        assert node_row(c, "b")["draining"] is False
        turn = c.send(keys[0], "sleep 60")
        next(iter(turn))
        os.kill(sups["a"].pid, signal.SIGKILL)
        sups["a"].proc.wait()
        with pytest.raises(SupervisorError) as lost:
            turn.collect()
        assert lost.value.code == "interrupted", lost.value
        router.wait_nodes({"b"})
        for key in keys:
            assert note(c, key) == f"of-{key}"
        rows = {row["key"]: row for row in c.sessions()}
        assert {rows[k]["node"] for k in keys} == {"b"}


def test_remote_front_end_and_watch_of_all_through_the_router(cluster, workdir) -> None:
    """A remote client (TCP + CURVE, a connection file made for the router)
    is served as by one supervisor; a watch of every session sees turns on
    both nodes, and ends with one unwatch."""
    sups, router = cluster
    conn = workdir / "web.json"
    made = hs("keys", "generate", "web", "--endpoint", f"127.0.0.1:{router.port}",
              "-o", str(conn), "--data-dir", str(router.data_dir))  # fmt: skip
    assert made.returncode == 0, made.stderr
    keys = {owner(f"w:{i}"): f"w:{i}" for i in range(20)}  # one key per node
    assert set(keys) == set(NODES)
    with Client(router.state_dir, timeout=30.0) as watcher:
        watch = watcher.submit(Kind.WATCH, {}, None)
        first = watcher.next()
        assert (first.re, first.body["type"]) == (watch, "watching")
        with Client.from_connection_file(conn, timeout=30.0) as remote:
            for key in keys.values():
                assert remote.run(key, "env HERMES_SESSION_KEY").text == key
            assert {r["key"] for r in remote.sessions()} == set(keys.values())
        replied = set()
        while replied != set(keys.values()):
            msg = watcher.next()
            assert msg.re == watch and msg.kind is Kind.EVENT, msg
            assert msg.body["type"] != "watching"  # said once, not once per node
            if msg.body["type"] == "reply":
                replied.add(msg.session)
        # One unwatch ends it on both nodes: one `unwatched`.
        unwatch = watcher.submit(Kind.UNWATCH, {"watch": watch}, None)
        while (msg := watcher.next()).re != unwatch:
            assert msg.re == watch
        assert msg.body["type"] == "unwatched"
        assert watcher.ping().pid == router.proc.pid

    # The asyncio client and the CLI, unchanged, through the router too.
    async def async_turns() -> list[str]:
        async with AsyncClient(router.state_dir, timeout=30.0) as ac:
            replies = await asyncio.gather(
                *(ac.run(key, "env HERMES_SESSION_KEY") for key in keys.values())
            )
        return [reply.text for reply in replies]

    assert asyncio.run(async_turns()) == list(keys.values())
    listed = hs("--state-dir", str(router.state_dir), "list", "-q")
    assert sorted(listed.stdout.split()) == sorted(keys.values()), listed.stderr


def test_watches_of_front_ends_gone_without_unwatch_are_ended_on_the_nodes(cluster) -> None:
    """Each node counts the router's watches against one connection, the
    router's (MAX_PER_CLIENT). Front ends that watch and go away without
    `unwatch` must not use that up: once the router finds one gone (its
    next event cannot be delivered), it ends its watches on the nodes, and
    a new front end can still watch through the router."""
    from hermes_sup.supervisor.watchers import MAX_PER_CLIENT

    _sups, router = cluster
    for _ in range(MAX_PER_CLIENT + 2):
        with Client(router.state_dir, timeout=30.0) as leaver:
            leaver.submit(Kind.WATCH, {}, None)
            assert leaver.next().body["type"] == "watching"
        # Gone without unwatch; a turn's events reach the router for it.
        with Client(router.state_dir, timeout=30.0) as worker:
            assert worker.run("gone:turn", "pid").ok
    with Client(router.state_dir, timeout=30.0) as watcher:
        watch = watcher.submit(Kind.WATCH, {}, None)
        first = watcher.next()
        assert (first.re, first.body["type"]) == (watch, "watching"), first
        with Client(router.state_dir, timeout=30.0) as worker:
            assert worker.run("gone:turn", "pid").ok
        seen = watcher.next()
        assert seen.re == watch and seen.kind is Kind.EVENT, seen
    assert "router_client_gone" in router.log()


def test_many_front_ends_watch_through_one_router_each_held_to_its_own_limit(cluster) -> None:
    """A node counts every watch through the router against the router's one
    connection; a router's key may use every slot there, and the router
    holds each front end to a supervisor's per-client limit instead."""
    from hermes_sup.supervisor.watchers import MAX_PER_CLIENT

    _sups, router = cluster
    with contextlib.ExitStack() as stack:
        # More front ends than one client may have watches, each with one.
        for _ in range(MAX_PER_CLIENT + 2):
            front = stack.enter_context(Client(router.state_dir, timeout=30.0))
            watch = front.submit(Kind.WATCH, {}, None)
            assert front.next().body["type"] == "watching"
        with Client(router.state_dir, timeout=30.0) as worker:
            assert worker.run("many:turn", "pid").ok
        seen = front.next()  # the last one's watch is served by the nodes
        assert seen.re == watch and seen.kind is Kind.EVENT, seen
        # One front end alone is held to the limit, by the router.
        greedy = stack.enter_context(Client(router.state_dir, timeout=30.0))
        for _ in range(MAX_PER_CLIENT):
            greedy.submit(Kind.WATCH, {}, None)
            assert greedy.next().body["type"] == "watching"
        greedy.submit(Kind.WATCH, {}, None)
        refused = greedy.next()
        assert refused.kind is Kind.ERROR and refused.body["code"] == "busy", refused
        assert f"limit {MAX_PER_CLIENT} per client" in refused.body["message"]


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_two_routers_over_one_cluster_with_status_metrics_and_health(cluster, workdir) -> None:
    """A second router over the same nodes places keys as the first does, so
    a front end may use either (and move to the other when one stops);
    `status` works through a router; `--metrics` serves Prometheus text and
    a health check that fails once no node is linked."""
    sups, first = cluster
    (workdir / "second").mkdir()
    port = free_port()
    second = RouterProcess(workdir / "second", workdir / "nodes.toml", "--metrics", str(port))
    try:
        second.wait_nodes(set(NODES))
        shown = hs("--state-dir", str(first.state_dir), "status")
        assert shown.returncode == 0, shown.stderr
        assert "router" in shown.stdout and "2 of 2 answering" in shown.stdout, shown.stdout
        assert all(f"  {n}: answering" in shown.stdout for n in NODES), shown.stdout
        with Client(first.state_dir, timeout=30) as c1, Client(second.state_dir, timeout=30) as c2:
            pid = c1.run("both", "pid").text
            assert c2.run("both", "pid").text == pid  # one session, wherever it came from
            # A session's shell pokes the metrics port with garbage: nothing changes.
            poke = (
                f"import socket; s = socket.create_connection(('127.0.0.1', {port}), 5); "
                "s.sendall(bytes(range(256)) * 64); s.close()"
            )
            c1.run("both", f'sh {sys.executable} -c "{poke}" || true')
        base = f"http://127.0.0.1:{port}"
        metrics = wait_for_text(base + "/metrics", 'hermes_sup_router_node_linked{node="b"} 1')
        assert 'hermes_sup_router_node_linked{node="a"} 1' in metrics
        assert "hermes_sup_router_requests_total" in metrics
        assert _get(base + "/healthz") == (200, "ok: 2 of 2 node(s) linked\n")
        assert _get(base + "/nothing")[0] == 404

        first.stop()
        with Client(second.state_dir, timeout=30) as c2:
            assert c2.run("both", "pid").text == pid
        for sup in sups.values():
            sup.stop()
        wait_for_text(base + "/healthz", "no node linked", status=503)
        metrics = _get(base + "/metrics")[1]
        assert 'hermes_sup_router_node_linked{node="a"} 0' in metrics
        assert "hermes_sup_router_node_losses_total 2" in metrics
    finally:
        second.stop()


def wait_for_text(url: str, text: str, status: int = 200) -> str:
    """The body at `url` once it contains `text` with this status."""
    return waiting.wait_for(
        lambda: (lambda got: got[1] if got[0] == status and text in got[1] else None)(_get(url)),
        timeout=30.0,
        what=f"{text!r} at {url}",
        every=0.2,
    )


def test_reconcile_finds_a_key_with_a_session_on_two_nodes(cluster) -> None:
    """An older version started a key anew on another node while its node
    was away: two sessions, two histories. `list` through the router shows
    both, and `route reconcile` names the key, its nodes, and exits 1."""
    sups, router = cluster
    for sup in sups.values():  # each node's own session of one key, made directly
        with sup.client() as direct:
            assert direct.run("dup:1", "env HERMES_SESSION_KEY").text == "dup:1"
    with Client(router.state_dir, timeout=30.0) as c:
        assert c.run("one:1", "env HERMES_SESSION_KEY").text == "one:1"
        rows = [(r["key"], r["node"]) for r in c.sessions()]
    assert rows == [("dup:1", "a"), ("dup:1", "b"), ("one:1", owner("one:1"))]
    found = hs("route", "--state-dir", str(router.state_dir), "reconcile")
    assert found.returncode == 1, found.stderr + found.stdout
    assert "dup:1: 2 sessions" in found.stdout
    assert "  node a: idle" in found.stdout and "  node b: idle" in found.stdout
    assert "one:1" not in found.stdout
    assert "1 key(s) with more than one session" in found.stdout
