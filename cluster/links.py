"""The router's link to each node: one DEALER per node, as a remote front
end of that node (TCP + CURVE), watched by ZMTP heartbeats and a socket
monitor.

This module holds how a link is made (socket options, keys, the monitor
that reports its handshake and disconnects) and what makes a link a new
one (`reach`). What the router does with a link's events and messages
(routing, `node_lost`, joining watches, placement) is cluster/router.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import zmq
import zmq.asyncio

from hermes_sup.local.frames import HANDSHAKE_FAILURES

from .nodes import NodeSpec

# ZMTP heartbeats on node links: a node silent this long is lost, even
# when its host vanished without closing the TCP connection.
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 4000
# The most messages queued on one of the router's sockets (node links and
# front sockets alike).
SNDHWM = 100_000


class NodeLink:
    """The router's DEALER to one node, and whether its handshake succeeded."""

    def __init__(self, ctx: zmq.asyncio.Context, spec: NodeSpec) -> None:
        self.spec = spec
        self.live = False
        # What the node last said of its draining (drain answers, status,
        # `moved` for draining); the node list's `draining` counts too.
        self.draining = False
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # Queue only to a connection that is up: a request never waits in a
        # pipe for a node that may not come back (it gets node_lost instead).
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        sock.setsockopt(zmq.RCVHWM, SNDHWM)
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        sock.setsockopt(zmq.RECONNECT_IVL, 200)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        sock.curve_serverkey = spec.server_key.encode()
        sock.curve_publickey = spec.public.encode()
        sock.curve_secretkey = spec.secret.encode()
        self.monitor = sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILURES
        )
        sock.connect(spec.endpoint)
        self.sock = sock
        self.sync: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        self.reader: Callable[[], None] | None = None
        self.tasks: list[asyncio.Task[None]] = []

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)


def reach(spec: NodeSpec) -> tuple[str, str, bytes, str, str]:
    """What a link is made with: a change of any of it makes a new link."""
    return (spec.endpoint, spec.server_key, spec.hmac_key, spec.public, spec.secret)
