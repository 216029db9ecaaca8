"""`hermes-sup route`: one endpoint in front of many supervisors.

Theory of operation. Front ends connect to the router exactly as to a
supervisor (PROTOCOL.md unchanged): an ipc control socket and key in the
router's own state directory, and optionally a TCP endpoint with CURVE
(keys in the router's data directory, `hermes-sup keys generate --data-dir`).
The router holds one DEALER per node (links.py), as a remote front end of
that node (TCP + CURVE, the node's remote HMAC key). Every request is verified with
the front end's key; its payload is then forwarded unchanged, signed with
the node's key, and every answer comes back the same way. The payload is
never rewritten, so ids, `ttl`, resends and streams mean what they mean
on one supervisor.

- A request about a session goes to the node placement picks for its key
  (placement.py). A `moved` error naming another node records an override
  and sends the same request there, once or twice, unseen by the client.
- `list`, `status`, `reload` and `watch` of every session fan out to every
  live node and are merged (merge.py); `unwatch` goes where its watch went.
  A front end that goes away without `unwatch` is noticed when the router
  next sends it something (ROUTER_MANDATORY): its watches and log follows
  are then ended on their nodes, as a supervisor ends a gone client's.
  A node counts all of them against the router's one connection, so it
  lets a router have as many as it has room for in all; the router holds
  each front end to a supervisor's per-client limit itself.
- `ping` and `shutdown` (local socket only) are the router's own.
- `drain` (local socket only) names its node, and goes to that node, which
  takes it from the router's key (enrolled as `router-*`, remote.py).
- A node's connection is watched (ZMTP heartbeats and a socket monitor):
  when it drops, every request in flight there ends with `node_lost` at
  once, and its keys are placed on the live nodes from then on.
- Membership comes from a static TOML file (re-read when it changes) or
  from a callable such as the Ray registry, polled.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import signal
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from hermes_sup.door import privatedir, remote
from hermes_sup.local import statedir
from hermes_sup.local.frames import (
    EVENTS,
    NOBLOCK,
    POLLIN,
    recv_frames,
    send_frames,
)
from hermes_sup.local.version import version
from hermes_sup.protocol import (
    MAGIC,
    MAX_WATCHES_PER_CLIENT,
    PROTOCOL_VERSION,
    ErrorCode,
    Kind,
    Limits,
    Message,
    RemoteProtocolError,
    ReplayGuard,
    decode,
    encode,
    error_message,
    new_id,
    sign,
)

from .links import SNDHWM, NodeLink, reach
from .merge import merge_sessions, merge_status
from .nodes import NodeSpec
from .placement import Candidate, Placement

log = logging.getLogger("hermes_sup.router")
# The backend's getsockopt, called unbound: an int for EVENTS, no enum.
_get = zmq.backend.Socket.get

NODE_LOST = "node_lost"
MOVED = "moved"
# How long a fanned-out request waits for slow nodes before it answers
# with those that did (they are shown as not answered).
FANOUT_TIMEOUT = 10.0
MAX_MOVES = 3
# Kinds the router answers itself or fans out; the rest name a session.
FANOUT_KINDS = frozenset({Kind.LIST, Kind.STATUS, Kind.RELOAD})
DRAIN = "drain"
GONE_REMEMBERED = 1024  # front ends remembered as gone (see Router._client_gone)


class Mode(Enum):
    """How a request in flight is answered."""

    FORWARD = "forward"  # one node's answers go to the client as they are
    FANOUT = "fanout"  # one answer per node, merged into one
    WATCH_ALL = "watch_all"  # every node's events go to the client
    UNWATCH = "unwatch"  # one `unwatched` once every node said it


@dataclass
class Front:
    """One socket front ends connect to, and the key they sign with."""

    sock: zmq.asyncio.Socket
    key: bytes
    local: bool
    endpoint: str
    sync: zmq.Socket[bytes] = field(init=False)
    reader: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        self.sync = zmq.Socket.shadow(self.sock.underlying)


@dataclass
class Pending:
    """A request the router forwarded and the client still waits on."""

    id: str
    kind: Kind
    mode: Mode
    front: int
    client: bytes
    session: str | None
    payload: bytes
    nodes: set[str] = field(default_factory=set)
    answers: dict[str, Message | None] = field(default_factory=dict)
    stream: bool = False
    moves: int = 0
    answered: bool = False  # FORWARD: the client has had an answer from a node
    watch: str | None = None  # UNWATCH: the watch it ends
    timer: asyncio.TimerHandle | None = None


NodeSource = Callable[[], list[NodeSpec]]


class Router:
    """The router's state and its loop: one asyncio loop does all the routing;
    the only other threads are zmq's ZAP handler (with --tcp) and the
    executor that reads the node list (a file, or Ray's registry)."""

    def __init__(
        self,
        state_dir: Path,
        source: NodeSource,
        *,
        tcp: str | None = None,
        data_dir: Path | None = None,
        poll_interval: float = 1.0,
        limits: Limits | None = None,
    ) -> None:
        self.state_dir = state_dir
        self.source = source
        self.tcp = tcp
        self.data_dir = data_dir
        self.poll_interval = poll_interval
        self.limits = limits or Limits()
        self.placement = Placement()
        self.links: dict[str, NodeLink] = {}
        self.fronts: list[Front] = []
        self.pending: dict[str, Pending] = {}
        # Front ends found gone, so that the turns still answering them do
        # not look again for each message (oldest forgotten first).
        self.gone: OrderedDict[tuple[int, bytes], None] = OrderedDict()
        # Watches and log follows open, per front end (see _check_room).
        self.streams: Counter[tuple[int, bytes]] = Counter()
        self.guard = ReplayGuard()
        self.started = time.time()
        self.stopping = asyncio.Event()
        self.ctx: zmq.asyncio.Context | None = None
        self._lock: privatedir.InstanceLock | None = None
        self._auth: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._fds: dict[int, int] = {}
        self._kicked: list[Callable[[], None]] = []

    # -- start and stop ----------------------------------------------------

    async def run(self) -> None:
        """Bind, follow the membership, serve until SIGTERM/SIGINT or `shutdown`."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        self.sync_ctx: zmq.Context[Any] = zmq.Context()
        self.ctx = zmq.asyncio.Context.shadow(self.sync_ctx)
        try:
            self._bind_local()
            if self.tcp:
                self._bind_tcp()
            for index, front in enumerate(self.fronts):
                front.reader = self._add_reader(
                    front.sync, functools.partial(self.on_front, index, front)
                )
            self._tasks.append(asyncio.create_task(self._follow_membership()))
            log.info(
                "router_started pid=%s endpoints=%s",
                os.getpid(),
                ",".join(f.endpoint for f in self.fronts),
            )
            await self.stopping.wait()
        finally:
            self._close()

    def _bind_local(self) -> None:
        assert self.ctx is not None
        privatedir.ensure_private_dir(self.state_dir)
        self._lock = privatedir.InstanceLock(self.state_dir)
        self._lock.acquire()
        key = privatedir.load_or_create_key(self.state_dir)
        endpoint = statedir.endpoint(self.state_dir, statedir.CONTROL_SOCKET)
        with contextlib.suppress(FileNotFoundError):
            (self.state_dir / statedir.CONTROL_SOCKET).unlink()  # a dead run's socket
        sock = self._front_socket()
        old = os.umask(0o077)
        try:
            sock.bind(endpoint)
        finally:
            os.umask(old)
        self.fronts.append(Front(sock, key, True, endpoint))

    def _bind_tcp(self) -> None:
        """The CURVE endpoint, as a supervisor's (supervisor/endpoints.py)."""
        from zmq.auth.thread import ThreadAuthenticator

        assert self.ctx is not None and self.tcp is not None
        if self.data_dir is None:
            raise remote.RemoteError("--tcp needs --data-dir (the router's CURVE keys live there)")
        host, port = remote.parse_tcp(self.tcp)
        public, secret = remote.server_keys(self.data_dir)
        key = remote.remote_hmac_key(self.data_dir)
        # The ZAP handler runs before the bind: without one every key gets in.
        auth = ThreadAuthenticator(self.sync_ctx, log=logging.getLogger("hermes_sup.zap"))
        self._auth = auth
        auth.start()
        sock = self._front_socket()
        auth.configure_curve_callback(remote.ZAP_DOMAIN, remote.Allowlist(self.data_dir))
        sock.curve_server = True
        sock.curve_publickey = public
        sock.curve_secretkey = secret
        sock.zap_domain = remote.ZAP_DOMAIN.encode()
        endpoint = remote.tcp_endpoint(host, port)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close(0)
            raise remote.RemoteError(f"cannot listen on {endpoint}: {exc}") from None
        self.fronts.append(Front(sock, key, False, endpoint))

    def _front_socket(self) -> zmq.asyncio.Socket:
        assert self.ctx is not None
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        sock.setsockopt(zmq.RCVHWM, SNDHWM)
        sock.setsockopt(zmq.MAXMSGSIZE, int(self.limits.max_frame_size * 1.25) + 4096)
        # (ROUTER_NOTIFY, which would name a client whose connection closed,
        # is a draft option that released libzmq builds refuse.) A send to a
        # client that is gone fails instead of vanishing: see _client_gone.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        return sock

    def _close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for link in self.links.values():
            self._remove_reader(link.reader)
            link.close()
        self.links.clear()
        for front in self.fronts:
            self._remove_reader(front.reader)
            front.sock.close(0)
        if self._auth is not None:
            self._auth.stop()
        if self.ctx is not None:
            self.sync_ctx.term()
        if self._lock is not None:
            self._lock.release()

    # -- reading sockets -----------------------------------------------------

    def _add_reader(
        self, sock: zmq.Socket[bytes], handle: Callable[[list[bytes]], None]
    ) -> Callable[[], None]:
        """Call `handle` for every message on `sock`, straight from the event
        loop's readiness callback: no future per message (a routed turn is
        a handful of messages, and each future cost more than its handling).
        Frames are read with the backend's own calls and plain-int flags
        (local/frames.py): pyzmq's wrappers convert flags and options to
        enums per frame, which cost more than the routing.

        zmq's FD is edge-triggered and a send on the socket may consume the
        edge, so every send looks at its socket again (`_sent`)."""
        fd = int(sock.getsockopt(zmq.FD))

        def read() -> None:
            if sock.closed:
                return
            while _get(sock, EVENTS) & POLLIN:
                try:
                    frames = recv_frames(sock, NOBLOCK)
                except zmq.Again:
                    break
                try:
                    handle(frames)
                except Exception:
                    log.exception("router_bug while handling a message")

        loop = asyncio.get_running_loop()
        loop.add_reader(fd, read)
        loop.call_soon(read)
        self._fds[id(read)] = fd
        return read

    def _remove_reader(self, read: Callable[[], None] | None) -> None:
        if read is not None and id(read) in self._fds:
            asyncio.get_running_loop().remove_reader(self._fds.pop(id(read)))

    def _sent(self, sock: zmq.Socket[bytes], read: Callable[[], None] | None) -> None:
        """After a send on `sock`: if input is waiting there now, read it
        soon (the send may have taken the FD's edge that announced it)."""
        if read is None or read in self._kicked or sock.closed or not _get(sock, EVENTS) & POLLIN:
            return
        if not self._kicked:
            asyncio.get_running_loop().call_soon(self._run_kicked)
        self._kicked.append(read)

    def _run_kicked(self) -> None:
        kicked, self._kicked = self._kicked, []
        for read in kicked:
            read()

    # -- membership ----------------------------------------------------------

    async def _follow_membership(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                specs = await loop.run_in_executor(None, self.source)
            except Exception as exc:  # a registry that is briefly away: keep the last list
                log.warning("router_membership_unavailable error=%s", exc)
            else:
                self.set_nodes(specs)
            await asyncio.sleep(self.poll_interval)

    def set_nodes(self, specs: list[NodeSpec]) -> None:
        """Bring the links toward the node list: connect new nodes, drop gone ones."""
        assert self.ctx is not None
        wanted = {s.name: s for s in specs}
        for name in list(self.links):
            spec = wanted.get(name)
            link = self.links[name]
            if spec is None or reach(spec) != reach(link.spec):
                log.info("router_node_removed node=%s", name)
                self._drop_link(name, "it left the cluster")
        for name, spec in wanted.items():
            if name not in self.links:
                log.info("router_node_added node=%s endpoint=%s", name, spec.endpoint)
                link = NodeLink(self.ctx, spec)
                self.links[name] = link
                link.reader = self._add_reader(link.sync, functools.partial(self.on_node, link))
                link.tasks.append(asyncio.create_task(self._watch_node(link)))
            self.links[name].spec = spec
            self._place(self.links[name])

    def _place(self, link: NodeLink) -> None:
        s = link.spec
        self.placement.update(Candidate(s.name, s.capacity, link.live, s.draining or link.draining))

    def _drop_link(self, name: str, why: str) -> None:
        link = self.links.pop(name)
        self._remove_reader(link.reader)
        link.reader = None
        link.close()
        self.placement.remove(name)
        self._lose_node(name, why)

    async def _watch_node(self, link: NodeLink) -> None:
        """Live from a successful handshake to a disconnect (or heartbeat timeout)."""
        name = link.spec.name
        while True:
            event = parse_monitor_message(await link.monitor.recv_multipart())
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                link.live = True
                log.info("router_node_up node=%s", name)
                self._join_watches(link)
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                if link.live:
                    log.warning("router_node_lost node=%s", name)
                link.live = False
                self._lose_node(name, "its connection closed")
            else:
                log.warning(
                    "router_node_handshake_failed node=%s: the node refused the router's "
                    "CURVE key, or its server key is not %s",
                    name,
                    link.spec.server_key,
                )
            self._place(link)

    def _join_watches(self, link: NodeLink) -> None:
        """A node that comes up joins every watch of all sessions open now.
        The watch is sent anew (same id, fresh `ts`: the node's replay window
        would refuse the first one's); its `watching` is not passed on."""
        name = link.spec.name
        for p in self.pending.values():
            if p.mode is Mode.WATCH_ALL and name not in p.nodes:
                watch = Message(Kind.WATCH, {}, id=p.id)
                if self._to_node_raw(name, encode(watch, link.spec.hmac_key)[2]):
                    p.nodes.add(name)

    def _lose_node(self, name: str, why: str) -> None:
        """Every request waiting on `name` is answered now, not left hanging."""
        for p in list(self.pending.values()):
            if name not in p.nodes:
                continue
            p.nodes.discard(name)
            if p.mode is Mode.FORWARD:
                self._error(
                    p, NODE_LOST, f"node {name} was lost ({why}) while this request ran there"
                )
                self._finish(p)
            elif p.mode is Mode.FANOUT:
                p.answers[name] = None
                self._maybe_complete(p)
            elif p.mode is Mode.UNWATCH:
                self._maybe_complete(p)
            # WATCH_ALL: the other nodes' events keep coming.

    # -- front ends ---------------------------------------------------------

    def on_front(self, index: int, front: Front, frames: list[bytes]) -> None:
        """One message from a front end: route it, answer it, or refuse it."""
        client = frames[0]
        if self.gone:
            self.gone.pop((index, client), None)  # it is back (a fixed routing id)
        try:
            msg = decode(frames[1:], front.key, self.limits)
        except RemoteProtocolError as exc:
            if exc.msg_id is not None:
                self._to_client(index, client, error_message(exc.code, exc.message, re=exc.msg_id))
            return
        try:
            self._dispatch(index, client, msg, frames[3])
        except RemoteProtocolError as exc:
            self._to_client(
                index, client, error_message(exc.code, exc.message, re=msg.id, session=msg.session)
            )

    def _dispatch(self, index: int, client: bytes, msg: Message, payload: bytes) -> None:
        kind = msg.kind
        if kind is Kind.PING:
            self.guard.check(msg.id, msg.ts, time.time())
            self._to_client(index, client, msg.reply(Kind.PONG, self._pong()))
        elif kind is Kind.SHUTDOWN:
            self.guard.check(msg.id, msg.ts, time.time())
            if not self.fronts[index].local:
                raise RemoteProtocolError(ErrorCode.UNKNOWN_KIND, "shutdown is for local clients")
            self._to_client(
                index, client, msg.reply(Kind.SHUTDOWN_STARTED, {"pid": os.getpid(), "grace": 0})
            )
            asyncio.get_running_loop().call_later(0.05, self.stopping.set)
        elif kind in FANOUT_KINDS or (kind is Kind.WATCH and msg.session is None):
            self.guard.check(msg.id, msg.ts, time.time())
            self._fan_out(index, client, msg, payload)
        elif kind is Kind.UNWATCH:
            self.guard.check(msg.id, msg.ts, time.time())
            self._unwatch(index, client, msg, payload)
        elif kind.value == DRAIN:
            # The nodes take a drain from the router's key: only the router's
            # own operator (its local socket) may ask for one, never a front
            # end on its TCP socket, which nodes would take for the router.
            if not self.fronts[index].local:
                raise RemoteProtocolError(
                    ErrorCode.UNKNOWN_KIND,
                    "drain is not accepted from remote front ends; run it on the router's host",
                )
            node = msg.body.get("node")
            if not isinstance(node, str) or node not in self.links:
                raise RemoteProtocolError(
                    ErrorCode.BAD_FIELD,
                    f"through a router, drain names its node in `node` (one of: "
                    f"{', '.join(sorted(self.links)) or 'none'})",
                )
            self._forward(index, client, msg, payload, node)
        elif msg.session is not None:
            self._forward(index, client, msg, payload, None)
        else:
            raise RemoteProtocolError(
                ErrorCode.UNKNOWN_KIND, f"a router does not take {kind.value!r} without a session"
            )

    def _pong(self) -> dict[str, Any]:
        return {
            "version": version(),
            "protocol": PROTOCOL_VERSION,
            "pid": os.getpid(),
            "uptime": time.time() - self.started,
        }

    # -- forwarding ------------------------------------------------------------

    def _forward(
        self, index: int, client: bytes, msg: Message, payload: bytes, node: str | None
    ) -> None:
        held = self.pending.get(msg.id)
        if held is not None:
            if (held.front, held.client) != (index, client):
                # One supervisor hands a turn to a client that reconnected once
                # the old connection is gone; a router cannot tell it is.
                raise RemoteProtocolError(
                    ErrorCode.REPLAYED, f"message id {msg.id!r} is another connection's request"
                )
            # The same client resending (a timed-out send): its node answers
            # it as a duplicate, never running it twice.
            target = next(iter(held.nodes), None)
            if target is not None and self._to_node_raw(target, payload):
                return
            self._error(held, NODE_LOST, "the node that ran this request is gone")
            self._finish(held)
            return
        if node is None:
            assert msg.session is not None
            node = self.placement.owner(msg.session)
        stream = msg.kind is Kind.WATCH or (msg.kind is Kind.LOGS and bool(msg.body.get("follow")))
        if stream:
            self._check_room(index, client)
        p = Pending(
            msg.id, msg.kind, Mode.FORWARD, index, client, msg.session, payload, stream=stream
        )
        if node is None or not self._to_node_raw(node, payload):
            self._error(
                p,
                NODE_LOST,
                "no live node can take this session now"
                if node is None
                else f"node {node} is not reachable",
            )
            return
        p.nodes.add(node)
        self._add(p)

    def _fan_out(self, index: int, client: bytes, msg: Message, payload: bytes) -> None:
        mode = Mode.WATCH_ALL if msg.kind is Kind.WATCH else Mode.FANOUT
        if msg.id in self.pending:
            raise RemoteProtocolError(ErrorCode.REPLAYED, f"message id {msg.id!r} is in use")
        if mode is Mode.WATCH_ALL:
            self._check_room(index, client)
        p = Pending(
            msg.id, msg.kind, mode, index, client, None, payload, stream=mode is Mode.WATCH_ALL
        )
        for name, link in self.links.items():
            if link.live and self._to_node_raw(name, payload):
                p.nodes.add(name)
        self._add(p)
        if mode is Mode.WATCH_ALL:
            # The client hears `watching` once, whatever the number of nodes.
            self._to_client(
                index, client, msg.reply(Kind.EVENT, {"type": "watching", "data": None})
            )
            return
        p.timer = asyncio.get_running_loop().call_later(FANOUT_TIMEOUT, self._time_out, p)
        self._maybe_complete(p)

    def _check_room(self, index: int, client: bytes) -> None:
        """`busy` if this front end has as many watches and log follows open
        as a supervisor allows one client: the nodes count the router as one
        client and let it have more (supervisor/watchers.py), so this is
        where each front end is held to the limit."""
        held = self.streams[(index, client)]
        if held >= MAX_WATCHES_PER_CLIENT:
            raise RemoteProtocolError(
                ErrorCode.BUSY,
                f"this client already has {held} watches and log follows open (limit "
                f"{MAX_WATCHES_PER_CLIENT} per client); end one (unwatch) first",
            )

    def _add(self, p: Pending) -> None:
        self.pending[p.id] = p
        if p.stream:
            self.streams[(p.front, p.client)] += 1

    def _unwatch(self, index: int, client: bytes, msg: Message, payload: bytes) -> None:
        watched = self.pending.get(msg.body["watch"])
        p = Pending(msg.id, msg.kind, Mode.UNWATCH, index, client, msg.session, payload)
        p.watch = msg.body["watch"]
        if watched is not None and (watched.front, watched.client) == (index, client):
            for node in watched.nodes:
                if self._to_node_raw(node, payload):
                    p.nodes.add(node)
        self.pending[msg.id] = p
        self._maybe_complete(p)

    def _time_out(self, p: Pending) -> None:
        if self.pending.get(p.id) is p:
            for name in p.nodes:
                p.answers[name] = None
            p.nodes.clear()
            self._maybe_complete(p)

    def _maybe_complete(self, p: Pending) -> None:
        if p.nodes or self.pending.get(p.id) is not p:
            return
        if p.mode is Mode.UNWATCH:
            watched = self.pending.get(p.watch or "")
            if watched is not None and (watched.front, watched.client) == (p.front, p.client):
                self._finish(watched)
            self._to_client(
                p.front,
                p.client,
                Message(
                    Kind.EVENT, {"type": "unwatched", "data": None}, session=p.session, re=p.id
                ),
            )
        elif p.mode is Mode.FANOUT:
            self._to_client(p.front, p.client, self._merged(p))
        self._finish(p)

    def _merged(self, p: Pending) -> Message:
        ok = {n: m for n, m in p.answers.items() if m is not None and m.kind is not Kind.ERROR}
        if p.kind is Kind.LIST:
            rows = {n: list(m.body.get("sessions", [])) for n, m in ok.items()}
            body: dict[str, Any] = {"sessions": merge_sessions(rows, self.placement.owner)}
            return Message(Kind.SESSIONS, body, re=p.id)
        if p.kind is Kind.STATUS:
            answers = {
                n: (m.body["supervisor"] if m is not None and n in ok else None)
                for n, m in p.answers.items()
            }
            nodes = {n: {**k.spec.describe(), "live": k.live} for n, k in self.links.items()}
            return Message(
                Kind.INFO, {"supervisor": merge_status(self._info(), answers, nodes)}, re=p.id
            )
        # reload: what changed anywhere, and what needs a restart anywhere
        changed: set[str] = set()
        restart: set[str] = set()
        for m in ok.values():
            changed.update(str(x) for x in m.body.get("changed", []))
            restart.update(str(x) for x in m.body.get("restart_needed", []))
        errors = [m for m in p.answers.values() if m is not None and m.kind is Kind.ERROR]
        if not ok and errors:
            return Message(Kind.ERROR, errors[0].body, re=p.id)  # e.g. every node refused it
        return Message(
            Kind.RELOADED, {"changed": sorted(changed), "restart_needed": sorted(restart)}, re=p.id
        )

    def _info(self) -> dict[str, Any]:
        return {
            **self._pong(),
            "role": "router",
            "started": self.started,
            "endpoints": {
                "control": self.fronts[0].endpoint if self.fronts else None,
                "tcp": next((f.endpoint for f in self.fronts if not f.local), None),
            },
            "state_dir": str(self.state_dir),
            "overrides": len(self.placement.overrides),
        }

    # -- nodes -----------------------------------------------------------------

    def on_node(self, link: NodeLink, frames: list[bytes]) -> None:
        """One message from a node: to the client waiting on it, or merged."""
        name = link.spec.name
        try:
            msg = decode(frames, link.spec.hmac_key, self.limits)
        except RemoteProtocolError as exc:
            log.warning("router_bad_node_message node=%s error=%s", name, exc.message)
            return
        p = self.pending.get(msg.re or "")
        if p is None or name not in p.nodes:
            return  # an answer to a request given up on
        self._learn(link, msg)
        if p.mode is Mode.FORWARD:
            if (
                msg.kind is Kind.ERROR
                and msg.body.get("code") == MOVED
                and self._move(p, msg, name)
            ):
                return
            p.answered = True
            self._to_client_raw(p.front, p.client, frames[2])
            if self._is_final(p, msg):
                self._finish(p)
        elif p.mode is Mode.FANOUT:
            p.answers[name] = msg
            p.nodes.discard(name)
            self._maybe_complete(p)
        elif p.mode is Mode.WATCH_ALL:
            if msg.kind is Kind.ERROR:
                p.nodes.discard(name)  # this node refused the watch; others go on
                if not p.nodes:
                    self._to_client_raw(p.front, p.client, frames[2])
                    self._finish(p)
            elif not (msg.kind is Kind.EVENT and msg.body.get("type") == "watching"):
                self._to_client_raw(p.front, p.client, frames[2])
        elif p.mode is Mode.UNWATCH:
            p.nodes.discard(name)
            self._maybe_complete(p)

    def _learn(self, link: NodeLink, msg: Message) -> None:
        """A node's own word on its draining: a drain's answer, its status."""
        own: object = None
        if msg.kind is Kind.INFO:
            own = msg.body["supervisor"].get("node")
        elif msg.kind.value == "node":
            own = msg.body.get("node")
        if isinstance(own, dict) and isinstance(own.get("draining"), bool):
            if own["draining"] != link.draining:
                log.info(
                    "router_node_draining node=%s draining=%s", link.spec.name, own["draining"]
                )
                link.draining = own["draining"]
                self._place(link)

    def _is_final(self, p: Pending, msg: Message) -> bool:
        if msg.kind is Kind.ERROR:
            return True
        if p.kind is Kind.SEND:
            return msg.kind is not Kind.EVENT
        return not p.stream  # a stream ends with its unwatch

    def _move(self, p: Pending, msg: Message, name: str) -> bool:
        """A node says the session is held elsewhere, or that it is draining:
        follow it to the holder, or to where the hash places it now."""
        target = msg.body.get("node")
        if p.session is None or p.moves >= MAX_MOVES or p.answered:
            # Once a node answered anything (a turn that started there), a
            # resend elsewhere could run it twice: the client decides.
            return False
        if target is None and msg.body.get("reason") == "draining":
            link = self.links.get(name)
            if link is not None and not link.draining:
                log.info("router_node_draining node=%s draining=True", name)
                link.draining = True
                self._place(link)
            if self.placement.overrides.get(p.session) == name:
                self.placement.overrides.forget(p.session)
            target = self.placement.owner(p.session)
        elif isinstance(target, str) and target in self.links:
            self.placement.overrides.set(p.session, target)
        else:
            return False
        if target is None or target == name:
            return False
        p.nodes.discard(name)
        p.moves += 1
        if not self._to_node_raw(target, p.payload):
            return False
        p.nodes.add(target)
        log.info("router_moved session=%s from=%s to=%s", p.session, name, target)
        return True

    def _to_node_raw(self, name: str, payload: bytes) -> bool:
        link = self.links.get(name)
        if link is None or not link.live:
            return False
        try:
            send_frames(link.sync, [MAGIC, sign(link.spec.hmac_key, payload), payload], NOBLOCK)
        except zmq.Again:
            return False  # no connection up (IMMEDIATE), or its queue is full
        finally:
            self._sent(link.sync, link.reader)
        return True

    def _to_node(self, name: str, msg: Message) -> None:
        link = self.links.get(name)
        if link is not None:
            self._to_node_raw(name, encode(msg, link.spec.hmac_key)[2])

    # -- answering ---------------------------------------------------------------

    def _to_client_raw(self, index: int, client: bytes, payload: bytes) -> None:
        front = self.fronts[index]
        try:
            send_frames(front.sync, [client, MAGIC, sign(front.key, payload), payload], NOBLOCK)
        except zmq.Again:
            pass  # a client over its queue loses this message, as zmq would drop it
        except zmq.ZMQError as exc:
            if exc.errno == errno.EHOSTUNREACH:
                self._client_gone(index, client)
        self._sent(front.sync, front.reader)

    def _client_gone(self, index: int, client: bytes) -> None:
        """A front end that is no longer connected: end its watches and log
        follows on their nodes. Left open, they would stay there for good,
        each counted against the router's own connection, which a node
        allows its MAX_WATCHERS in all (supervisor/watchers.py): after
        that, no front end could watch through the router. Its requests in
        flight end as they would anyway, with their final answer."""
        who = (index, client)
        if who in self.gone:
            return
        self.gone[who] = None
        if len(self.gone) > GONE_REMEMBERED:
            self.gone.popitem(last=False)
        ended = [p for p in self.pending.values() if (p.front, p.client) == who and p.stream]
        for p in ended:
            for node in p.nodes:
                self._to_node(node, Message(Kind.UNWATCH, {"watch": p.id}))
            self._finish(p)
        if ended:
            log.info("router_client_gone watches_ended=%d", len(ended))

    def _to_client(self, index: int, client: bytes, msg: Message) -> None:
        self._to_client_raw(index, client, encode(msg, self.fronts[index].key, self.limits)[2])

    def _error(self, p: Pending, code: str, message: str) -> None:
        self._to_client(p.front, p.client, error_message(code, message, re=p.id, session=p.session))

    def _finish(self, p: Pending) -> None:
        if self.pending.get(p.id) is p:
            del self.pending[p.id]
            if p.stream:
                who = (p.front, p.client)
                self.streams[who] -= 1
                if self.streams[who] <= 0:
                    del self.streams[who]
        if p.timer is not None:
            p.timer.cancel()


def static_source(path: Path) -> NodeSource:
    """Nodes from a TOML file, re-read when it changes (load_nodes)."""
    from .nodes import load_nodes

    cache: dict[str, Any] = {"mtime": None, "specs": []}

    def read() -> list[NodeSpec]:
        mtime = path.stat().st_mtime_ns
        if mtime != cache["mtime"]:
            cache["specs"] = load_nodes(path)
            cache["mtime"] = mtime
        return list(cache["specs"])

    return read


def serve_router(
    state_dir: Path,
    source: NodeSource,
    *,
    tcp: str | None = None,
    data_dir: Path | None = None,
    poll_interval: float = 1.0,
) -> None:
    """Run a router in this process until it is stopped."""
    router = Router(state_dir, source, tcp=tcp, data_dir=data_dir, poll_interval=poll_interval)
    asyncio.run(router.run())


__all__ = ["NODE_LOST", "MOVED", "Router", "serve_router", "static_source", "new_id"]
