"""The supervisor's sockets: where clients and workers reach it, and the
only place that sends to them.

Two ROUTER sockets are bound in the private state directory: `control.sock`
for clients and `workers.sock` for workers; with `tcp` set, a third, CURVE
encrypted and allowlisted, for remote front ends. Only the supervisor
binds; everyone else connects.

A client id is the routing id behind one byte naming the socket it came in
on (0: the local control socket, 1: TCP), and replies are signed with that
socket's key. Sends never block: a client that is gone or too slow is
dropped, never waited on (see channel.py for how the loop drives them).

Client connections are counted and capped per socket by the gate
(gate.py), so that no number of them runs the supervisor out of file
descriptors; a request on a connection over the cap is answered
`overloaded` here, and the connection shut.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
from collections.abc import Callable
from functools import partial

import zmq
from zmq.auth.thread import ThreadAuthenticator

from hermes_sup.local import statedir
from hermes_sup.local.frames import HANDSHAKE_FAILURES
from hermes_sup.local.logfmt import kv
from hermes_sup.protocol import (
    DEFAULT_MAX_FRAME_SIZE,
    MAGIC,
    ErrorCode,
    Limits,
    LocalProtocolError,
    Message,
    RemoteProtocolError,
    decode,
    encode,
    error_message,
    sign,
)

from . import remote
from .channel import Channel
from .config import Settings
from .gate import (
    REFUSAL_LINGER,
    Door,
    Gate,
    client_caps,
    shut_known,
    tcp_address,
    unix_address,
)
from .session import Session

log = logging.getLogger("hermes_sup.supervisor")

# A turn carries a client's text of up to the frame limit, in an envelope of
# its own: room for that envelope on the way to a worker.
ENVELOPE_ROOM = 64 * 1024
# How long a client may take to complete its handshake: one that connects
# and says nothing holds a place among the client connections until then.
HANDSHAKE_MS = 10_000


def worker_limits(max_frame_size: int) -> Limits:
    """What the supervisor and its workers may send each other. Workers are
    told `max_frame_size` and keep to it, but one that was not (or a runtime
    that bypasses it) encodes up to the default: its message must still
    arrive whole, to be answered for (back.py), not cut off by zmq."""
    return Limits(max_frame_size=max(max_frame_size, DEFAULT_MAX_FRAME_SIZE) + ENVELOPE_ROOM)


class Endpoints:
    """The bound sockets, and sending on them."""

    def __init__(self, settings: Settings, key: bytes) -> None:
        self.settings = settings  # as at start: sockets are not rebound on reload
        self.key = key
        self.limits = Limits(max_frame_size=settings.max_frame_size)
        self.worker_limits = worker_limits(settings.max_frame_size)
        self.control = statedir.endpoint(settings.state_dir, statedir.CONTROL_SOCKET)
        self.worker = statedir.endpoint(settings.state_dir, statedir.WORKER_SOCKET)
        self.tcp: str | None = None
        self.fronts: list[tuple[Channel, bytes]] = []
        self.auth: ThreadAuthenticator | None = None
        self.caps = (0, 0)  # client connections at most: local, TCP

    def open(
        self,
        loop: asyncio.AbstractEventLoop,
        on_client: Callable[[int, list[bytes]], None],
        on_worker: Callable[[list[bytes]], None],
    ) -> None:
        """Make the zmq context and bind every socket; `on_client(index,
        frames)` and `on_worker(frames)` get what arrives."""
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.loop = loop
        self.gate = Gate(self.ctx)
        s = self.settings
        fd_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.caps = client_caps(
            fd_limit, s.spare_workers, s.max_sessions, s.max_clients, bool(s.tcp)
        )
        path = self.control.removeprefix("ipc://")
        control = self._router()
        control.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
        self.gate.watch(control, 0, "control", self.caps[0], unix_address(path))
        self._bind(control, self.control)
        try:
            # After the bind: the door keeps the bound socket's name.
            self.gate.watched[0].door = Door(path)
        except OSError as exc:
            log.warning(kv("client_door_unavailable", path=path, error=exc))
        self.fronts.append((self._front(control, 0, on_client, loop), self.key))
        self.auth = self._start_tcp(loop, on_client)
        self.gate.start()
        if s.max_clients is not None and sum(self.caps) < s.max_clients:
            log.warning(
                kv(
                    "max_clients_lowered",
                    wanted=s.max_clients,
                    allowed=sum(self.caps),
                    fd_limit=fd_limit,
                    hint="raise LimitNOFILE / ulimit -n, or lower max_sessions",
                )
            )
        log.info(kv("client_limit", local=self.caps[0], tcp=self.caps[1], fd_limit=fd_limit))
        back = self._router(self.worker_limits.max_frame_size)
        self.back = Channel(self._bind(back, self.worker), on_worker, loop)

    def _front(
        self,
        sock: zmq.Socket[bytes],
        index: int,
        on_client: Callable[[int, list[bytes]], None],
        loop: asyncio.AbstractEventLoop,
    ) -> Channel:
        """A client socket's channel: requests go to `on_client`, but one
        from a connection the gate refused gets the refusal instead."""
        channel = Channel(sock, partial(on_client, index), loop)
        channel.screen(self.gate.refusing, partial(self._refuse, index))
        return channel

    def close(self) -> None:
        self.gate.stop()
        for channel, _ in self.fronts:
            channel.close()
        self.back.close()
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()

    def _refuse(self, index: int, fd: int, frames: list[bytes]) -> bool:
        """A request on descriptor `fd`, which the gate may have refused:
        if so, answer `overloaded` (to the request, when it can be read),
        and shut the connection once the answer is out. False: not refused,
        serve it."""
        refusal = self.gate.take_refusal(fd)
        if refusal is None:
            return False
        if len(frames) >= 2:
            try:
                re: str | None = decode(frames[1:], self.client_key(index), self.limits).id
            except RemoteProtocolError as exc:
                re = exc.msg_id
            self.error(
                bytes([index]) + frames[0],
                ErrorCode.OVERLOADED,
                f"the supervisor already has {refusal.cap} client connections on its "
                f"{refusal.name} socket, its limit: this connection is refused. Close idle "
                "clients, or raise max_clients or the supervisor's open-file limit",
                re,
                None,
            )
        self.loop.call_later(REFUSAL_LINGER, shut_known, fd, refusal.inode)
        return True

    def _start_tcp(
        self, loop: asyncio.AbstractEventLoop, on_client: Callable[[int, list[bytes]], None]
    ) -> ThreadAuthenticator | None:
        """The CURVE endpoint for remote front ends, if configured."""
        s = self.settings
        if not s.tcp:
            return None
        host, port = remote.parse_tcp(s.tcp)
        public, secret = remote.server_keys(s.data_dir)
        # The ZAP handler must run before the socket binds: without one,
        # libzmq lets every CURVE key in.
        auth = ThreadAuthenticator(self.ctx, log=logging.getLogger("hermes_sup.zap"))
        auth.start()
        auth.configure_curve_callback(remote.ZAP_DOMAIN, remote.Allowlist(s.data_dir))
        sock = self._router()
        sock.curve_server = True
        sock.curve_publickey = public
        sock.curve_secretkey = secret
        sock.zap_domain = remote.ZAP_DOMAIN.encode()
        sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
        # Peers that fail the handshake (no CURVE, wrong server key) never
        # reach ZAP; the socket's monitor is the only place they show.
        self.gate.watch(
            sock,
            1,
            "tcp",
            self.caps[1],
            tcp_address(port),
            HANDSHAKE_FAILURES,
            remote.log_handshake_failure,
        )
        self.tcp = remote.tcp_endpoint(host, port)
        try:
            sock.bind(self.tcp)
        except zmq.ZMQError as exc:
            sock.close(0)
            auth.stop()
            raise remote.RemoteError(f"cannot listen on {self.tcp}: {exc}") from None
        self.fronts.append(
            (self._front(sock, 1, on_client, loop), remote.remote_hmac_key(s.data_dir))
        )
        log.info(
            kv(
                "tcp_ready",
                endpoint=self.tcp,
                server_public=public.decode(),
                allowed=len(remote.allowed(s.data_dir)),
            )
        )
        return auth

    def _router(self, limit: int | None = None) -> zmq.Socket[bytes]:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # Sends to a peer that is gone raise instead of vanishing silently.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # Frames a little over the limit reach decode and get a clear too_large
        # reply; far over it, zmq drops the peer before buffering the frame.
        if limit is None:
            limit = self.settings.max_frame_size
        sock.setsockopt(zmq.MAXMSGSIZE, limit + limit // 4 + 4096)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        return sock

    def _bind(self, sock: zmq.Socket[bytes], endpoint: str) -> zmq.Socket[bytes]:
        path = endpoint.removeprefix("ipc://")
        if os.path.exists(path):
            os.unlink(path)  # stale socket of a dead supervisor: we hold the lock
        old = os.umask(0o177)
        try:
            sock.bind(endpoint)
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        return sock

    def client_key(self, index: int) -> bytes:
        """The key that signs frames on front socket `index`."""
        return self.fronts[index][1]

    def to_client(self, client: bytes, msg: Message, payload: bytes | None = None) -> bool:
        """Send to a client without blocking; False if it is gone or too slow.
        `payload` is a worker's own envelope that already says what `msg`
        says (same session, same `re`): it is re-signed, not re-encoded."""
        channel, key = self.fronts[client[0]]
        try:
            if payload is not None:
                frames = [MAGIC, sign(key, payload), payload]
            else:
                frames = encode(msg, key, self.limits)
        except LocalProtocolError as exc:
            log.error(kv("unsendable", kind=msg.kind.value, error=exc.message))
            frames = encode(
                error_message(
                    ErrorCode.INTERNAL.value, exc.message, re=msg.re, session=msg.session
                ),
                key,
            )
        try:
            channel.send([client[1:], *frames])
            return True
        except zmq.Again:
            log.warning(kv("client_slow_dropped", kind=msg.kind.value, re=msg.re))
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            log.debug(kv("client_gone", kind=msg.kind.value, re=msg.re))
        return False

    def error(
        self, client: bytes, code: ErrorCode, message: str, re: str | None, session: str | None
    ) -> None:
        """Send a client an error reply."""
        self.to_client(client, error_message(code.value, message, re=re, session=session))

    def to_worker(self, session: Session, msg: Message) -> bool:
        """Send to a session's worker; False if it has none or is gone."""
        if session.worker_id is None or session.token is None:
            return False
        try:
            self.back.send([session.worker_id, *encode(msg, session.token, self.worker_limits)])
            return True
        except LocalProtocolError as exc:
            log.error(kv("unsendable", kind=msg.kind.value, session=session.key, error=exc.message))
            return False
        except zmq.ZMQError as exc:
            log.warning(kv("worker_unreachable", session=session.key, error=exc))
            return False
