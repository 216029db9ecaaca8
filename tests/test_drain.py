"""Draining a node: its running turns finish, new sessions are refused with
`moved` (reason `draining`, for a router to send elsewhere), idle sessions
are stopped (their leases given up), `status` says so; undraining takes new
sessions again. Real supervisor, real workers, and the CLI."""

from __future__ import annotations

import os
import threading

import pytest
from click.testing import CliRunner

from hermes_sup.cli.main import cli
from hermes_sup.client import Reply, SupervisorError
from hermes_sup.protocol import Kind, Message, session_dir_name
from hermes_sup.supervisor import leases
from tests.test_leases import raw_request, two_nodes, wait_for

pytestmark = pytest.mark.e2e


def state_of(client, key: str) -> str | None:  # noqa: ANN001
    return next((r["state"] for r in client.sessions() if r["key"] == key), None)


def test_drain_finishes_turns_refuses_new_sessions_and_stops_idle_ones(supervisor_factory, workdir):
    (sup,) = two_nodes(supervisor_factory, workdir, "node-a")
    with sup.client(timeout=30.0) as client:
        assert client.run("idle", "pid").ok
        idle_dir = sup.data_dir / "sessions" / session_dir_name("idle")
        node = client.status()["node"]
        assert node == {
            "name": "node-a",
            "draining": False,
            "capacity": node["capacity"],
            "sessions": 1,
        }
        assert node["capacity"] >= 1

        # A turn that is running when the drain starts.
        answers: list[object] = []
        turn = threading.Thread(
            target=lambda: answers.append(_run(sup, "busy", "sleep 2")), daemon=True
        )
        turn.start()
        wait_for(lambda: state_of(client, "busy") == "busy", what="busy turn running")

        drained = client.request(Kind.DRAIN, {"on": True}).body["node"]
        assert drained["name"] == "node-a" and drained["draining"] is True

        # A new key is refused, with what a router needs to send it elsewhere.
        with pytest.raises(SupervisorError) as err:
            client.run("newcomer", "pid")
        assert err.value.code == "moved" and "draining" in err.value.message
        answer = raw_request(sup, Message(Kind.SEND, {"text": "pid"}, session="newcomer"))
        assert answer.body["code"] == "moved" and answer.body["reason"] == "draining"
        assert not (sup.data_dir / "sessions" / session_dir_name("newcomer")).exists()

        # The idle session is stopped, and lets its lease go.
        wait_for(lambda: state_of(client, "idle") == "exited", what="idle session stopped")
        assert leases.Leases("other").holder_elsewhere(idle_dir) is None
        with pytest.raises(SupervisorError) as err:
            client.run("idle", "pid")  # a new worker would be a new session here
        assert err.value.code == "moved"

        # The running turn finished with its answer; then its session stopped too.
        turn.join(30)
        assert len(answers) == 1 and isinstance(answers[0], Reply) and answers[0].ok
        wait_for(lambda: state_of(client, "busy") == "exited", what="busy session stopped")
        status = client.status()
        assert status["node"]["draining"] is True and status["node"]["sessions"] == 0

        # Undrain: new sessions are welcome again.
        assert client.request(Kind.DRAIN, {"on": False}).body["node"]["draining"] is False
        assert client.run("newcomer", "env HERMES_SESSION_KEY").text == "newcomer"
        assert client.status()["node"]["draining"] is False
        assert {r["node"] for r in client.sessions()} == {"node-a"}


def _run(sup, key: str, text: str) -> object:  # noqa: ANN001
    try:
        with sup.client(timeout=30.0) as client:
            return client.run(key, text)
    except SupervisorError as exc:
        return exc


def test_drain_from_the_command_line(supervisor_factory, workdir):
    (sup,) = two_nodes(supervisor_factory, workdir, "node-a")
    with sup.client() as client:
        assert client.run("s1", "pid").ok
    runner = CliRunner()
    state = ["--state-dir", str(sup.state_dir)]
    result = runner.invoke(cli, [*state, "drain", "--wait", "--timeout", "30"])
    assert result.exit_code == 0, result.output
    assert "node node-a draining" in result.output and "drained: no session left" in result.output
    result = runner.invoke(cli, [*state, "status"])
    assert result.exit_code == 0 and "DRAINING" in result.output and "node-a" in result.output
    result = runner.invoke(cli, [*state, "drain", "--off"])
    assert result.exit_code == 0 and "taking new sessions again" in result.output
    result = runner.invoke(cli, [*state, "status"])
    assert "DRAINING" not in result.output
    with sup.client() as client:
        assert client.run("s2", "pid").ok
    assert os.path.isdir(sup.data_dir / "sessions" / session_dir_name("s2"))


def test_drain_naming_another_node_is_refused(supervisor_factory, workdir):
    (sup,) = two_nodes(supervisor_factory, workdir, "node-a")
    with sup.client() as client:
        with pytest.raises(SupervisorError) as err:
            client.request(Kind.DRAIN, {"on": True, "node": "node-b"})
        assert err.value.code == "bad_field" and "node-a" in err.value.message
        assert client.status()["node"]["draining"] is False


def test_list_shows_a_node_column_only_for_rows_of_several_nodes() -> None:
    from hermes_sup.cli.show import session_table

    def row(key: str, node: str) -> dict[str, object]:
        return {
            "key": key,
            "state": "idle",
            "pid": 10,
            "started": 0.0,
            "last_activity": 0.0,
            "turns": 1,
            "rss": None,
            "cpu_percent": None,
            "runtime": "probe",
            "node": node,
        }

    one = session_table([row("a", "n1"), row("b", "n1")], False, 100.0)
    assert "NODE" not in one[0]
    many = session_table([row("a", "node-one"), row("b", "node-two")], False, 100.0)
    assert "NODE" in many[0]
    assert many[1].rstrip().endswith("node-one") and many[2].rstrip().endswith("node-two")


def test_metrics_name_the_node_and_its_drain(supervisor_factory, workdir):
    import socket
    import urllib.request

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    root = workdir / "m"
    root.mkdir()
    (root / "c.toml").write_text(f'node = "node-m"\nmetrics = "{port}"\n')
    sup = supervisor_factory("--config", str(root / "c.toml"), root=root)

    def scrape() -> str:
        url = f"http://127.0.0.1:{port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.read().decode()

    text = scrape()
    assert 'hermes_sup_node_info{node="node-m"} 1.0' in text
    assert "hermes_sup_node_draining 0.0" in text
    with sup.client() as client:
        client.request(Kind.DRAIN, {})  # `on` defaults to true
        assert client.status()["node"]["draining"] is True
    assert "hermes_sup_node_draining 1.0" in scrape()


def test_only_a_routers_key_drains_over_tcp_and_loses_that_when_revoked(
    supervisor_factory, workdir
):
    """Over TCP, the supervisor tells a request's CURVE key by its ZAP
    User-Id: a key enrolled as `router-*` may drain the node, another
    front end's may not, and a router key revoked after it connected loses
    that right on the connection it already has."""
    import subprocess
    import sys

    from hermes_sup.client import Client

    from .test_clients import free_port

    port = free_port()
    root = workdir / "t"
    root.mkdir()
    (root / "c.toml").write_text('node = "node-t"\n')
    sup = supervisor_factory("--tcp", str(port), "--config", str(root / "c.toml"), root=root)

    def keys(*args: str) -> None:
        made = subprocess.run(
            [sys.executable, "-m", "hermes_sup.cli", "keys", *args,
             "--data-dir", str(sup.data_dir)],
            capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        assert made.returncode == 0, made.stderr

    for name in ("web", "router-r1"):
        keys("generate", name, "--endpoint", f"127.0.0.1:{port}", "-o", str(workdir / name))
    with Client.from_connection_file(workdir / "web", timeout=30.0) as web:
        assert web.run("w1", "pid").ok  # an ordinary front end, served as ever
        with pytest.raises(SupervisorError) as refused:
            web.request(Kind.DRAIN, {"on": True})
        assert refused.value.code == "unknown_kind" and "'web'" in refused.value.message
    with sup.client() as local:
        assert local.status()["node"]["draining"] is False
        with Client.from_connection_file(workdir / "router-r1", timeout=30.0) as router:
            node = router.request(Kind.DRAIN, {"on": True, "node": "node-t"}).body["node"]
            assert (node["name"], node["draining"]) == ("node-t", True)
            assert local.status()["node"]["draining"] is True
            assert router.request(Kind.DRAIN, {"on": False}).body["node"]["draining"] is False
            keys("revoke", "router-r1")
            with pytest.raises(SupervisorError) as revoked:
                router.request(Kind.DRAIN, {"on": True})
            assert revoked.value.code == "unknown_kind"
        assert local.status()["node"]["draining"] is False
