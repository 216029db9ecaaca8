"""The socket plumbing both clients share: connecting a DEALER (with CURVE
and a handshake monitor for a remote supervisor), closing it, and telling
why a CURVE handshake was refused.

`Client` (blocking) and `AsyncClient` (asyncio) each drive their sockets
their own way; only making and closing them is common, and it lives here so
that neither transport imports the other.
"""

from __future__ import annotations

import os
from typing import Any

import zmq

from hermes_sup.local.frames import HANDSHAKE_FAILURES

from .connection import Connection

# How often a waiting client checks that a local supervisor is still there:
# the longest either client waits on its socket at a time.
LIVENESS_SLICE = 2.0


def make_socket(
    ctx: zmq.Context[Any], conn: Connection
) -> tuple[zmq.Socket[Any], zmq.Socket[Any] | None]:
    """A connected DEALER and, for CURVE, a socket of the same context that
    reports failed handshakes."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = None
    try:
        if conn.curve is not None:
            sock.curve_serverkey = conn.curve.server_public.encode()
            sock.curve_publickey = conn.curve.public.encode()
            sock.curve_secretkey = conn.curve.secret.encode()
            addr = f"inproc://hermes-sup-monitor-{os.urandom(8).hex()}"
            sock.monitor(addr, HANDSHAKE_FAILURES)
            monitor = ctx.socket(zmq.PAIR)
            monitor.setsockopt(zmq.LINGER, 0)
            monitor.connect(addr)
        sock.connect(conn.endpoint)
    except Exception:
        if monitor is not None:
            monitor.close(0)
        sock.close(0)
        raise
    return sock, monitor


def close_socket(sock: zmq.Socket[Any], monitor: zmq.Socket[Any] | None) -> None:
    """Close a socket from `make_socket` and its monitor at once (linger 0)."""
    if monitor is not None:
        sock.disable_monitor()
        monitor.close(0)
    sock.close(0)


def refused(monitor: Any) -> str | None:
    """Why the supervisor refused our CURVE handshake, if it did."""
    if monitor is None:
        return None
    from zmq.utils.monitor import recv_monitor_message

    reason = None
    while monitor.poll(0):
        event = recv_monitor_message(monitor)
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            reason = (
                "the supervisor refused this client's CURVE key: it is not in the "
                "supervisor's allowlist (revoked, or never allowed). On the supervisor's "
                "host, `hermes-sup keys list` shows who is allowed and `hermes-sup keys "
                "generate NAME --endpoint HOST:PORT` makes a new connection file"
            )
        else:
            reason = (
                "the CURVE handshake with the supervisor failed: wrong server key, or the "
                "endpoint does not speak CURVE"
            )
    return reason
