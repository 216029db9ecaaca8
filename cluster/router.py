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
  next sends it something (ROUTER_MANDATORY; door/fronts.py's `on_gone`):
  its watches and log follows are then ended on their nodes, as a
  supervisor ends a gone client's.
  A node counts all of them against the router's one connection, so it
  lets a router have as many as it has room for in all; the router holds
  each front end to a supervisor's per-client limit itself.
- `ping` and `shutdown` (local socket only) are the router's own.
- The front sockets are door/fronts.py's, as a supervisor's are, with the
  same promises: a cap on client connections, a slow front end's events
  counted and told (`dropped`) and its answers kept for it, sockets read in
  bounded batches.
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
import logging
import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import zmq

from hermes_sup.door import gate, privatedir, remote
from hermes_sup.door.fronts import Fronts
from hermes_sup.local.logfmt import kv
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

from .links import NodeLink, reach
from .merge import merge_sessions, merge_status
from .nodes import NodeSpec
from .placement import Candidate, Placement

log = logging.getLogger("hermes_sup.router")

NODE_LOST = "node_lost"
MOVED = "moved"
# How long a fanned-out request waits for slow nodes before it answers
# with those that did (they are shown as not answered).
FANOUT_TIMEOUT = 10.0
MAX_MOVES = 3
# Kinds the router answers itself or fans out; the rest name a session.
FANOUT_KINDS = frozenset({Kind.LIST, Kind.STATUS, Kind.RELOAD})
DRAIN = "drain"
# Messages queued for one front end before it lags (door/fronts.py, "Slow
# consumers"): a router serves many sessions' streams to one front end.
CLIENT_QUEUE = 100_000
# Descriptors kept from client connections for node links (about 4 each).
NODE_FDS = 256


class Mode(Enum):
    """How a request in flight is answered."""

    FORWARD = "forward"  # one node's answers go to the client as they are
    FANOUT = "fanout"  # one answer per node, merged into one
    WATCH_ALL = "watch_all"  # every node's events go to the client
    UNWATCH = "unwatch"  # one `unwatched` once every node said it


@dataclass
class Pending:
    """A request the router forwarded and the client still waits on."""

    id: str
    kind: Kind
    mode: Mode
    client: bytes  # a client id: its front socket's byte, then its routing id
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
        max_clients: int | None = None,
        client_queue: int = CLIENT_QUEUE,
    ) -> None:
        self.state_dir = state_dir
        self.source = source
        self.tcp = tcp
        self.data_dir = data_dir
        self.poll_interval = poll_interval
        self.limits = limits or Limits()
        self.max_clients = max_clients
        self.client_queue = client_queue
        self.placement = Placement()
        self.links: dict[str, NodeLink] = {}
        self.fronts: Fronts | None = None
        self.pending: dict[str, Pending] = {}
        # Watches and log follows open, per front end (see _check_room).
        self.streams: Counter[bytes] = Counter()
        self.guard = ReplayGuard()
        self.started = time.time()
        self.stopping = asyncio.Event()
        self.ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._lock: privatedir.InstanceLock | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # -- start and stop ----------------------------------------------------

    async def run(self) -> None:
        """Bind, follow the membership, serve until SIGTERM/SIGINT or `shutdown`."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        if self.tcp and self.data_dir is None:
            raise remote.RemoteError("--tcp needs --data-dir (the router's CURVE keys live there)")
        privatedir.ensure_private_dir(self.state_dir)
        self._lock = privatedir.InstanceLock(self.state_dir)
        self._lock.acquire()
        self.ctx = zmq.Context()
        try:
            tcp = bool(self.tcp)
            self.fronts = Fronts(
                self.state_dir,
                privatedir.load_or_create_key(self.state_dir),
                max_frame_size=self.limits.max_frame_size,
                client_queue=self.client_queue,
                tcp=self.tcp or "",
                data_dir=self.data_dir,
                max_clients=self.max_clients,
                caps=lambda fd_limit: gate.client_caps(fd_limit, NODE_FDS, self.max_clients, tcp),
                service="router",
                on_gone=self._client_gone,
            )
            self.fronts.listen(self.ctx, loop, self.on_front)
            self._tasks.append(asyncio.create_task(self._follow_membership()))
            log.info(
                kv(
                    "router_started",
                    pid=os.getpid(),
                    endpoints=",".join(e for e in (self.fronts.control, self.fronts.tcp) if e),
                )
            )
            await self.stopping.wait()
        finally:
            self._close()

    def _close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for link in self.links.values():
            link.close()
        self.links.clear()
        if self.fronts is not None:
            self.fronts.close()
        if self.ctx is not None:
            self.ctx.term()
        if self._lock is not None:
            self._lock.release()

    # -- membership ----------------------------------------------------------

    async def _follow_membership(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                specs = await loop.run_in_executor(None, self.source)
            except Exception as exc:  # a registry that is briefly away: keep the last list
                log.warning(kv("router_membership_unavailable", error=exc))
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
                log.info(kv("router_node_removed", node=name))
                self._drop_link(name, "it left the cluster")
        for name, spec in wanted.items():
            if name not in self.links:
                log.info(kv("router_node_added", node=name, endpoint=spec.endpoint))
                loop = asyncio.get_running_loop()
                link = NodeLink(self.ctx, spec, loop, self.on_node, self._on_live)
                self.links[name] = link
            self.links[name].spec = spec
            self._place(self.links[name])

    def _place(self, link: NodeLink) -> None:
        s = link.spec
        self.placement.update(Candidate(s.name, s.capacity, link.live, s.draining or link.draining))

    def _drop_link(self, name: str, why: str) -> None:
        link = self.links.pop(name)
        link.close()
        self.placement.remove(name)
        self._lose_node(name, why)

    def _on_live(self, link: NodeLink, live: bool) -> None:
        """A node's link came up (it joins the watches of all sessions) or
        dropped (what waits on it is answered now)."""
        if live:
            self._join_watches(link)
        else:
            self._lose_node(link.name, "its connection closed")
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

    def on_front(self, index: int, frames: list[bytes]) -> None:
        """One message from a front end: route it, answer it, or refuse it."""
        try:
            self._on_front(bytes([index]) + frames[0], frames)
        except Exception:
            log.exception(kv("router_bug", where="a front end's message"))

    def _on_front(self, client: bytes, frames: list[bytes]) -> None:
        try:
            msg = decode(frames[1:], self._fronts.client_key(client[0]), self.limits)
        except RemoteProtocolError as exc:
            if exc.msg_id is not None:
                self._to_client(client, error_message(exc.code, exc.message, re=exc.msg_id))
            return
        try:
            self._dispatch(client, msg, frames[3])
        except RemoteProtocolError as exc:
            self._to_client(
                client, error_message(exc.code, exc.message, re=msg.id, session=msg.session)
            )

    @property
    def _fronts(self) -> Fronts:
        assert self.fronts is not None
        return self.fronts

    def _dispatch(self, client: bytes, msg: Message, payload: bytes) -> None:
        kind = msg.kind
        if kind is Kind.PING:
            self.guard.check(msg.id, msg.ts, time.time())
            self._to_client(client, msg.reply(Kind.PONG, self._pong()))
        elif kind is Kind.SHUTDOWN:
            self.guard.check(msg.id, msg.ts, time.time())
            if not self._fronts.is_local(client):
                raise RemoteProtocolError(ErrorCode.UNKNOWN_KIND, "shutdown is for local clients")
            self._to_client(
                client, msg.reply(Kind.SHUTDOWN_STARTED, {"pid": os.getpid(), "grace": 0})
            )
            asyncio.get_running_loop().call_later(0.05, self.stopping.set)
        elif kind in FANOUT_KINDS or (kind is Kind.WATCH and msg.session is None):
            self.guard.check(msg.id, msg.ts, time.time())
            self._fan_out(client, msg, payload)
        elif kind is Kind.UNWATCH:
            self.guard.check(msg.id, msg.ts, time.time())
            self._unwatch(client, msg, payload)
        elif kind.value == DRAIN:
            # The nodes take a drain from the router's key: only the router's
            # own operator (its local socket) may ask for one, never a front
            # end on its TCP socket, which nodes would take for the router.
            if not self._fronts.is_local(client):
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
            self._forward(client, msg, payload, node)
        elif msg.session is not None:
            self._forward(client, msg, payload, None)
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

    def _forward(self, client: bytes, msg: Message, payload: bytes, node: str | None) -> None:
        held = self.pending.get(msg.id)
        if held is not None:
            if held.client != client:
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
            self._check_room(client)
        p = Pending(msg.id, msg.kind, Mode.FORWARD, client, msg.session, payload, stream=stream)
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

    def _fan_out(self, client: bytes, msg: Message, payload: bytes) -> None:
        mode = Mode.WATCH_ALL if msg.kind is Kind.WATCH else Mode.FANOUT
        if msg.id in self.pending:
            raise RemoteProtocolError(ErrorCode.REPLAYED, f"message id {msg.id!r} is in use")
        if mode is Mode.WATCH_ALL:
            self._check_room(client)
        p = Pending(msg.id, msg.kind, mode, client, None, payload, stream=mode is Mode.WATCH_ALL)
        for name, link in self.links.items():
            if link.live and self._to_node_raw(name, payload):
                p.nodes.add(name)
        self._add(p)
        if mode is Mode.WATCH_ALL:
            # The client hears `watching` once, whatever the number of nodes.
            self._to_client(client, msg.reply(Kind.EVENT, {"type": "watching", "data": None}))
            return
        p.timer = asyncio.get_running_loop().call_later(FANOUT_TIMEOUT, self._time_out, p)
        self._maybe_complete(p)

    def _check_room(self, client: bytes) -> None:
        """`busy` if this front end has as many watches and log follows open
        as a supervisor allows one client: the nodes count the router as one
        client and let it have more (supervisor/watchers.py), so this is
        where each front end is held to the limit."""
        held = self.streams[client]
        if held >= MAX_WATCHES_PER_CLIENT:
            raise RemoteProtocolError(
                ErrorCode.BUSY,
                f"this client already has {held} watches and log follows open (limit "
                f"{MAX_WATCHES_PER_CLIENT} per client); end one (unwatch) first",
            )

    def _add(self, p: Pending) -> None:
        self.pending[p.id] = p
        if p.stream:
            self.streams[p.client] += 1

    def _unwatch(self, client: bytes, msg: Message, payload: bytes) -> None:
        watched = self.pending.get(msg.body["watch"])
        p = Pending(msg.id, msg.kind, Mode.UNWATCH, client, msg.session, payload)
        p.watch = msg.body["watch"]
        if watched is not None and watched.client == client:
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
            if watched is not None and watched.client == p.client:
                self._finish(watched)
            self._to_client(
                p.client,
                Message(
                    Kind.EVENT, {"type": "unwatched", "data": None}, session=p.session, re=p.id
                ),
            )
        elif p.mode is Mode.FANOUT:
            self._to_client(p.client, self._merged(p))
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
                "control": self._fronts.control,
                "tcp": self._fronts.tcp,
            },
            "state_dir": str(self.state_dir),
            "overrides": len(self.placement.overrides),
        }

    # -- nodes -----------------------------------------------------------------

    def on_node(self, link: NodeLink, frames: list[bytes]) -> None:
        """One message from a node: to the client waiting on it, or merged."""
        try:
            self._on_node(link, frames)
        except Exception:
            log.exception(kv("router_bug", where="a node's message"))

    def _on_node(self, link: NodeLink, frames: list[bytes]) -> None:
        name = link.spec.name
        try:
            msg = decode(frames, link.spec.hmac_key, self.limits)
        except RemoteProtocolError as exc:
            log.warning(kv("router_bad_node_message", node=name, error=exc.message))
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
            self._fronts.to_client(p.client, msg, frames[2])
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
                    self._fronts.to_client(p.client, msg, frames[2])
                    self._finish(p)
            elif not (msg.kind is Kind.EVENT and msg.body.get("type") == "watching"):
                self._fronts.to_client(p.client, msg, frames[2])
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
                log.info(kv("router_node_draining", node=link.spec.name, draining=own["draining"]))
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
                log.info(kv("router_node_draining", node=name, draining=True))
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
        log.info(kv("router_moved", session=p.session, **{"from": name}, to=target))
        return True

    def _to_node_raw(self, name: str, payload: bytes) -> bool:
        link = self.links.get(name)
        if link is None or not link.live:
            return False
        return link.send([MAGIC, sign(link.spec.hmac_key, payload), payload])

    def _to_node(self, name: str, msg: Message) -> None:
        link = self.links.get(name)
        if link is not None:
            self._to_node_raw(name, encode(msg, link.spec.hmac_key)[2])

    # -- answering ---------------------------------------------------------------

    def _client_gone(self, client: bytes) -> None:
        """A front end that is no longer connected (door/fronts.py's
        on_gone): end its watches and log follows on their nodes. Left
        open, they would stay there for good, each counted against the
        router's own connection, which a node allows its MAX_WATCHERS in
        all (supervisor/watchers.py): after that, no front end could watch
        through the router. Its requests in flight end as they would
        anyway, with their final answer."""
        if client not in self.streams:
            return  # none open: the common case, for every send to it that fails
        ended = [p for p in self.pending.values() if p.client == client and p.stream]
        for p in ended:
            for node in p.nodes:
                self._to_node(node, Message(Kind.UNWATCH, {"watch": p.id}))
            self._finish(p)
        if ended:
            log.info(kv("router_client_gone", watches_ended=len(ended)))

    def _to_client(self, client: bytes, msg: Message) -> None:
        self._fronts.to_client(client, msg)

    def _error(self, p: Pending, code: str, message: str) -> None:
        self._to_client(p.client, error_message(code, message, re=p.id, session=p.session))

    def _finish(self, p: Pending) -> None:
        if self.pending.get(p.id) is p:
            del self.pending[p.id]
            if p.stream:
                self.streams[p.client] -= 1
                if self.streams[p.client] <= 0:
                    del self.streams[p.client]
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
    max_clients: int | None = None,
    client_queue: int = CLIENT_QUEUE,
) -> None:
    """Run a router in this process until it is stopped."""
    router = Router(
        state_dir,
        source,
        tcp=tcp,
        data_dir=data_dir,
        poll_interval=poll_interval,
        max_clients=max_clients,
        client_queue=client_queue,
    )
    asyncio.run(router.run())


__all__ = ["NODE_LOST", "MOVED", "Router", "serve_router", "static_source", "new_id"]
