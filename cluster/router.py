"""`hermes-sup route`: one endpoint in front of many supervisors.

Theory of operation. Front ends connect to the router exactly as to a
supervisor (PROTOCOL.md unchanged): an ipc control socket and key in the
router's own state directory, and optionally a TCP endpoint with CURVE
(keys in the router's data directory, `hermes-sup keys generate --data-dir`).
The front sockets are a supervisor's (door/fronts.py), with the same
promises: a cap on client connections, a slow front end's events counted
and told (`dropped`) and its answers kept for it, sockets read in bounded
batches, and a front end that goes away noticed when the router next sends
it something (`on_gone`).

The router holds one DEALER per node (links.py), as a remote front end of
that node (TCP + CURVE, the node's remote HMAC key). Every request is
verified with the front end's key; its payload is then forwarded
unchanged, signed with the node's key, and every answer comes back the
same way. The payload is never rewritten, so ids, `ttl`, resends and
streams mean what they mean on one supervisor.

Where each request goes, and what its answers become, is routing.py's
(sans-IO: requests in, messages out). This module is the composition root
and the loop around it: the sockets, the node list, signals, shutdown, and
the requests that are the router's own, one handler per kind:

- `ping`, and `shutdown` (local socket only);
- `drain` (local socket only) names its node, and goes to that node, which
  takes it from the router's key (enrolled as `router-*`, door/remote.py);
- every other kind is routing.py's: forwarded, fanned out and merged, or
  ended where its watch went.

A node's connection is watched (ZMTP heartbeats and a socket monitor,
links.py): when it drops, every request in flight there ends with
`node_lost` at once, and its keys are placed on the live nodes from then
on. Membership comes from a static TOML file (re-read when it changes) or
from a callable such as the Ray registry, polled.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from hermes_sup.door import gate, privatedir, remote
from hermes_sup.door.fronts import Fronts
from hermes_sup.local.logfmt import kv
from hermes_sup.local.version import pong_body
from hermes_sup.protocol import (
    MAGIC,
    ErrorCode,
    Kind,
    Limits,
    Message,
    RemoteProtocolError,
    decode,
    encode,
    sign,
)

from .homes import HomeStore
from .links import NodeLink, reach
from .nodes import NodeSpec
from .router_watch import RouterSnapshot, RouterWatch
from .routing import (
    MOVED,
    NODE_LOST,
    LookUp,
    Out,
    Record,
    RoutingTable,
    TimeOut,
    ToClient,
    ToNode,
)

log = logging.getLogger("hermes_sup.router")

# Messages queued for one front end before it lags (door/fronts.py, "Slow
# consumers"): a router serves many sessions' streams to one front end.
CLIENT_QUEUE = 100_000
# Descriptors kept from client connections for node links (about 4 each).
NODE_FDS = 256
SNAPSHOT_EVERY = 1.0  # seconds between two snapshots for the metrics endpoint
# Seconds between two pings of every linked node: a node with --lease-time
# renews its lease only while a router reaches it (supervisor/node_lease.py).
TOUCH_EVERY = 1.0

NodeSource = Callable[[], list[NodeSpec]]
Handler = Callable[[bytes, Message, bytes], None]


class Router:
    """The router's sockets and its loop: one asyncio loop does all the
    routing; the only other threads are zmq's ZAP handler (with --tcp), the
    client gate's, the executor that reads the node list (a file, or Ray's
    registry), and the metrics endpoint's (with --metrics: router_watch.py,
    which reads a snapshot the loop writes once a second)."""

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
        metrics: tuple[str, int] | None = None,
        homes: HomeStore | None = None,
    ) -> None:
        self.state_dir = state_dir
        self.homes = homes
        self.metrics = metrics
        self.watch: RouterWatch | None = None
        self.requests = 0  # taken from front ends (for the metrics)
        self.losses_gone = 0  # link losses of nodes since removed
        self.source = source
        self.tcp = tcp
        self.data_dir = data_dir
        self.poll_interval = poll_interval
        self.limits = limits or Limits()
        self.max_clients = max_clients
        self.client_queue = client_queue
        self.routing = RoutingTable(self._info, homes=homes is not None)
        self.links: dict[str, NodeLink] = {}
        self.started = time.time()
        self.stopping = asyncio.Event()
        self.handlers: dict[Kind, Handler] = {
            Kind.PING: self.ping,
            Kind.SHUTDOWN: self.shutdown,
            Kind.DRAIN: self.drain,
        }
        self._fronts: Fronts | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._lock: privatedir.InstanceLock | None = None
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def fronts(self) -> Fronts:
        """The front sockets (once `run` has bound them)."""
        assert self._fronts is not None
        return self._fronts

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
        self._ctx = zmq.Context()
        try:
            tcp, wanted = bool(self.tcp), self.max_clients
            self._fronts = Fronts(
                self.state_dir,
                privatedir.load_or_create_key(self.state_dir),
                max_frame_size=self.limits.max_frame_size,
                client_queue=self.client_queue,
                tcp=self.tcp or "",
                data_dir=self.data_dir,
                max_clients=wanted,
                caps=lambda fd_limit: gate.client_caps(fd_limit, NODE_FDS, wanted, tcp),
                service="router",
                on_gone=self._client_gone,
            )
            self._fronts.listen(self._ctx, loop, self.on_front)
            self._tasks.append(asyncio.create_task(self._follow_membership()))
            self._tasks.append(asyncio.create_task(self._keep_in_touch()))
            if self.metrics is not None:
                self.watch = RouterWatch()
                url = self.watch.serve(*self.metrics)
                log.info(kv("router_metrics", url=url + "/metrics", health=url + "/healthz"))
                self._tasks.append(asyncio.create_task(self._snapshots()))
            endpoints = (self._fronts.control, self._fronts.tcp)
            log.info(
                kv("router_started", pid=os.getpid(), endpoints=",".join(e for e in endpoints if e))
            )
            await self.stopping.wait()
        finally:
            self._close()

    def _close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.watch is not None:
            self.watch.close()
        for link in self.links.values():
            link.close()
        self.links.clear()
        if self._fronts is not None:
            self._fronts.close()
        if self._ctx is not None:
            self._ctx.term()
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

    async def _keep_in_touch(self) -> None:
        """Ping every linked node each TOUCH_EVERY seconds: it tells a node
        that routers still reach it (its answers are not waited for)."""
        while True:
            await asyncio.sleep(TOUCH_EVERY)
            for link in list(self.links.values()):
                if link.live:
                    self._to_node(ToNode(link.name, Message(Kind.PING, {})))

    async def _snapshots(self) -> None:
        """What the metrics and health endpoint show, written once a second
        (its thread reads only this)."""
        assert self.watch is not None
        while True:
            self.watch.snapshot = RouterSnapshot(
                nodes={name: link.live for name, link in self.links.items()},
                pending=len(self.routing.pending),
                overrides=len(self.routing.placement.overrides),
                requests=self.requests,
                node_losses=self.losses_gone + sum(k.losses for k in self.links.values()),
            )
            await asyncio.sleep(SNAPSHOT_EVERY)

    def set_nodes(self, specs: list[NodeSpec]) -> None:
        """Bring the links toward the node list: connect new nodes, drop gone ones."""
        assert self._ctx is not None
        wanted = {s.name: s for s in specs}
        for name in list(self.links):
            spec = wanted.get(name)
            if spec is None or reach(spec) != reach(self.links[name].spec):
                log.info(kv("router_node_removed", node=name))
                gone = self.links.pop(name)
                self.losses_gone += gone.losses
                gone.close()
                self._do(self.routing.remove_node(name, "it left the cluster"))
        loop = asyncio.get_running_loop()
        for name, spec in wanted.items():
            if name not in self.links:
                log.info(kv("router_node_added", node=name, endpoint=spec.endpoint))
                self.links[name] = NodeLink(self._ctx, spec, loop, self.on_node, self._on_live)
            self.links[name].spec = spec
            self.routing.set_node(spec)

    def _on_live(self, link: NodeLink, live: bool) -> None:
        """A node's link came up (it joins the watches of all sessions) or
        dropped (what waits on it is answered now)."""
        if live:
            self._do(self.routing.on_node_up(link.name))
        else:
            self._do(self.routing.on_node_lost(link.name, "its connection closed"))

    # -- what arrives --------------------------------------------------------

    def on_front(self, index: int, frames: list[bytes]) -> None:
        """One message from a front end on front socket `index`: the
        router's own, or the routing's."""
        client = bytes([index]) + frames[0]
        self.requests += 1
        try:
            msg = decode(frames[1:], self.fronts.client_key(index), self.limits)
        except RemoteProtocolError as exc:
            if exc.msg_id is not None:
                self.fronts.error(client, exc.code, exc.message, exc.msg_id, None)
            return
        try:
            handler = self.handlers.get(msg.kind)
            if handler is None:
                self._do(self.routing.on_request(client, msg, frames[3]))
            else:
                handler(client, msg, frames[3])
        except RemoteProtocolError as exc:
            self.fronts.error(client, exc.code, exc.message, msg.id, msg.session)
        except Exception:
            log.exception(kv("router_bug", kind=msg.kind.value))

    def on_node(self, link: NodeLink, frames: list[bytes]) -> None:
        """One message from a node: to the client waiting on it, or merged."""
        try:
            msg = decode(frames, link.spec.hmac_key, self.limits)
        except RemoteProtocolError as exc:
            log.warning(kv("router_bad_node_message", node=link.name, error=exc.message))
            return
        try:
            self._do(self.routing.on_answer(link.name, msg, frames[2]))
        except Exception:
            log.exception(kv("router_bug", node=link.name, kind=msg.kind.value))

    def _client_gone(self, client: bytes) -> None:
        """A front end found gone (Fronts.on_gone): its streams end."""
        self._do(self.routing.on_client_gone(client))

    # -- what goes out ---------------------------------------------------------

    def _do(self, outs: list[Out]) -> None:
        """Carry out what the routing decided, in order."""
        for out in outs:
            if type(out) is ToClient:
                self.fronts.to_client(out.client, out.msg, out.payload)
            elif type(out) is ToNode:
                if not self._to_node(out):
                    self._do(self.routing.on_unsent(out.node, out.re))
            elif type(out) is TimeOut:
                asyncio.get_running_loop().call_later(out.seconds, self._time_out, out.id)
            elif type(out) is LookUp:
                self._tasks.append(asyncio.create_task(self._look_up(out)))
            elif type(out) is Record:
                self._tasks.append(asyncio.create_task(self._record(out)))

    async def _record(self, out: Record) -> None:
        """Record the homes of a node's keys (blocking I/O: in the executor)."""
        assert self.homes is not None
        me = asyncio.current_task()
        try:
            held = await asyncio.get_running_loop().run_in_executor(
                None, self.homes.claim_many, out.homes
            )
        except Exception as exc:  # the store away: the keys are looked up when asked
            log.warning(kv("router_homes_unrecorded", keys=len(out.homes), error=exc))
        else:
            self._do(self.routing.on_homes(out.homes, held))
        finally:
            if me in self._tasks:
                self._tasks.remove(me)

    async def _look_up(self, out: LookUp) -> None:
        """A key's home from the store (blocking I/O: in the executor)."""
        assert self.homes is not None
        me = asyncio.current_task()
        try:
            home = await asyncio.get_running_loop().run_in_executor(
                None, self.homes.claim, out.key, out.data
            )
        except Exception as exc:  # the store away (the GCS restarting): the requests are told
            log.warning(kv("router_home_unavailable", session=out.key, error=exc))
            self._do(self.routing.on_home(out.key, None, str(exc) or type(exc).__name__))
        else:
            if home != out.data:
                log.info(kv("router_home_elsewhere", session=out.key, home=home, placed=out.data))
            self._do(self.routing.on_home(out.key, home))
        finally:
            if me in self._tasks:
                self._tasks.remove(me)

    def _to_node(self, out: ToNode) -> bool:
        link = self.links.get(out.node)
        if link is None:
            return False
        key = link.spec.hmac_key
        payload = out.payload if isinstance(out.payload, bytes) else encode(out.payload, key)[2]
        return link.send([MAGIC, sign(key, payload), payload])

    def _time_out(self, request: str) -> None:
        self._do(self.routing.on_timeout(request))

    # -- the router's own requests ---------------------------------------------

    def ping(self, client: bytes, msg: Message, payload: bytes) -> None:
        self.routing.guard.check(msg.id, msg.ts, time.time())
        self.fronts.to_client(client, msg.reply(Kind.PONG, pong_body(self.started)))

    def shutdown(self, client: bytes, msg: Message, payload: bytes) -> None:
        self.routing.guard.check(msg.id, msg.ts, time.time())
        if not self.fronts.is_local(client):
            raise RemoteProtocolError(ErrorCode.UNKNOWN_KIND, "shutdown is for local clients")
        self.fronts.to_client(
            client, msg.reply(Kind.SHUTDOWN_STARTED, {"pid": os.getpid(), "grace": 0})
        )
        asyncio.get_running_loop().call_later(0.05, self.stopping.set)

    def drain(self, client: bytes, msg: Message, payload: bytes) -> None:
        # The nodes take a drain from the router's key: only the router's
        # own operator (its local socket) may ask for one, never a front
        # end on its TCP socket, which nodes would take for the router.
        if not self.fronts.is_local(client):
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
        self._do(self.routing.on_request(client, msg, payload, node))

    def _info(self) -> dict[str, Any]:
        """The router's own part of a merged `status`."""
        return {
            **pong_body(self.started),
            "role": "router",
            "started": self.started,
            "endpoints": {"control": self.fronts.control, "tcp": self.fronts.tcp},
            "state_dir": str(self.state_dir),
            "overrides": len(self.routing.placement.overrides),
        }


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
    metrics: tuple[str, int] | None = None,
    homes: HomeStore | None = None,
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
        metrics=metrics,
        homes=homes,
    )
    asyncio.run(router.run())


__all__ = ["CLIENT_QUEUE", "MOVED", "NODE_LOST", "Router", "serve_router", "static_source"]
