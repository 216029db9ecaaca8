"""The router's log tells a frozen node from one that refused its key: a
real link to a listener that accepts the TCP connection and never speaks
(what a stopped process does), and the reasons for each failure kind."""

from __future__ import annotations

import asyncio
import http.client
import logging
import socket
import urllib.error
import urllib.request

import pytest
import zmq

from hermes_sup.cluster import links, router_watch
from hermes_sup.cluster.nodes import NodeSpec

from . import waiting


def test_each_failure_kind_has_its_own_reason() -> None:
    refused = links.handshake_failure(zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400)
    broken = links.handshake_failure(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, 0x11000001)
    silent = links.handshake_failure(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 0)
    assert "refused the router's CURVE key" in refused
    assert "server key" in broken and "refused" not in broken
    assert "frozen" in silent and "refused" not in silent


def test_a_node_that_accepts_and_never_speaks_is_logged_as_maybe_frozen(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(links, "HANDSHAKE_IVL_MS", 200)
    public, secret = zmq.curve_keypair()
    server, _ = zmq.curve_keypair()
    with socket.socket() as frozen:
        frozen.bind(("127.0.0.1", 0))
        frozen.listen(8)  # the kernel completes the TCP handshake; nobody answers
        port = frozen.getsockname()[1]
        spec = NodeSpec(
            "frozen", f"tcp://127.0.0.1:{port}", server.decode(), b"k" * 32,
            public.decode(), secret.decode(),
        )  # fmt: skip
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()

        async def watch() -> None:
            loop = asyncio.get_running_loop()
            link = links.NodeLink(ctx, spec, loop, lambda *_: None, lambda *_: None)
            deadline = loop.time() + 10 * waiting.load_factor()
            try:
                while "router_node_handshake_failed" not in caplog.text:
                    assert loop.time() < deadline, "no handshake failure logged"
                    await asyncio.sleep(0.05)
            finally:
                link.close()

        with caplog.at_level(logging.WARNING, logger="hermes_sup.router"):
            try:
                asyncio.run(watch())
            finally:
                ctx.term()
    assert "may be frozen" in caplog.text and "refused" not in caplog.text


def _get(url: str) -> tuple[int, str] | None:
    """Status and body, or None if the connection was closed unanswered."""
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except (urllib.error.URLError, ConnectionError, http.client.RemoteDisconnected):
        return None


def test_the_health_endpoint_serves_a_bounded_number_of_connections() -> None:
    """Whoever reaches the port (a session's shell on the router's host)
    cannot make it start threads without end: past MAX_CONNECTIONS idle
    connections a new one is closed unanswered; once they go, it answers."""
    watch = router_watch.RouterWatch()
    url = watch.serve("127.0.0.1", 0)
    idle: list[socket.socket] = []
    try:
        assert _get(url + "/healthz") == (503, "no node linked (of 0 known)\n")
        watch.snapshot = router_watch.RouterSnapshot(nodes={"a": True, "b": False})
        assert _get(url + "/healthz") == (200, "ok: 1 of 2 node(s) linked\n")
        host, port = url.removeprefix("http://").split(":")
        for _ in range(router_watch.MAX_CONNECTIONS):
            idle.append(socket.create_connection((host, int(port)), timeout=5))
        # The server takes the idle ones in its own time: wait for the refusal.
        waiting.wait_for(lambda: _get(url + "/healthz") is None, what="a refusal")
        for sock in idle:
            sock.close()
        idle.clear()
        got = waiting.wait_for(lambda: _get(url + "/healthz"), what="an answer again")
        assert got[0] == 200
    finally:
        for sock in idle:
            sock.close()
        watch.close()


def test_metrics_text_names_each_node() -> None:
    text = router_watch.render(
        router_watch.RouterSnapshot(nodes={'we"ird': True}, pending=3, requests=9)
    ).decode()
    assert 'hermes_sup_router_node_linked{node="we\\"ird"} 1' in text
    assert "hermes_sup_router_pending_requests 3" in text
    assert "hermes_sup_router_requests_total 9" in text
