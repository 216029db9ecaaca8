"""A service's client sockets: where front ends reach it, and the only place
that sends to them. The supervisor (supervisor/endpoints.py) and the router
(cluster/router.py) are each one `Fronts`, and so keep the same promises.

A ROUTER socket `control.sock` is bound in the private state directory for
local clients; with `tcp` set, a second, CURVE encrypted and allowlisted,
for remote front ends. Only the service binds; everyone else connects.

A client id is the routing id behind one byte naming the socket it came in
on (0: the local control socket, 1: TCP), and replies are signed with that
socket's key. Sends never block: a client that is gone is forgotten (and
reported to `on_gone`), and one too slow is never waited on (see
channel.py for how the loop drives them).

Slow consumers
--------------
zmq queues at most `client_queue` messages for one client connection (the
ROUTER's send high-water mark, per peer), so a client that stops reading
holds that much of the service's memory and no more, and every other
client is served as before. Once its queue is full the client *lags*
(`Lag`): its events are dropped and counted per stream (the session and
the request they answer), and its final answers (a turn's reply or error,
the answer to any request) are kept for it: one over OWED_ANSWER_BYTES,
or any once OWED_BYTES of answers are kept, as a short `overloaded` error
instead, so that every request still gets its answer (a front end such as
the HTTP endpoint has a turn in flight per conversation, a thousand of
them); only past MAX_OWED answers, which no well-behaved client reaches,
is the oldest dropped and counted too.
While any client lags, the service tries again every CATCH_UP_INTERVAL
and before anything new is sent to it: each stream's count goes first, as
an event `{type: "dropped", data: {count, reason: "slow_consumer"}}` with
the stream's session and `re`, then what was kept, in order. A client that
reads again so learns how much it missed, where, and gets every answer; a
lagging client that goes away is forgotten.

Client connections are counted and capped per socket by the gate
(gate.py), so that no number of them runs the service out of file
descriptors; a request on a connection over the cap is answered
`overloaded` here, and the connection shut.

A client is found gone when a send to it fails (ROUTER_MANDATORY; released
libzmq cannot say when a connection closes). `on_gone(client)` is then
called, once per failed send: a router ends the watches the client left
open on its nodes. A supervisor needs no call: its watchers are forgotten
by the send that fails.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from functools import partial
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator

from hermes_sup.local import statedir
from hermes_sup.local.frames import HANDSHAKE_FAILURES
from hermes_sup.local.logfmt import kv
from hermes_sup.protocol import (
    MAGIC,
    ErrorCode,
    Kind,
    Limits,
    LocalProtocolError,
    Message,
    RemoteProtocolError,
    decode,
    encode,
    error_message,
    sign,
)

from . import gate, remote
from .channel import Channel
from .gate import REFUSAL_LINGER, Door, Gate, shut_known, tcp_address, unix_address
from .throttle import Throttle

log = logging.getLogger("hermes_sup.door")

# How long a client may take to complete its handshake: one that connects
# and says nothing holds a place among the client connections until then.
HANDSHAKE_MS = 10_000
# Slow consumers (see the module docstring): how often a lagging client is
# tried again, how many final answers are kept for one, and how large one
# may be to be kept as it is. Streams whose drops are counted for one
# client, at most (beyond, they are counted under no stream).
CATCH_UP_INTERVAL = 0.025
MAX_OWED = 65_536
OWED_ANSWER_BYTES = 64 * 1024
OWED_BYTES = 32 * 1024 * 1024
MAX_STREAMS = 4096
# Messages zmq queues from one client before it stops reading that peer.
CLIENT_INBOX = 100_000

SLOW = Throttle(log, "slow_consumer")

# How many client connections each socket (local, TCP) may have under an
# open-file limit: a service's budget (gate.client_caps, with what it holds).
Caps = Callable[[int], tuple[int, int]]


class Sent(Enum):
    """What became of a message for a client."""

    DELIVERED = "delivered"  # handed to zmq
    LAGGING = "lagging"  # the client's queue is full: counted or kept
    GONE = "gone"  # the client is not connected


Stream = tuple[str | None, str | None]  # (session, re)


@dataclass
class Owed:
    """What one stream of a lagging client is owed: a count of dropped
    events, then its kept answers (frames ready to send), in order."""

    dropped: int = 0
    answers: list[list[bytes]] = field(default_factory=list)


@dataclass
class Lag:
    """A client whose queue was full: what it is owed, stream by stream,
    in the order the streams first fell behind."""

    since: float
    streams: OrderedDict[Stream, Owed] = field(default_factory=OrderedDict)
    answers: int = 0  # kept, all streams together
    answer_bytes: int = 0  # their size (last frames), for OWED_BYTES
    dropped: int = 0  # events dropped since it began to lag, for the log


class Fronts:
    """The bound client sockets, and sending on them."""

    def __init__(
        self,
        state_dir: Path,
        key: bytes,
        *,
        max_frame_size: int,
        client_queue: int,
        tcp: str = "",
        data_dir: Path | None = None,
        max_clients: int | None = None,
        caps: Caps | None = None,
        more_room: str = "raise LimitNOFILE / ulimit -n",
        service: str = "supervisor",
        on_gone: Callable[[bytes], None] | None = None,
    ) -> None:
        """`caps` gives the connection caps under an open-file limit (by
        default the gate's, with nothing else holding descriptors);
        `more_room` is the log's hint when it gives fewer than
        `max_clients`; `service` names the service in refusals."""
        self.key = key
        self.limits = Limits(max_frame_size=max_frame_size)
        self.client_queue = client_queue
        self.data_dir = data_dir
        self.max_clients = max_clients
        self.service = service
        self.on_gone = on_gone
        self._tcp_setting = tcp
        self._caps_for: Caps = caps or (
            lambda fd_limit: gate.client_caps(fd_limit, 0, max_clients, bool(tcp))
        )
        self._more_room = more_room
        self.control = statedir.endpoint(state_dir, statedir.CONTROL_SOCKET)
        self.tcp: str | None = None  # the TCP endpoint, once bound
        self.fronts: list[tuple[Channel, bytes]] = []
        self.auth: ThreadAuthenticator | None = None
        self.caps = (0, 0)  # client connections at most: local, TCP
        # Slow consumers: lagging clients by id, and the retry timer's handle.
        self.lagging: dict[bytes, Lag] = {}
        self._catch_up_timer: asyncio.TimerHandle | None = None

    def listen(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        loop: asyncio.AbstractEventLoop,
        on_client: Callable[[int, list[bytes]], None],
    ) -> None:
        """Bind the client sockets on `ctx` (the caller's; terminated by it
        after `close`); `on_client(index, frames)` gets what arrives."""
        self.ctx = ctx
        self.loop = loop
        self.gate = Gate(ctx)
        fd_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.caps = self._caps_for(fd_limit)
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
        if self.max_clients is not None and sum(self.caps) < self.max_clients:
            log.warning(
                kv(
                    "max_clients_lowered",
                    wanted=self.max_clients,
                    allowed=sum(self.caps),
                    fd_limit=fd_limit,
                    hint=self._more_room,
                )
            )
        log.info(kv("client_limit", local=self.caps[0], tcp=self.caps[1], fd_limit=fd_limit))

    def _front(
        self,
        sock: zmq.Socket[bytes],
        index: int,
        on_client: Callable[[int, list[bytes]], None],
        loop: asyncio.AbstractEventLoop,
    ) -> Channel:
        """A client socket's channel: requests go to `on_client`, but one
        from a connection the gate refused gets the refusal instead."""
        # The TCP socket's channel keeps what names a request's CURVE key.
        channel = Channel(sock, partial(on_client, index), loop, keep_last=index != 0)
        channel.screen(self.gate.refusing, partial(self._refuse, index))
        return channel

    def close(self) -> None:
        """Close the client sockets, the gate and the ZAP handler (the
        context is the caller's to terminate)."""
        if self._catch_up_timer is not None:
            self._catch_up_timer.cancel()
        self.gate.stop()
        for channel, _ in self.fronts:
            channel.close()
        if self.auth is not None:
            self.auth.stop()

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
                f"the {self.service} already has {refusal.cap} client connections on its "
                f"{refusal.name} socket, its limit: this connection is refused. Close idle "
                f"clients, or raise max_clients or the {self.service}'s open-file limit",
                re,
                None,
            )
        self.loop.call_later(REFUSAL_LINGER, shut_known, fd, refusal.inode)
        return True

    def _start_tcp(
        self, loop: asyncio.AbstractEventLoop, on_client: Callable[[int, list[bytes]], None]
    ) -> ThreadAuthenticator | None:
        """The CURVE endpoint for remote front ends, if configured."""
        if not self._tcp_setting:
            return None
        data_dir = self.data_dir
        if data_dir is None:
            raise remote.RemoteError("a TCP socket needs a data directory for its CURVE keys")
        host, port = remote.parse_tcp(self._tcp_setting)
        public, secret = remote.server_keys(data_dir)
        # The ZAP handler must run before the socket binds: without one,
        # libzmq lets every CURVE key in.
        auth = ThreadAuthenticator(self.ctx, log=logging.getLogger("hermes_sup.zap"))
        auth.start()
        auth.configure_curve_callback(remote.ZAP_DOMAIN, remote.Allowlist(data_dir))
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
            (self._front(sock, 1, on_client, loop), remote.remote_hmac_key(data_dir))
        )
        log.info(
            kv(
                "tcp_ready",
                endpoint=self.tcp,
                server_public=public.decode(),
                allowed=len(remote.allowed(data_dir)),
            )
        )
        return auth

    def _router(
        self, limit: int | None = None, queue: int | None = None, inbox: int = CLIENT_INBOX
    ) -> zmq.Socket[bytes]:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # Sends to a peer that is gone raise instead of vanishing silently.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # Frames a little over the limit reach decode and get a clear too_large
        # reply; far over it, zmq drops the peer before buffering the frame.
        if limit is None:
            limit = self.limits.max_frame_size
        sock.setsockopt(zmq.MAXMSGSIZE, limit + limit // 4 + 4096)
        # Messages queued for one peer: a client that does not read lags
        # once its queue is full (see "Slow consumers" above).
        sock.setsockopt(zmq.SNDHWM, queue if queue is not None else self.client_queue)
        sock.setsockopt(zmq.RCVHWM, inbox)
        return sock

    def _bind(self, sock: zmq.Socket[bytes], endpoint: str) -> zmq.Socket[bytes]:
        path = endpoint.removeprefix("ipc://")
        if os.path.exists(path):
            os.unlink(path)  # stale socket of a dead service: we hold the lock
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

    def is_local(self, client: bytes) -> bool:
        """Whether `client` came in on the local control socket."""
        return client[0] == 0

    def peer_name(self, client: bytes) -> str | None:
        """The allowlist name of the CURVE key the request being handled came
        with (TCP only; None for the local socket, or a key no longer
        allowed). Looked up in the allowlist as it is now, so a revoked key
        loses what its name allowed at once, on a connection made before.
        Valid only while that request's handler runs (channel.py)."""
        if client[0] == 0 or self.data_dir is None:
            return None
        key = self.fronts[client[0]][0].peer_user_id()
        if key is None:
            return None
        return remote.name_of(self.data_dir, key.encode())

    def to_client(self, client: bytes, msg: Message, payload: bytes | None = None) -> bool:
        """Send to a client without blocking; False if it is gone. A client
        too slow to take it lags: an event is counted as dropped, an answer
        kept for it (see "Slow consumers" above); that is True too.
        `payload` is a peer's own envelope that already says what `msg`
        says (same session, same `re`): it is re-signed, not re-encoded."""
        lag = self.lagging.get(client)
        if lag is not None:
            caught_up = self._catch_up(client, lag)
            if caught_up is Sent.GONE:
                self._gone(client)
                return False
            if caught_up is Sent.LAGGING:
                self._owe(client, lag, msg, lambda: self._frames(client, msg, payload))
                return True
        frames = self._frames(client, msg, payload)
        sent = self._send(client, frames)
        if sent is Sent.LAGGING:
            lag = self.lagging[client] = Lag(time.monotonic())
            self._owe(client, lag, msg, lambda: frames)
            self._schedule_catch_up()
            if SLOW.due():
                log.warning(
                    kv(
                        "slow_consumer",
                        client=client[1:].hex()[:16],
                        queued=self.client_queue,
                        outcome="events dropped and counted, answers kept until it reads",
                    )
                )
        elif sent is Sent.GONE:
            log.debug(kv("client_gone", kind=msg.kind.value, re=msg.re))
            self._gone(client)
        return sent is not Sent.GONE

    def _gone(self, client: bytes) -> None:
        if self.on_gone is None:
            return
        try:
            self.on_gone(client)
        except Exception:
            log.exception(kv("bug", where="client gone"))

    def _frames(self, client: bytes, msg: Message, payload: bytes | None) -> list[bytes]:
        """The signed frames of `msg` for `client` (see to_client)."""
        key = self.fronts[client[0]][1]
        try:
            if payload is not None:
                return [MAGIC, sign(key, payload), payload]
            return encode(msg, key, self.limits)
        except LocalProtocolError as exc:
            log.error(kv("unsendable", kind=msg.kind.value, error=exc.message))
            return encode(
                error_message(
                    ErrorCode.INTERNAL.value, exc.message, re=msg.re, session=msg.session
                ),
                key,
            )

    def _send(self, client: bytes, frames: list[bytes]) -> Sent:
        try:
            self.fronts[client[0]][0].send([client[1:], *frames])
            return Sent.DELIVERED
        except zmq.Again:
            return Sent.LAGGING
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            return Sent.GONE

    # ------------------------------------------------------ slow consumers

    def _owe(
        self, client: bytes, lag: Lag, msg: Message, frames: Callable[[], list[bytes]]
    ) -> None:
        """Count `msg` as dropped for a lagging client (an event), or keep
        it for the client (a final answer; see the module docstring)."""
        stream: Stream = (msg.session, msg.re)
        owed = lag.streams.get(stream)
        if owed is None:
            if len(lag.streams) >= MAX_STREAMS and msg.kind is Kind.EVENT:
                stream = (None, None)  # counted, under no stream
                owed = lag.streams.get(stream)
            if owed is None:
                owed = lag.streams[stream] = Owed()
        if msg.kind is Kind.EVENT:
            owed.dropped += 1
            lag.dropped += 1
            return
        kept = frames()
        size = len(kept[-1])
        if size > OWED_ANSWER_BYTES or lag.answer_bytes + size > OWED_BYTES:
            stand_in = error_message(
                ErrorCode.OVERLOADED.value,
                f"this {msg.kind.value} ({size} bytes) was not kept for this client, "
                "which had stopped reading (slow_consumer); read faster, or ask again",
                re=msg.re,
                session=msg.session,
            )
            kept = encode(stand_in, self.fronts[client[0]][1])
        owed.answers.append(kept)
        lag.answers += 1
        lag.answer_bytes += len(kept[-1])
        if lag.answers > MAX_OWED:
            self._drop_oldest_answer(lag)

    def _drop_oldest_answer(self, lag: Lag) -> None:
        for owed in lag.streams.values():
            if owed.answers:
                lag.answer_bytes -= len(owed.answers.pop(0)[-1])
                owed.dropped += 1
                lag.answers -= 1
                lag.dropped += 1
                return

    def _catch_up(self, client: bytes, lag: Lag) -> Sent:
        """Send a lagging client what it is owed, in order, for as long as
        its queue takes it. DELIVERED: all of it, it lags no more."""
        key = self.fronts[client[0]][1]
        streams = lag.streams
        while streams:
            stream, owed = next(iter(streams.items()))
            if owed.dropped:
                session, re = stream
                notice = Message(
                    Kind.EVENT,
                    {
                        "type": "dropped",
                        "data": {"count": owed.dropped, "reason": "slow_consumer"},
                    },
                    session=session,
                    re=re,
                )
                sent = self._send(client, encode(notice, key, self.limits))
                if sent is not Sent.DELIVERED:
                    return self._behind(client, sent)
                owed.dropped = 0
            while owed.answers:
                sent = self._send(client, owed.answers[0])
                if sent is not Sent.DELIVERED:
                    return self._behind(client, sent)
                lag.answer_bytes -= len(owed.answers.pop(0)[-1])
                lag.answers -= 1
            del streams[stream]
        del self.lagging[client]
        log.info(
            kv(
                "slow_consumer_caught_up",
                client=client[1:].hex()[:16],
                dropped=lag.dropped,
                seconds=round(time.monotonic() - lag.since, 3),
            )
        )
        return Sent.DELIVERED

    def _behind(self, client: bytes, sent: Sent) -> Sent:
        if sent is Sent.GONE:
            del self.lagging[client]  # gone: nobody to owe anything to
        return sent

    def _schedule_catch_up(self) -> None:
        if self._catch_up_timer is None and self.lagging:
            self._catch_up_timer = self.loop.call_later(CATCH_UP_INTERVAL, self._catch_up_all)

    def _catch_up_all(self) -> None:
        """The retry timer: every lagging client is tried again. Those found
        gone are reported after the round (their `on_gone` may send)."""
        self._catch_up_timer = None
        gone = []
        for client, lag in list(self.lagging.items()):
            try:
                if self._catch_up(client, lag) is Sent.GONE:
                    gone.append(client)
            except Exception:
                log.exception(kv("bug", where="slow consumer catch-up"))
                self.lagging.pop(client, None)
        self._schedule_catch_up()
        for client in gone:
            self._gone(client)

    def error(
        self, client: bytes, code: ErrorCode, message: str, re: str | None, session: str | None
    ) -> None:
        """Send a client an error reply."""
        self.to_client(client, error_message(code.value, message, re=re, session=session))
