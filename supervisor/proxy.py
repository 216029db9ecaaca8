"""The egress proxy: the one way out of a sealed session's network namespace.

Theory of operation
-------------------
A sealed worker makes a TCP listening socket on SESSION_PROXY_HOST:PORT
inside its own network namespace (worker/egress.py) and hands the
listening descriptor to the supervisor over the AF_UNIX socket
<state>/EGRESS_SOCKET. A socket stays in the namespace it was made in, so
the supervisor's loop accepts the connections a session makes to its own
127.0.0.1:3128, and dials out from the supervisor's namespace, after the
egress policy (supervisor/egress.py) said yes. No process per session,
and nothing else of the host is reachable from inside.

The hand-over is checked: the peer (SO_PEERCRED) must be a child of this
supervisor, which only workers and spares are; it hands over one
listening TCP socket, once. Anything else is refused and logged. The
listener is closed when its worker is reaped (`worker_gone`), with every
connection made through it.

On a handed-over listener the proxy serves, one request per connection:
- `CONNECT host:port` (HTTPS and anything tunnelled): a 200, then bytes
  both ways;
- plain HTTP in absolute form (`GET http://host/path`): the request is
  sent on in origin form with `Connection: close`, and bytes both ways;
- origin form under SESSION_MODEL_PATH: the model endpoint
  (supervisor/model_gate.py);
- anything else: 400.
A refused destination gets a 403 naming why; it is logged with the
session and destination and counted in metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import resource
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hermes_sup.local.addresses import EGRESS_SOCKET, SESSION_MODEL_PATH
from hermes_sup.local.logfmt import kv

from . import model_gate
from .egress import IPAddress, Policy, Verdict, parse_target
from .limits import PROXY_FD_SHARE
from .metrics import Metrics

log = logging.getLogger("hermes_sup.supervisor")

# A request's line and headers must fit in this, and arrive within
# HEAD_TIMEOUT: a session cannot hold the supervisor's memory or a
# connection's task with a slow or endless head.
MAX_HEAD = 64 * 1024
HEAD_TIMEOUT = 30.0
CONNECT_TIMEOUT = 15.0
# A worker hands over its listener right after connecting; one that does
# not within this is dropped.
HANDOFF_TIMEOUT = 5.0
# Handovers being read at once (each is a worker at its start).
MAX_PENDING_HANDOFFS = 64
# Connections one session may have through its proxy at once, and all
# sessions together: half the descriptors kept for the proxy (limits.py's
# PROXY_FD_SHARE; a tunnel holds two). A session that opens connections
# without end must not take the descriptors every other session and
# client needs. Over either, a 503.
MAX_SESSION_CONNECTIONS = 32
CHUNK = 64 * 1024
# Headers meant for the proxy, never forwarded (hop by hop).
HOP_HEADERS = frozenset(
    {b"proxy-authorization", b"proxy-connection", b"connection", b"keep-alive", b"te"}
)


class HandoffRefused(Exception):
    """A peer of the hand-over socket that may not hand over (says why)."""


@dataclass
class Listener:
    """One worker's handed-over listener, and the connections it accepted."""

    pid: int
    server: asyncio.Server
    tasks: set[asyncio.Task[None]] = field(default_factory=set)


class EgressProxy:
    """The hand-over socket and every session's proxy listener."""

    def __init__(
        self,
        state_dir: Path,
        policy: Callable[[], Policy],
        session_of: Callable[[int], str | None],
        metrics: Callable[[], Metrics | None] = lambda: None,
    ) -> None:
        self.path = state_dir / EGRESS_SOCKET
        self.policy = policy
        # The session a worker's pid serves now ("(spare)" before one is
        # assigned), looked up at each connection: a spare's listener
        # becomes its session's when it is assigned.
        self.session_of = session_of
        self.metrics = metrics
        self.listeners: dict[int, Listener] = {}
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.max_connections = max(MAX_SESSION_CONNECTIONS, soft // PROXY_FD_SHARE // 2)
        self.connections = 0  # through every listener, now
        self._sock: socket.socket | None = None
        self._pending: dict[int, socket.socket] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------ hand-over

    def open(self, loop: asyncio.AbstractEventLoop) -> None:
        """Listen on <state>/EGRESS_SOCKET (0600: only our uid, and root)."""
        self._loop = loop
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # made 0600, no window in which it is wider
        try:
            sock.bind(str(self.path))
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        sock.listen(64)
        sock.setblocking(False)
        loop.add_reader(sock.fileno(), self._accept)
        self._sock = sock

    def close(self) -> None:
        """Stop taking hand-overs and close every listener."""
        if self._sock is not None and self._loop is not None:
            self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        for conn in list(self._pending.values()):
            self._drop_pending(conn)
        for pid in list(self.listeners):
            self.worker_gone(pid)

    def _accept(self) -> None:
        assert self._sock is not None and self._loop is not None
        try:
            conn, _ = self._sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            log.warning(kv("egress_handoff_accept_failed", error=exc.strerror or exc))
            return
        if len(self._pending) >= MAX_PENDING_HANDOFFS:
            log.warning(kv("egress_handoff_refused", reason="too many at once"))
            conn.close()
            return
        conn.setblocking(False)
        self._pending[conn.fileno()] = conn
        self._loop.add_reader(conn.fileno(), self._receive, conn)
        self._loop.call_later(HANDOFF_TIMEOUT, self._expire, conn)

    def _expire(self, conn: socket.socket) -> None:
        if self._pending.get(conn.fileno()) is conn:
            log.warning(kv("egress_handoff_refused", reason="nothing handed over in time"))
            self._drop_pending(conn)

    def _drop_pending(self, conn: socket.socket) -> None:
        if conn.fileno() >= 0:
            self._pending.pop(conn.fileno(), None)
            if self._loop is not None:
                self._loop.remove_reader(conn.fileno())
        conn.close()

    def _receive(self, conn: socket.socket) -> None:
        """The peer's one message: its listening socket, as SCM_RIGHTS."""
        try:
            _msg, fds, _flags, _addr = socket.recv_fds(conn, 16, 4)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            log.warning(kv("egress_handoff_refused", reason=f"read: {exc.strerror or exc}"))
            self._drop_pending(conn)
            return
        pid = None
        try:
            pid = self._check_peer(conn)
            listening = self._check_fds(fds)
            fds = []  # owned by `listening` from here
            if pid in self.listeners:
                listening.close()
                raise HandoffRefused("this worker has handed over a listener already")
        except HandoffRefused as exc:
            for fd in fds:
                os.close(fd)
            log.warning(kv("egress_handoff_refused", pid=pid, reason=str(exc)))
            with contextlib.suppress(OSError):
                conn.send(f"refused: {exc}\n".encode())
            self._drop_pending(conn)
            return
        assert self._loop is not None
        self._loop.create_task(self._serve_listener(pid, listening, conn))

    def _check_peer(self, conn: socket.socket) -> int:
        """The peer's pid, if it is a child of ours (a worker or a spare:
        the zygote forks them as our children); else HandoffRefused."""
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, _uid, _gid = struct.unpack("3i", creds)
        if pid <= 0 or _parent_of(pid) != os.getpid():
            raise HandoffRefused(f"pid {pid} is not a worker of this supervisor")
        return pid

    @staticmethod
    def _check_fds(fds: list[int]) -> socket.socket:
        """The one listening TCP socket handed over; else HandoffRefused."""
        if len(fds) != 1:
            raise HandoffRefused(f"{len(fds)} descriptors handed over, not one")
        try:
            sock = socket.socket(fileno=fds[0])
        except OSError as exc:
            raise HandoffRefused(f"not a socket: {exc.strerror or exc}") from None
        ok = (
            sock.family in (socket.AF_INET, socket.AF_INET6)
            and sock.type == socket.SOCK_STREAM
            and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
        )
        if not ok:
            sock.detach()  # the caller closes the fd
            raise HandoffRefused("not a listening TCP socket")
        return sock

    async def _serve_listener(self, pid: int, sock: socket.socket, conn: socket.socket) -> None:
        sock.setblocking(False)
        entry: Listener | None = None

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            assert entry is not None
            task = asyncio.current_task()
            assert task is not None
            if len(entry.tasks) >= MAX_SESSION_CONNECTIONS or (
                self.connections >= self.max_connections
            ):
                await _answer(
                    writer,
                    503,
                    f"too many connections through the proxy (a session may have "
                    f"{MAX_SESSION_CONNECTIONS} at once)",
                )
                writer.close()
                return
            entry.tasks.add(task)
            self.connections += 1
            try:
                await self._serve_connection(pid, reader, writer)
            finally:
                self.connections -= 1
                entry.tasks.discard(task)
                writer.close()

        try:
            server = await asyncio.start_server(serve, sock=sock, limit=MAX_HEAD)
        except OSError as exc:
            sock.close()
            log.warning(kv("egress_handoff_refused", pid=pid, reason=str(exc)))
            self._drop_pending(conn)
            return
        entry = Listener(pid, server)
        self.listeners[pid] = entry
        with contextlib.suppress(OSError):
            conn.send(b"ok\n")
        self._drop_pending(conn)
        log.debug(kv("egress_listener", pid=pid, session=self.session_of(pid)))

    def worker_gone(self, pid: int) -> None:
        """`pid` was reaped: close its listener and its connections (they
        hold its network namespace)."""
        entry = self.listeners.pop(pid, None)
        if entry is None:
            return
        entry.server.close()
        for task in list(entry.tasks):
            task.cancel()  # its `finally` closes both sides

    # ------------------------------------------------------------- requests

    async def _serve_connection(
        self, pid: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        session = self.session_of(pid) or f"(pid {pid})"
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            await _answer(writer, 400, "a request line and headers within 64 KiB expected")
            return
        except ConnectionError:
            return
        line, _, headers = head.partition(b"\r\n")
        parts = line.split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            await _answer(writer, 400, "not an HTTP/1 request line")
            return
        method, target = parts[0], parts[1].decode("latin-1")
        if method == b"CONNECT":
            await self._tunnel(session, target, reader, writer)
        elif target.lower().startswith("http://"):
            await self._forward(session, method, target, parts[2], headers, reader, writer)
        elif _is_model_path(target):
            await model_gate.handle(session, reader, writer, head)
        else:
            await _answer(
                writer,
                400,
                "this is the session's egress proxy: CONNECT host:port, an absolute "
                f"http:// URL, or {SESSION_MODEL_PATH}/",
            )

    async def _tunnel(
        self,
        session: str,
        target: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        upstream = await self._open(session, target, None, writer)  # CONNECT names its port
        if upstream is None:
            return
        writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        await _relay(reader, writer, *upstream)

    async def _forward(
        self,
        session: str,
        method: bytes,
        url: str,
        version: bytes,
        headers: bytes,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        authority, slash, rest = url[len("http://") :].partition("/")
        authority = authority.rpartition("@")[2]  # user:pass@ is the server's, not ours
        upstream = await self._open(session, authority, 80, writer)
        if upstream is None:
            return
        kept = [
            h
            for h in headers.split(b"\r\n")
            if h and h.split(b":", 1)[0].strip().lower() not in HOP_HEADERS
        ]
        path = (slash + rest) or "/"
        up_reader, up_writer = upstream
        up_writer.write(
            b"%s %s %s\r\n" % (method, path.encode("latin-1"), version)
            + b"".join(h + b"\r\n" for h in kept)
            + b"Connection: close\r\n\r\n"
        )
        await _relay(reader, writer, up_reader, up_writer)

    async def _open(
        self, session: str, target: str, default_port: int | None, writer: asyncio.StreamWriter
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """`host[:port]` parsed, vetted and connected to; None after
        answering the session why not (400 unparsable, or as `_dial`)."""
        try:
            host, port = parse_target(target, default_port=default_port)
        except ValueError as exc:
            await _answer(writer, 400, str(exc))
            return None
        return await self._dial(session, host, port, writer)

    async def _dial(
        self, session: str, host: str, port: int, writer: asyncio.StreamWriter
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """Vet `host:port` (resolving it here) and connect to a vetted
        address; None after answering the session why not."""
        policy = self.policy()
        verdict = policy.check_name(host, port)
        addresses: list[IPAddress] = []
        if verdict is None:
            try:
                addresses = await _resolve(host, port)
            except OSError as exc:
                await _answer(writer, 502, f"cannot resolve {host}: {exc.strerror or exc}")
                return None
            verdict = policy.check_addresses(host, port, addresses)
        if not verdict.allowed:
            self._denied(session, host, port, addresses, verdict)
            await _answer(writer, 403, f"egress to {host}:{port} is denied ({verdict.reason})")
            return None
        failure = "no address"
        for address in addresses:
            try:
                return await asyncio.wait_for(
                    asyncio.open_connection(str(address), port, limit=CHUNK), CONNECT_TIMEOUT
                )
            except (OSError, TimeoutError) as exc:
                failure = getattr(exc, "strerror", None) or type(exc).__name__
        await _answer(writer, 502, f"cannot connect to {host}:{port}: {failure}")
        return None

    def _denied(
        self, session: str, host: str, port: int, addresses: list[IPAddress], verdict: Verdict
    ) -> None:
        log.warning(
            kv(
                "egress_denied",
                session=session,
                host=host,
                port=port,
                addresses=",".join(map(str, addresses)) or None,
                reason=verdict.reason,
                rule=verdict.rule or None,
            )
        )
        metrics = self.metrics()
        if metrics is not None:
            metrics.egress_denied.labels(verdict.reason).inc()


def _is_model_path(target: str) -> bool:
    return target == SESSION_MODEL_PATH or target.startswith(
        (SESSION_MODEL_PATH + "/", SESSION_MODEL_PATH + "?")
    )


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"PPid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


async def _resolve(host: str, port: int) -> list[IPAddress]:
    """Every address `host` has (the supervisor's resolver, not the session's)."""
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    found: list[IPAddress] = []
    for _family, _type, _proto, _name, sockaddr in infos:
        address = ipaddress.ip_address(str(sockaddr[0]).split("%")[0])
        if address not in found:
            found.append(address)
    return found


async def _answer(writer: asyncio.StreamWriter, status: int, why: str) -> None:
    """An error answer, closing the connection."""
    reason = {400: "Bad Request", 403: "Forbidden", 502: "Bad Gateway"}.get(status, "Error")
    body = (why + "\n").encode()
    writer.write(
        b"HTTP/1.1 %d %s\r\nContent-Type: text/plain\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (status, reason.encode(), len(body), body)
    )
    with contextlib.suppress(ConnectionError):
        await writer.drain()


async def _relay(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    up_reader: asyncio.StreamReader,
    up_writer: asyncio.StreamWriter,
) -> None:
    """Bytes both ways until both sides are done; then close upstream."""
    try:
        await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))
    finally:
        up_writer.close()
        writer.close()


async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(CHUNK):
            dst.write(data)
            await dst.drain()
        if dst.can_write_eof():
            dst.write_eof()
    except (ConnectionError, OSError):
        dst.close()


def host_addresses() -> list[str]:
    """Every address of this host's interfaces (closed to sessions unless
    an operator opens them by range)."""
    import psutil

    found = []
    for entries in psutil.net_if_addrs().values():
        for entry in entries:
            if entry.family in (socket.AF_INET, socket.AF_INET6):
                found.append(entry.address.split("%")[0])
    return found


class PolicySource:
    """The policy of the settings in force, made again when a reload
    changes the lists, or the supervisor's own ports change."""

    def __init__(
        self,
        lists: Callable[[], tuple[str, tuple[str, ...], tuple[str, ...]]],
        own_ports: Callable[[], tuple[int, ...]],
    ) -> None:
        self.lists = lists
        self.own_ports = own_ports
        self._addresses = tuple(host_addresses())
        self._made: tuple[object, Policy] | None = None

    def __call__(self) -> Policy:
        key = (self.lists(), self.own_ports())
        if self._made is None or self._made[0] != key:
            (network, allow, deny), ports = key
            policy = Policy.from_lists(network, allow, deny, self._addresses, ports)
            self._made = (key, policy)
        return self._made[1]
