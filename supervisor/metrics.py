"""An optional Prometheus endpoint (prometheus-client), on 127.0.0.1 by default.

Counters and histograms are updated as things happen; gauges (sessions by
state, queued turns, the supervisor's own memory and descriptors) are read
when Prometheus scrapes, never by a background loop. The HTTP server runs
in prometheus-client's own thread and only reads the supervisor's state.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import logging
import socket
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger("hermes_sup.supervisor")


def parse_address(text: str) -> tuple[str, int]:
    """'9464' or 'HOST:PORT' -> (host, port); a bare port binds 127.0.0.1."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", text
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"metrics address {text!r} is not PORT or HOST:PORT")
    return host or "127.0.0.1", int(port)


def exit_category(
    reason: str, exit_code: int | None, signal_name: str | None, stopped: bool
) -> str:
    """A low-cardinality label for why a worker ended."""
    # The kernel's word first: on cgroup v1 the supervisor itself stops a
    # session the kernel OOM-killed in, which is no operator's stop.
    for words, label in (("by the kernel: oom", "oom"), ("refused it processes: pids", "pids")):
        if words in reason:
            return label
    if stopped:
        return "stopped"
    for words, label in (
        ("hung", "hung"),
        ("memory limit", "memory_limit"),
        ("process limit", "process_limit"),
        ("turn timeout", "turn_timeout"),
    ):
        if words in reason:
            return label
    if signal_name is not None:
        return f"signal_{signal_name.lower()}"
    if exit_code == 71:
        return "runtime_load_failed"
    if exit_code == 0:
        return "exited"
    return "crashed"


class Metrics:
    """The supervisor's metrics; `snapshot` is called at scrape time."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.spawns = Counter("hermes_sup_spawns", "Workers spawned", registry=self.registry)
        self.exits = Counter(
            "hermes_sup_exits", "Workers ended, by reason", ["reason"], registry=self.registry
        )
        self.turns = Counter(
            "hermes_sup_turns", "Turns finished, by outcome", ["outcome"], registry=self.registry
        )
        self.turn_seconds = Histogram(
            "hermes_sup_turn_seconds",
            "Turn duration, from dispatch to final answer",
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600),
            registry=self.registry,
        )
        self.routing_seconds = Histogram(
            "hermes_sup_routing_seconds",
            "From a turn's arrival to its dispatch to a worker (queueing and spawn included)",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1, 5, 30),
            registry=self.registry,
        )
        # Each destination a session was refused by the egress policy
        # (supervisor/egress.py), by the policy's reason: a handful of values.
        self.egress_denied = Counter(
            "hermes_sup_egress_denied",
            "Connections a session asked its egress proxy for and was refused, by reason",
            ["reason"],
            registry=self.registry,
        )
        # The model endpoint's use (model_gate.py), by HTTP key ("" for
        # sessions of no HTTP key): a label per key, never per session.
        self.model_requests = Counter(
            "hermes_sup_model_requests",
            "Model calls through the supervisor's model endpoint, by HTTP key and outcome",
            ["key", "outcome"],
            registry=self.registry,
        )
        self.model_tokens = Counter(
            "hermes_sup_model_tokens",
            "Model tokens the responses reported, by HTTP key and direction (input, output)",
            ["key", "direction"],
            registry=self.registry,
        )
        self.model_bytes = Counter(
            "hermes_sup_model_bytes",
            "Bytes through the model endpoint, by HTTP key and direction (in: from sessions)",
            ["key", "direction"],
            registry=self.registry,
        )
        # (node name, draining), read at scrape time; set by the Context.
        self.node_info: Callable[[], tuple[str, bool]] = lambda: ("", False)
        self.registry.register(_Gauges(snapshot, lambda: self.node_info()))
        self.server: Any = None

    def count_model_call(
        self, key: str | None, outcome: str, tokens: tuple[int, int], sent: int, received: int
    ) -> None:
        """One call through the model endpoint (`outcome`: ok or refused)."""
        label = key or ""
        self.model_requests.labels(label, outcome).inc()
        for direction, count in zip(("input", "output"), tokens, strict=True):
            if count:
                self.model_tokens.labels(label, direction).inc(count)
        self.model_bytes.labels(label, "in").inc(sent)
        self.model_bytes.labels(label, "out").inc(received)

    def serve(self, address: str, token: str | None = None) -> str:
        """Start the HTTP endpoint; returns its URL. With `token`, every
        request must carry it (`require_token`)."""
        from prometheus_client import make_wsgi_app, start_http_server

        host, port = parse_address(address)
        if token is None:
            self.server, _thread = start_http_server(port, addr=host, registry=self.registry)
        else:
            self.server = _serve_wsgi(
                host, port, require_token(make_wsgi_app(self.registry), token)
            )
        bound = self.server.server_address[1]
        return f"http://{host}:{bound}/metrics"

    def close(self) -> None:
        """Stop the HTTP endpoint."""
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


def read_token(path: str) -> str:
    """The metrics token in the file at `path`; ValueError saying what is wrong."""
    try:
        with open(path) as f:
            token = f.read().strip()
    except OSError as exc:
        raise ValueError(f"metrics token file {path}: {exc.strerror or exc}") from None
    if not token:
        raise ValueError(f"metrics token file {path} is empty")
    return token


def require_token(app: Any, token: str) -> Any:
    """A WSGI app answering 401 unless the request carries `token`, as
    `Authorization: Bearer TOKEN` or as basic auth's password (any user):
    Prometheus' `authorization.credentials_file` and `basic_auth.password_file`."""
    expected = token.encode()

    def guarded(environ: dict[str, Any], start_response: Any) -> Any:
        given = _credentials(environ.get("HTTP_AUTHORIZATION", ""))
        if given is not None and hmac.compare_digest(given, expected):
            return app(environ, start_response)
        start_response(
            "401 Unauthorized",
            [("Content-Type", "text/plain"), ("WWW-Authenticate", 'Basic realm="hermes-sup"')],
        )
        return [b"credentials required\n"]

    return guarded


def _credentials(header: str) -> bytes | None:
    """The secret an Authorization header carries (bearer token or basic
    password), or None."""
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() == "bearer":
        return value.strip().encode()
    if scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(value.strip(), validate=True)
        except (ValueError, binascii.Error):
            return None
        return decoded.partition(b":")[2]
    return None


def _serve_wsgi(host: str, port: int, app: Any) -> Any:
    """prometheus-client's threaded WSGI server, for an app of ours."""
    import threading
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    class Quiet(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass  # a scrape every few seconds is not news

    server = make_server(host, port, app, Server, handler_class=Quiet)
    threading.Thread(target=server.serve_forever, daemon=True, name="metrics").start()
    return server


class _Gauges:
    """Gauges computed at scrape time from the supervisor's own snapshot."""

    def __init__(
        self,
        snapshot: Callable[[], dict[str, Any]],
        node_info: Callable[[], tuple[str, bool]],
    ) -> None:
        self.snapshot = snapshot
        self.node_info = node_info

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        node, draining = self.node_info()
        # The node as an info metric (join on it), and whether it drains.
        info = GaugeMetricFamily(
            "hermes_sup_node_info", "This supervisor's node name (value 1)", labels=["node"]
        )
        info.add_metric([node], 1)
        yield info
        yield GaugeMetricFamily(
            "hermes_sup_node_draining",
            "1 while the node drains: no new sessions, idle ones stopped",
            value=int(draining),
        )
        snap = self.snapshot()
        states = GaugeMetricFamily("hermes_sup_sessions", "Sessions by state", labels=["state"])
        for state, count in snap["sessions"].items():
            states.add_metric([state], count)
        yield states
        for name, help_text in (
            ("queued_turns", "Turns waiting for a worker, all sessions"),
            ("max_sessions", "Live workers allowed"),
            ("spare_workers", "Workers forked ahead, waiting for a new session"),
            ("supervisor_rss_bytes", "Resident memory of the supervisor"),
            ("supervisor_open_fds", "Open file descriptors of the supervisor"),
        ):
            yield GaugeMetricFamily(f"hermes_sup_{name}", help_text, value=snap[name])
        yield from _cgroup_gauges(snap.get("session_cgroups") or {})


# Per-session gauges from each session's cgroup, and their help.
CGROUP_GAUGES = (
    ("memory", "session_memory_bytes", "Memory the kernel charges to the session's cgroup"),
    ("memory_max", "session_memory_max_bytes", "The session cgroup's memory.max"),
    ("pids", "session_tasks", "Processes and threads in the session's cgroup"),
    ("pids_max", "session_tasks_max", "The session cgroup's pids.max"),
    ("oom_kills", "session_oom_kills", "OOM kills in the session's cgroup (its worker's)"),
    ("pids_max_hits", "session_forks_refused", "Forks refused at the session's pids.max"),
)


def _cgroup_gauges(usage: dict[str, dict[str, int | None]]) -> Iterator[Any]:
    from prometheus_client.core import GaugeMetricFamily

    for field, name, help_text in CGROUP_GAUGES:
        family = GaugeMetricFamily(f"hermes_sup_{name}", help_text, labels=["session"])
        for key, use in usage.items():
            value = use.get(field)
            if value is not None:
                family.add_metric([key], value)
        yield family
