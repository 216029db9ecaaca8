"""The egress proxy with real sockets: a child of the test makes a network
namespace of its own (only `lo`, as a sealed worker's), hands its
listener over as worker/egress.py does, then tries, from inside, what a
session would. The proxy runs on this test's own loop, as on the
supervisor's."""

from __future__ import annotations

import asyncio
import ctypes
import fcntl
import json
import os
import socket
import struct
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hermes_sup.local.addresses import EGRESS_SOCKET, SESSION_PROXY_PORT
from hermes_sup.supervisor.egress import Policy
from hermes_sup.supervisor.proxy import EgressProxy
from hermes_sup.worker import egress as worker_egress

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
PROXY = f"http://127.0.0.1:{SESSION_PROXY_PORT}"


def own_network_namespace() -> None:
    """In a forked child: a network namespace of its own, `lo` up."""
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNET if uid == 0 else CLONE_NEWNET | CLONE_NEWUSER
    if libc.unshare(flags) != 0:
        raise OSError(ctypes.get_errno(), "unshare")
    if uid != 0:
        Path("/proc/self/setgroups").write_text("deny")
        Path("/proc/self/uid_map").write_text(f"{uid} {uid} 1\n")
        Path("/proc/self/gid_map").write_text(f"{gid} {gid} 1\n")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", b"lo", 0)
        flags_now = struct.unpack("16sH14x", fcntl.ioctl(s, SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags_now | IFF_UP))


def raw(request: bytes, then: bytes = b"") -> bytes:
    """Send `request` to the session's proxy (and `then` after its first
    answer); everything it answers."""
    with socket.create_connection(("127.0.0.1", SESSION_PROXY_PORT), timeout=20) as s:
        s.sendall(request)
        if then:
            first = s.recv(4096)
            s.sendall(then)
            return first + _read_all(s)
        return _read_all(s)


def _read_all(s: socket.socket) -> bytes:
    chunks = []
    while chunk := s.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def through_urllib(url: str) -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": PROXY}))
    try:
        with opener.open(url, timeout=20) as answer:
            return f"{answer.status} {answer.read().decode()}"
    except urllib.error.HTTPError as exc:
        return f"{exc.code} {exc.read().decode()}"


def in_child(state: Path, tries: Callable[[], dict[str, Any]]) -> tuple[int, int]:
    """Fork a child that enters its own namespace, hands its listener over,
    runs `tries` and writes their outcome to a pipe; (pid, read end)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            own_network_namespace()
            plan = {"network": "egress", "egress_socket": str(state / EGRESS_SOCKET)}
            result = {"handed": worker_egress.hand_over(plan), **tries()}
            code = 0
        except BaseException:
            result = {"error": traceback.format_exc()}
        finally:
            try:
                os.write(w, json.dumps(result).encode())
            finally:
                os._exit(code)
    os.close(w)
    return pid, r


async def outcome(pid: int, r: int) -> dict[str, Any]:
    """What the child wrote, once it has exited (reaped here)."""
    loop = asyncio.get_running_loop()
    _, status = await loop.run_in_executor(None, os.waitpid, pid, 0)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    result: dict[str, Any] = json.loads(data or b"{}")
    assert "error" not in result, result["error"]
    assert os.waitstatus_to_exitcode(status) == 0, result
    return result


async def fake_service(seen: list[bytes]) -> asyncio.Server:
    """An HTTP server on the host's 127.0.0.1 that says which path it was
    asked for (and keeps each request's head in `seen`)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        seen.append(head)
        path = head.split(b" ")[1]
        body = b"hello " + path
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0)


def fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture
def state(tmp_path: Path) -> Path:
    path = tmp_path / "state"
    path.mkdir(mode=0o700)
    return path


def test_a_session_reaches_only_what_the_policy_allows_through_its_proxy(state: Path) -> None:
    async def main() -> dict[str, Any]:
        seen: list[bytes] = []
        allowed, other = await fake_service(seen), await fake_service([])
        port = allowed.sockets[0].getsockname()[1]
        other_port = other.sockets[0].getsockname()[1]
        policy = Policy.from_lists("egress", [f"127.0.0.1/32:{port}"], [])
        denied: list[str] = []
        proxy = EgressProxy(state, lambda: policy, lambda pid: "s1")
        proxy._denied = lambda session, host, p, a, v: denied.append(f"{session} {host}:{p}")  # type: ignore[method-assign]
        proxy.open(asyncio.get_running_loop())
        assert (state / EGRESS_SOCKET).stat().st_mode & 0o777 == 0o600
        before = fds()

        def tries() -> dict[str, Any]:
            got: dict[str, Any] = {}
            try:
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
                got["direct"] = "connected"
            except OSError as exc:
                got["direct"] = type(exc).__name__
            got["urllib"] = through_urllib(f"http://127.0.0.1:{port}/allowed?x=1")
            got["urllib_denied"] = through_urllib(f"http://127.0.0.1:{other_port}/")
            got["connect"] = raw(
                f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: x\r\n\r\n".encode(),
                b"GET /tunnelled HTTP/1.0\r\n\r\n",
            ).decode()
            got["metadata"] = raw(b"CONNECT 169.254.169.254:80 HTTP/1.1\r\n\r\n").decode()
            got["auth_stripped"] = raw(
                f"GET http://u:p@127.0.0.1:{port}/a HTTP/1.1\r\nHost: x\r\n"
                "Proxy-Authorization: Basic c2VjcmV0\r\n\r\n".encode()
            ).decode()
            got["model"] = raw(b"POST /model/v1/chat HTTP/1.1\r\nHost: x\r\n\r\n").decode()
            got["origin"] = raw(b"GET /etc/passwd HTTP/1.1\r\nHost: x\r\n\r\n").decode()
            got["https_absolute"] = raw(b"GET https://example.com/ HTTP/1.1\r\n\r\n").decode()
            got["garbage"] = raw(b"\x16\x03\x01 hello\r\n\r\n").decode(errors="replace")
            return got

        pid, r = in_child(state, tries)
        got = await outcome(pid, r)
        proxy.worker_gone(pid)
        await asyncio.sleep(0)
        after = fds()
        proxy.close()
        allowed.close()
        other.close()
        return {**got, "denied": denied, "seen": [h.decode() for h in seen], "leak": after - before}

    got = asyncio.run(main())
    assert got["handed"] is True
    assert got["direct"] == "ConnectionRefusedError"  # the host's 127.0.0.1 is not in there
    assert got["urllib"] == "200 hello /allowed?x=1"
    assert (
        got["urllib_denied"].startswith("403 egress to 127.0.0.1:")
        and "loopback" in got["urllib_denied"]
    )
    assert got["connect"].startswith("HTTP/1.1 200 Connection established")
    assert got["connect"].endswith("hello /tunnelled")
    assert got["metadata"].startswith("HTTP/1.1 403") and "link_local" in got["metadata"]
    assert got["auth_stripped"].endswith("hello /a")
    assert not any("Proxy-Authorization" in h or "secret" in h for h in got["seen"])
    assert all(h.split(" ")[1].startswith("/") for h in got["seen"]), got["seen"]
    assert (
        got["model"].startswith("HTTP/1.1 404") and "no model endpoint configured" in got["model"]
    )
    for name in ("origin", "https_absolute", "garbage"):
        assert got[name].startswith("HTTP/1.1 400"), (name, got[name])
    assert len(got["denied"]) == 2 and all(d.startswith("s1 ") for d in got["denied"])
    assert not got["leak"], got["leak"]


def test_network_none_refuses_every_destination_but_answers_the_model_path(state: Path) -> None:
    async def main() -> dict[str, Any]:
        service = await fake_service([])
        port = service.sockets[0].getsockname()[1]
        policy = Policy.from_lists("none", [f"127.0.0.1/32:{port}"], [])
        proxy = EgressProxy(state, lambda: policy, lambda pid: "s1")
        proxy.open(asyncio.get_running_loop())

        def tries() -> dict[str, Any]:
            return {
                "get": through_urllib(f"http://127.0.0.1:{port}/"),
                "model": raw(b"GET /model HTTP/1.1\r\n\r\n").decode(),
            }

        pid, r = in_child(state, tries)
        got = await outcome(pid, r)
        proxy.close()
        service.close()
        return got

    got = asyncio.run(main())
    assert got["get"].startswith("403") and "network_none" in got["get"]
    assert got["model"].startswith("HTTP/1.1 404")


def test_only_a_child_of_the_supervisor_may_hand_over_a_listener(state: Path) -> None:
    """This process is not its own child: its hand-over is refused, and
    the listener it sent is not kept."""

    async def main() -> tuple[str, int]:
        proxy = EgressProxy(state, Policy, lambda pid: None)
        proxy.open(asyncio.get_running_loop())
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        try:
            answer = await asyncio.get_running_loop().run_in_executor(
                None, worker_egress._send, str(state / EGRESS_SOCKET), listener.fileno()
            )
        finally:
            listener.close()
        held = len(proxy.listeners)
        proxy.close()
        return answer.decode(), held

    answer, held = asyncio.run(main())
    assert answer.startswith("refused: pid ") and "not a worker of this supervisor" in answer
    assert held == 0


def test_a_worker_in_the_hosts_network_namespace_does_not_listen(state: Path) -> None:
    """Fail closed: a worker that was to be fenced but is not does not run."""
    from hermes_sup.seal.calls import SealError

    with pytest.raises(SealError, match="shares the host's network namespace"):
        worker_egress.hand_over({"network": "egress", "egress_socket": str(state / "x")})
    assert worker_egress.hand_over({"network": "host"}) is False


def test_the_sessions_environment_points_its_clients_at_the_proxy() -> None:
    env = worker_egress.proxy_env("egress")
    for name in ("HTTP_PROXY", "https_proxy", "ALL_PROXY"):
        assert env[name] == PROXY
    assert env["NO_PROXY"] == env["no_proxy"] == "localhost,127.0.0.1,::1"
    assert worker_egress.proxy_env("none") == {} == worker_egress.proxy_env("host")
