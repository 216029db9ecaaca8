"""The router's link to each node: one DEALER per node, as a remote front
end of that node (TCP + CURVE), watched by ZMTP heartbeats and a socket
monitor.

This module holds how a link is made (socket options, keys, the monitor
that reports its handshake and disconnects), whether it is live, and what
makes a link a new one (`reach`). Both sockets are read through
door/channel.py, as the router's front sockets are: in bounded batches,
straight from the event loop. What the router does with a link's messages
and its going up and down (routing, `node_lost`, joining watches,
placement) is cluster/router.py's and cluster/routing.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from hermes_sup.door.channel import Channel
from hermes_sup.local.frames import HANDSHAKE_FAILURES
from hermes_sup.local.logfmt import kv

from .nodes import NodeSpec

log = logging.getLogger("hermes_sup.router")

# ZMTP heartbeats on node links: a node silent this long is lost, even
# when its host vanished without closing the TCP connection.
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 4000
# A node that accepts the TCP connection and then says nothing (frozen) is
# given up this long after it was reached, and tried again.
HANDSHAKE_IVL_MS = 10_000
# The most messages queued on a node link, each way.
SNDHWM = 100_000


class NodeLink:
    """The router's DEALER to one node, and whether its handshake succeeded.

    `on_message(link, frames)` gets what the node sends; `on_live(link,
    live)` is called when the link comes up (a handshake succeeded) and
    when it drops (a disconnect, or heartbeats missed)."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        spec: NodeSpec,
        loop: asyncio.AbstractEventLoop,
        on_message: Callable[[NodeLink, list[bytes]], None],
        on_live: Callable[[NodeLink, bool], None],
    ) -> None:
        self.spec = spec
        self.live = False
        self.losses = 0  # times the link went down once up (for the metrics)
        self.on_live = on_live
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # Queue only to a connection that is up: a request never waits in a
        # pipe for a node that may not come back (it gets node_lost instead).
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        sock.setsockopt(zmq.RCVHWM, SNDHWM)
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
        sock.setsockopt(zmq.RECONNECT_IVL, 200)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        sock.curve_serverkey = spec.server_key.encode()
        sock.curve_publickey = spec.public.encode()
        sock.curve_secretkey = spec.secret.encode()
        monitor = sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILURES
        )
        self.sock = sock
        self.monitor = Channel(monitor, self._on_monitor, loop)
        self.channel = Channel(sock, lambda frames: on_message(self, frames), loop)
        sock.connect(spec.endpoint)

    @property
    def name(self) -> str:
        return self.spec.name

    def send(self, frames: list[bytes]) -> bool:
        """Send without blocking; False if the node cannot take it now (no
        connection up, IMMEDIATE; or its queue is full)."""
        try:
            self.channel.send(frames)
        except zmq.Again:
            return False
        return True

    def _on_monitor(self, frames: list[bytes]) -> None:
        """Live from a successful handshake to a disconnect (or heartbeat timeout)."""
        parsed = parse_monitor_message(frames)
        event = parsed["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.live = True
            log.info(kv("router_node_up", node=self.name))
            self.on_live(self, True)
        elif event == zmq.EVENT_DISCONNECTED:
            if self.live:
                self.losses += 1
                log.warning(kv("router_node_lost", node=self.name))
            self.live = False
            self.on_live(self, False)
        else:
            log.warning(
                kv(
                    "router_node_handshake_failed",
                    node=self.name,
                    reason=handshake_failure(event, parsed["value"]),
                    server_public=self.spec.server_key,
                )
            )

    def close(self) -> None:
        """Stop reading, and close both sockets at once (linger 0)."""
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()
        self.monitor.close()
        self.channel.close()


def handshake_failure(event: int, value: int) -> str:
    """Why a node's handshake failed, as its monitor event tells: a node that
    refused the router's key answers at once; one that is frozen (stopped,
    or its loop stuck) accepts the TCP connection and then says nothing
    until the handshake times out, which zmq reports with no detail."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"the node refused the router's CURVE key (status {value})"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return (
            "the handshake broke the protocol: the node's server key is not the one "
            "registered, or it is not a hermes-sup node"
        )
    why = os.strerror(value) if value > 0 else "no answer"
    return f"the node did not complete the handshake ({why}): it may be frozen, overloaded, or gone"


def reach(spec: NodeSpec) -> tuple[str, str, bytes, str, str]:
    """What a link is made with: a change of any of it makes a new link."""
    return (spec.endpoint, spec.server_key, spec.hmac_key, spec.public, spec.secret)
