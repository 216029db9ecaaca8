"""A session's network, tried from its own shell: only `lo` of its own, the
host's loopback and a neighbour's listeners out of reach, nothing of the
host in its /proc/net, and out only through the supervisor's proxy, by
policy. Real supervisors (as root and as an unprivileged service user),
real workers, real shells; every byte stays on 127.0.0.x or inside the
sessions' own namespaces."""

from __future__ import annotations

import base64
import http.server
import os
import re
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from hermes_sup.local.addresses import SESSION_PROXY_PORT
from hermes_sup.supervisor.proxy import MAX_SESSION_CONNECTIONS

from .test_hostile_session import Lab, free_port, python, refused, require_sealed, start_lab, tries
from .test_sealed import sh
from .waiting import wait_for

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="starts supervisors as root and as nobody"),
]

HOST_SECRET = "host-only-secret-41c9"
TOKEN = "metrics-token-93be"
# The allowed service listens on another loopback address than 127.0.0.1,
# which NO_PROXY sends direct (to the session's own loopback).
ALLOWED_HOST = "127.0.0.2"


class Answering(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        body = f"{self.server.says} {self.path}\n".encode()  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def serve(host: str, says: str) -> http.server.ThreadingHTTPServer:
    """An HTTP service on the host's loopback, in a thread of the test."""
    server = http.server.ThreadingHTTPServer((host, 0), Answering)
    server.says = says  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


class Net:
    """A lab with a host-only service, an allowed one, and metrics."""

    def __init__(
        self,
        lab: Lab,
        secret: http.server.ThreadingHTTPServer,
        allowed: http.server.ThreadingHTTPServer,
        metrics_port: int,
    ) -> None:
        self.lab, self.secret, self.allowed, self.metrics_port = lab, secret, allowed, metrics_port

    @property
    def secret_port(self) -> int:
        return int(self.secret.server_address[1])

    @property
    def allowed_port(self) -> int:
        return int(self.allowed.server_address[1])

    def scrape(self, token: str | None) -> tuple[int, str]:
        request = urllib.request.Request(f"http://127.0.0.1:{self.metrics_port}/metrics")
        if token is not None:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return answer.status, answer.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, ""


@pytest.fixture(params=["root", "user"])
def net(request, supervisor_factory, workdir: Path) -> Iterator[Net]:  # noqa: ANN001
    secret, allowed = serve("127.0.0.1", HOST_SECRET), serve(ALLOWED_HOST, "allowed")
    token_file = workdir / "metrics.token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    metrics_port = free_port()
    try:
        lab = start_lab(
            supervisor_factory,
            workdir,
            request.param,
            "--egress-allow",
            f"{ALLOWED_HOST}/32:{allowed.server_address[1]}",
            "--metrics",
            str(metrics_port),
            "--metrics-token-file",
            str(token_file),
        )
        require_sealed(lab)
        yield Net(lab, secret, allowed, metrics_port)
    finally:
        for server in (secret, allowed):
            server.shutdown()
            server.server_close()


def connect(host: str, port: int) -> str:
    """A shell command that connects straight to host:port and prints
    what it reads; it fails where it cannot connect."""
    return python(f"""
        import socket
        s = socket.create_connection(("{host}", {port}), timeout=5)
        s.sendall(b"GET / HTTP/1.0\\r\\n\\r\\n")
        print(s.recv(4096).decode(errors="replace"))
        """)


def test_the_hosts_loopback_and_a_neighbours_listener_are_unreachable(net: Net) -> None:
    port = free_port()
    with net.lab.client() as client:
        # The neighbour: a listener of its own on its loopback, left running.
        # Listening before the shell's command ends (the socket is bound
        # here, then handed to the child that serves it): no wait needed.
        serve = (
            "import socket, sys\n"
            "s = socket.socket(fileno=int(sys.argv[1]))\n"
            "while True:\n"
            "    c = s.accept()[0]; c.sendall(b'neighbour-secret'); c.close()\n"
        )
        listener = python(f"""
            import socket, subprocess, sys
            s = socket.socket()
            s.bind(("127.0.0.1", {port}))
            s.listen()
            subprocess.Popen([sys.executable, "-c", {serve!r}, str(s.fileno())],
                             pass_fds=[s.fileno()], start_new_session=True,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
            """)
        own = tries(client, "neighbour", {"listen": listener})
        assert not refused(own["listen"]), own
        ours = tries(client, "neighbour", {"own": connect("127.0.0.1", port)})
        assert "neighbour-secret" in str(ours["own"]), ours  # it listens, in its own namespace
        got = tries(
            client,
            "attacker",
            {
                "host": connect("127.0.0.1", net.secret_port),
                "neighbour": connect("127.0.0.1", port),
                "metrics": connect("127.0.0.1", net.metrics_port),
                "curl_host": f"curl -sS --max-time 5 http://127.0.0.1:{net.secret_port}/",
            },
        )
    for name, lines in got.items():
        assert refused(lines), (name, lines)
    assert HOST_SECRET not in str(got) and "neighbour-secret" not in str(got)


def test_the_sessions_proc_net_shows_no_socket_of_the_host(net: Net) -> None:
    state = str(net.lab.state_dir)
    with net.lab.client() as client:
        got = tries(
            client,
            "prober",
            {
                "tcp": "cat /proc/net/tcp /proc/net/tcp6",
                "unix": "cat /proc/net/unix",
                "links": "cat /proc/net/dev",
            },
        )
    tcp_ports = {
        int(m.group(1), 16)
        for m in re.finditer(r"^\s*\d+: [0-9A-F]+:([0-9A-F]{4}) ", "\n".join(got["tcp"]), re.M)
    }
    # Only the proxy's listener (and the probe's own connections) are there.
    assert tcp_ports <= {SESSION_PROXY_PORT}, got["tcp"]
    assert net.secret_port not in tcp_ports and net.metrics_port not in tcp_ports
    # The worker's own connection to the supervisor is listed (by the path
    # it connected to); no other socket of the host is.
    rows = [line.split() for line in got["unix"][1:-1]]
    paths = {row[7] for row in rows if len(row) > 7}
    assert paths <= {f"{state}/workers.sock"}, got["unix"]
    assert len(rows) < 10, got["unix"]
    devices = [line.split(":")[0].strip() for line in got["links"] if ":" in line]
    assert devices == ["lo"], got["links"]


def test_an_allowed_destination_is_reached_through_the_proxy_unchanged(net: Net) -> None:
    url = f"http://{ALLOWED_HOST}:{net.allowed_port}/hello"
    with net.lab.client() as client:
        got = tries(
            client,
            "client",
            {
                "env": "env | grep -i _proxy= | sort",
                "curl": f"curl -sS --max-time 10 {url}",
                "curl_connect": f"curl -sS --max-time 10 --proxytunnel {url}",
                "urllib": python(f"""
                    import urllib.request
                    print(urllib.request.urlopen("{url}", timeout=10).read().decode())
                    """),
            },
        )
    proxy = f"http://127.0.0.1:{SESSION_PROXY_PORT}"
    assert f"HTTPS_PROXY={proxy}" in got["env"] and "NO_PROXY=localhost,127.0.0.1,::1" in got["env"]
    for name in ("curl", "curl_connect", "urllib"):
        assert got[name][0] == "allowed /hello" and got[name][-1] == "rc=0", (name, got[name])


def test_a_denied_destination_is_refused_logged_and_counted(net: Net) -> None:
    with net.lab.client() as client:
        got = tries(
            client,
            "denied",
            {
                # Not allowed: the allowed service's address on another port,
                # the host's 127.0.0.1 (through the proxy), a metadata address.
                "other_port": f"curl -sS -f --max-time 10 http://{ALLOWED_HOST}:{net.secret_port}/",
                "host": f"curl -sS -f --max-time 10 -x $HTTP_PROXY --noproxy '' http://127.0.0.1:{net.secret_port}/",
                "metrics": f"curl -sS -f --max-time 10 -x $HTTP_PROXY --noproxy '' http://127.0.0.1:{net.metrics_port}/metrics",
                "metadata": "curl -sS -f --max-time 10 -p http://169.254.169.254/latest/meta-data/",
            },
        )
    for name, lines in got.items():
        assert refused(lines), (name, lines)
    assert HOST_SECRET not in str(got) and "hermes_sup_" not in str(got)
    log = net.lab.sup.log()  # type: ignore[attr-defined]
    assert f"egress_denied session=denied host=127.0.0.1 port={net.secret_port}" in log
    assert "host=169.254.169.254 port=80" in log and "reason=link_local" in log
    status, text = net.scrape(TOKEN)
    assert status == 200
    counted = dict(re.findall(r'hermes_sup_egress_denied_total\{reason="(\w+)"\} (\S+)', text))
    assert float(counted.get("loopback", 0)) >= 2 and float(counted.get("link_local", 0)) >= 1, (
        counted
    )


def test_the_metrics_port_wants_its_token(net: Net) -> None:
    assert net.scrape(None)[0] == 401
    assert net.scrape("wrong")[0] == 401
    basic = base64.b64encode(f"prometheus:{TOKEN}".encode()).decode()
    request = urllib.request.Request(f"http://127.0.0.1:{net.metrics_port}/metrics")
    request.add_header("Authorization", f"Basic {basic}")
    with urllib.request.urlopen(request, timeout=10) as answer:
        assert answer.status == 200 and "hermes_sup_sessions" in answer.read().decode()


def test_listeners_are_closed_with_their_workers(net: Net) -> None:
    """Each worker's listener (and its network namespace) goes with it:
    the supervisor holds no more descriptors after many sessions than
    after a few."""
    sup = psutil.Process(net.lab.sup.pid)  # type: ignore[attr-defined]

    def cycle(count: int, prefix: str) -> None:
        with net.lab.client() as client:
            for i in range(count):
                assert client.run(f"{prefix}{i}", "echo hi").ok
                client.kill(f"{prefix}{i}")

    cycle(3, "warm")
    wait_for(lambda: len(sup.children()) >= 2, timeout=30)
    baseline = sup.num_fds()
    cycle(24, "many")
    # Spares are forked again in the background: let them settle.
    wait_for(lambda: sup.num_fds() <= baseline + 4, timeout=30)


FLOOD_PROXY = """
import socket
held, refused = [], 0
for _ in range(100):
    s = socket.create_connection(("127.0.0.1", PORT), timeout=10)
    s.settimeout(0.3)
    try:
        if s.recv(100).startswith(b"HTTP/1.1 503"):
            refused += 1
            s.close()
            continue
    except socket.timeout:
        pass  # still open: held by the proxy, waiting for a request
    held.append(s)
print("held", len(held), "refused", refused, flush=True)
"""


def test_a_session_cannot_take_the_supervisors_descriptors_through_its_proxy(net: Net) -> None:
    """A session opens connections to its proxy without end: it holds at
    most its share, the rest are refused at once, and the supervisor keeps
    serving everyone with its descriptors."""
    sup = psutil.Process(net.lab.sup.pid)  # type: ignore[attr-defined]
    with net.lab.client() as client:
        client.run("bystander", "echo hi")
        client.run("flooder", "echo hi")
        wait_for(lambda: len(sup.children()) >= 4, timeout=30)  # 2 sessions, 2 spares
        before = sup.num_fds()
        command = python(FLOOD_PROXY.replace("PORT", str(SESSION_PROXY_PORT)))
        text, lines = sh(client, "flooder", command)
        out = "\n".join(lines)
        assert f"held {MAX_SESSION_CONNECTIONS} refused {100 - MAX_SESSION_CONNECTIONS}" in out, out
        assert client.run("bystander", "echo still").ok
    wait_for(lambda: sup.num_fds() <= before + 8, timeout=30)
