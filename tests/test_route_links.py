"""The router's log tells a frozen node from one that refused its key: a
real link to a listener that accepts the TCP connection and never speaks
(what a stopped process does), and the reasons for each failure kind."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest
import zmq

from hermes_sup.cluster import links
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
