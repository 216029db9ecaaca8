"""Watching a router: Prometheus metrics and a health check on one small
HTTP endpoint (`route --metrics [HOST:]PORT`, 127.0.0.1 by default).

    GET /metrics   Prometheus text: nodes known and linked (one gauge per
                   node), requests in flight, key overrides, and counters
                   of requests taken and of node links lost
    GET /healthz   200 "ok ..." while the router's loop runs and at least
                   one node is linked; 503 with the reason otherwise (a
                   load balancer, or a front end choosing between two
                   routers, reads it)

The router's loop writes a `RouterSnapshot` once a second; the HTTP server,
in its own thread, only reads the last one, so a scrape never touches the
routing table. A loop that stopped writing (stuck) is unhealthy after
STALE_AFTER seconds.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

STALE_AFTER = 5.0  # seconds without a snapshot before the router is unhealthy
# Connections served at once (a thread each); more are closed at once, so
# that whoever can reach the port cannot make the router start threads
# without end. One that sends nothing is closed after IDLE_TIMEOUT.
MAX_CONNECTIONS = 16
IDLE_TIMEOUT = 5.0


@dataclass(frozen=True)
class RouterSnapshot:
    """What the router's loop last said of itself."""

    at: float = field(default_factory=time.monotonic)
    nodes: dict[str, bool] = field(default_factory=dict)  # name: linked
    pending: int = 0
    overrides: int = 0
    requests: int = 0
    node_losses: int = 0


def health(snap: RouterSnapshot, now: float) -> tuple[bool, str]:
    """Whether the router can route now, and a line saying why (not)."""
    linked = sum(snap.nodes.values())
    if now - snap.at > STALE_AFTER:
        return False, f"the router's loop has not run for {now - snap.at:.0f}s"
    if not linked:
        return False, f"no node linked (of {len(snap.nodes)} known)"
    return True, f"ok: {linked} of {len(snap.nodes)} node(s) linked"


def render(snap: RouterSnapshot) -> bytes:
    """The Prometheus text exposition of a snapshot."""
    out = [
        "# HELP hermes_sup_router_nodes Nodes the router knows of",
        "# TYPE hermes_sup_router_nodes gauge",
        f"hermes_sup_router_nodes {len(snap.nodes)}",
        "# HELP hermes_sup_router_node_linked 1 while the router's link to the node is up",
        "# TYPE hermes_sup_router_node_linked gauge",
    ]
    for name, linked in sorted(snap.nodes.items()):
        out.append(f'hermes_sup_router_node_linked{{node="{_label(name)}"}} {int(linked)}')
    for name, kind, help_text, value in (
        ("pending_requests", "gauge", "Requests forwarded and not yet answered", snap.pending),
        ("overrides", "gauge", "Keys placed off their hashed node", snap.overrides),
        ("requests_total", "counter", "Requests taken from front ends", snap.requests),
        ("node_losses_total", "counter", "Node links that went down", snap.node_losses),
    ):
        out += [
            f"# HELP hermes_sup_router_{name} {help_text}",
            f"# TYPE hermes_sup_router_{name} {kind}",
            f"hermes_sup_router_{name} {value}",
        ]
    return ("\n".join(out) + "\n").encode()


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class _BoundedServer(ThreadingHTTPServer):
    """A thread per connection, MAX_CONNECTIONS at most."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: Any) -> None:
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class RouterWatch:
    """The HTTP endpoint, serving the last snapshot from its own thread."""

    def __init__(self) -> None:
        self.snapshot = RouterSnapshot()
        self.server: ThreadingHTTPServer | None = None

    def serve(self, host: str, port: int) -> str:
        """Bind and serve in a daemon thread; the URL it is at."""
        watch = self

        class Handler(BaseHTTPRequestHandler):
            timeout = IDLE_TIMEOUT

            def do_GET(self) -> None:  # noqa: N802 - the http.server name
                path = self.path.split("?")[0]
                if path == "/metrics":
                    self._answer(200, render(watch.snapshot), "text/plain; version=0.0.4")
                elif path == "/healthz":
                    ok, why = health(watch.snapshot, time.monotonic())
                    self._answer(200 if ok else 503, (why + "\n").encode(), "text/plain")
                else:
                    self._answer(404, b"/metrics or /healthz\n", "text/plain")

            def _answer(self, code: int, body: bytes, kind: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass  # scrapes are not news

        self.server = _BoundedServer((host, port), Handler)
        threading.Thread(
            target=self.server.serve_forever, daemon=True, name="hermes-sup-router-watch"
        ).start()
        return f"http://{host}:{self.server.server_address[1]}"

    def close(self) -> None:
        """Stop serving."""
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
