"""The router's decisions, sans-IO: where a request goes, what its answers
become, and what is owed when a node or a front end goes away.

Theory of operation. A `RoutingTable` touches no socket and no timer, and
imports no zmq. Each of its `on_*` methods takes what arrived (a front
end's request, a node's answer, a node up or lost, a timeout, a front end
gone) and returns what to do about it, in order:

    ToClient(client, msg, payload)   a message for a front end; `payload`,
                                     when given, is a node's own envelope of
                                     `msg`, passed on unchanged (re-signed)
    ToNode(node, payload, re)        a request (its payload, or a Message to
                                     encode) for a node; `re` names the
                                     request it serves
    TimeOut(id, seconds)             call on_timeout(id) that much later
    LookUp(key, data)                ask the home store (homes.py) where the
                                     key's history is, recording `data` if
                                     nowhere yet; then call on_home(key, home)
    Record(homes)                    record these (key, data) homes where none
                                     is yet; then call on_homes(what it holds)

The router (router.py) carries them out. A ToNode that cannot be sent (the
node's queue is full, or its connection went down before its monitor said
so) comes back as `on_unsent(node, re)`: for that request, the node will
not answer. The routing itself sends only to nodes it knows live, as a
link's monitor reports them (`on_node_up`, `on_node_lost`).

With a home store (`homes=True`), a request about a key whose home this
table has not seen waits for a LookUp, once per key, and then goes to a
live node serving that home: where placement puts the key if that node
does, else the best-scoring live node that does. If none does, the
request is answered `home_unavailable` naming the home's node, and never
sent on: a key has one history. A node with data of its own that comes up
is asked for its sessions (`list`), and their homes recorded as that node
where none is yet: keys made before homes were recorded, or while this
router did not run, are known too. A key recorded elsewhere is logged:
it has two histories (`route reconcile` lists them).

A request in flight is a `Pending`, answered in one of four ways (`Mode`):

- FORWARD: a request about a session goes to the node placement picks for
  its key (placement.py), and the node's answers go to the front end as
  they are. A `moved` error naming another node records an override and
  sends the same request there, at most MAX_MOVES times: then the front
  end gets the `moved`. A request other than a `send` is never sent again
  once a node has answered anything for it. A `send` may be: its id is
  its turn's id, which every node sharing the data knows from the
  session's turn journal, so a turn is joined, or answered from the
  journal, never run twice. A `moved` naming a node that is not live
  (lost, or gone from the node list) means its lease is still held while
  the node's processes die (a moment on a local file system; on NFS,
  until the server's lease time runs out; for a frozen node, until it
  wakes): the request is sent again where placement puts it, with growing
  pauses, for up to HOLDER_GONE_WAIT seconds, before the front end gets
  the `moved`.
- FANOUT: `list`, `status` and `reload` go to every live node; their
  answers are merged into one (merge.py) once all are in, or after
  FANOUT_TIMEOUT with those that are (the others shown as not answered).
- WATCH_ALL: a watch of every session goes to every live node, and to each
  node that comes up later; the front end hears `watching` once, and
  every node's events.
- UNWATCH: goes where its watch went; one `unwatched` once every node said it.

A node that is lost answers every request waiting on it at once
(`node_lost`, or as not answered in a merge), except a `send`, which is
sent where placement now puts its session when that node shares the lost
one's data directory (`shared_data` in the node list; up to MAX_MOVES
times in all). A front end may have
MAX_WATCHES_PER_CLIENT watches and log follows open (`streams`), as on one
supervisor: the nodes count them all against the router's one connection.
A front end found gone has them ended on their nodes.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple

from hermes_sup.local.logfmt import kv
from hermes_sup.protocol import (
    MAX_WATCHES_PER_CLIENT,
    ErrorCode,
    Kind,
    Message,
    RemoteProtocolError,
    ReplayGuard,
    error_message,
)

from .homes import OWN_DATA, KnownHomes, describe_home, home_node
from .merge import merge_reloads, merge_sessions, merge_status
from .nodes import NodeSpec
from .placement import Candidate, Placement, rendezvous

log = logging.getLogger("hermes_sup.router")

NODE_LOST = "node_lost"
MOVED = "moved"
HOME_UNAVAILABLE = ErrorCode.HOME_UNAVAILABLE
# How long a fanned-out request waits for slow nodes before it answers
# with those that did (they are shown as not answered).
FANOUT_TIMEOUT = 10.0
MAX_MOVES = 3
# How long a request waits, in all, for the lease of a session whose holder
# is gone to come free (well inside a request's 60 s replay window, since
# it is sent again as its client signed it), and its pauses (doubling).
HOLDER_GONE_WAIT = 30.0
FIRST_PAUSE, LONGEST_PAUSE = 0.05, 2.0
# Kinds that go to every live node and are merged.
FANOUT_KINDS = frozenset({Kind.LIST, Kind.STATUS, Kind.RELOAD})


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
    nodes: set[str] = field(default_factory=set)  # those it waits on
    answers: dict[str, Message | None] = field(default_factory=dict)
    stream: bool = False
    moves: int = 0
    answered: bool = False  # FORWARD: the client has had an answer from a node
    waited: float = 0.0  # FORWARD: paused so far for a gone holder's lease
    watch: str | None = None  # UNWATCH: the watch it ends


@dataclass
class Node:
    """What the routing knows of a node: its entry in the node list,
    whether its link is up, and what it last said of its draining (drain
    answers, status, `moved` for draining)."""

    spec: NodeSpec
    live: bool = False
    draining: bool = False


class ToClient(NamedTuple):
    """Send `msg` to a front end (`payload`: a node's own envelope of it)."""

    client: bytes
    msg: Message
    payload: bytes | None = None


class ToNode(NamedTuple):
    """Send a request to a node: its payload as the front end signed it,
    or a Message of the router's own."""

    node: str
    payload: bytes | Message
    re: str | None = None


class TimeOut(NamedTuple):
    """Call on_timeout(id) after `seconds`."""

    id: str
    seconds: float


class LookUp(NamedTuple):
    """Ask the home store where `key`'s history is, recording `data` as its
    home if it has none; then call on_home(key, home)."""

    key: str
    data: str


class Record(NamedTuple):
    """Record each (key, data) as the key's home where it has none; then
    call on_homes(the homes the store holds for them)."""

    homes: list[tuple[str, str]]


Out = ToClient | ToNode | TimeOut | LookUp | Record


class RoutingTable:
    """Pending requests in, messages to send out (see the module docstring).

    `about()` is the router's own part of a merged `status` (role, pid,
    endpoints); `wall` is the clock of the replay window."""

    def __init__(
        self,
        about: Callable[[], dict[str, Any]] = dict,
        *,
        placement: Placement | None = None,
        wall: Callable[[], float] = time.time,
        homes: bool = False,
    ) -> None:
        self.about = about
        self.use_homes = homes
        # Keys' homes as the store answered (a home never changes once
        # recorded), and the requests waiting for a key's look-up.
        self.homes = KnownHomes()
        self.looking: dict[str, list[tuple[bytes, Message, bytes]]] = {}
        # The router's own `list` of a node that came up, by request id.
        self.seeding: dict[str, str] = {}
        self.wall = wall
        self.placement = placement or Placement()
        self.nodes: dict[str, Node] = {}
        self.pending: dict[str, Pending] = {}
        # Watches and log follows open, per front end (see _check_room).
        self.streams: Counter[bytes] = Counter()
        self.guard = ReplayGuard()
        # What the method being run has decided, in order (see _take).
        self._out: list[Out] = []

    def _take(self) -> list[Out]:
        out, self._out = self._out, []
        return out

    # -- nodes -------------------------------------------------------------

    def set_node(self, spec: NodeSpec) -> None:
        """A node of the node list, new or with its entry changed."""
        node = self.nodes.get(spec.name)
        if node is None:
            node = self.nodes[spec.name] = Node(spec)
        node.spec = spec
        self._place(node)

    def remove_node(self, name: str, why: str) -> list[Out]:
        """A node that left the node list: what waited on it is answered."""
        gone = self.nodes.pop(name, None)
        self.placement.remove(name)
        self._lose_node(name, why, gone.spec.shared_data if gone else None)
        return self._take()

    def on_node_up(self, name: str) -> list[Out]:
        """A node's link is up: it joins every watch of all sessions open now.
        The watch is sent anew (same id, fresh `ts`: the node's replay window
        would refuse the first one's); its `watching` is not passed on."""
        node = self.nodes.get(name)
        if node is None:
            return []
        node.live = True
        if self.use_homes and node.spec.shared_data is None:
            ask = Message(Kind.LIST, {})
            if self._to_node(name, ask, ask.id):
                self.seeding[ask.id] = name
        for p in self.pending.values():
            if p.mode is Mode.WATCH_ALL and name not in p.nodes:
                if self._to_node(name, Message(Kind.WATCH, {}, id=p.id), p.id):
                    p.nodes.add(name)
        self._place(node)
        return self._take()

    def on_node_lost(self, name: str, why: str) -> list[Out]:
        """A node's link dropped: what waited on it is answered now (or,
        a turn, sent where its session is placed now)."""
        node = self.nodes.get(name)
        if node is not None:
            node.live = False
            self._place(node)
        for ask in [a for a, asked in self.seeding.items() if asked == name]:
            del self.seeding[ask]  # asked again when it comes back
        self._lose_node(name, why, node.spec.shared_data if node else None)
        return self._take()

    def _place(self, node: Node) -> None:
        s = node.spec
        self.placement.update(Candidate(s.name, s.capacity, node.live, s.draining or node.draining))

    def _lose_node(self, name: str, why: str, shared_data: str | None) -> None:
        for p in list(self.pending.values()):
            if name not in p.nodes:
                continue
            p.nodes.discard(name)
            if p.mode is Mode.FORWARD:
                if self._send_again(p, name, why, shared_data):
                    continue
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

    # -- requests ------------------------------------------------------------

    def on_request(
        self, client: bytes, msg: Message, payload: bytes, node: str | None = None
    ) -> list[Out]:
        """A front end's request (already verified) for the nodes: fanned
        out, an unwatch, or forwarded to `node` (by default the session's
        owner). A refusal is answered as an error."""
        self._request(client, msg, payload, node)
        return self._take()

    def _request(self, client: bytes, msg: Message, payload: bytes, node: str | None) -> None:
        try:
            kind = msg.kind
            if kind in FANOUT_KINDS or (kind is Kind.WATCH and msg.session is None):
                self.guard.check(msg.id, msg.ts, self.wall())
                self._fan_out(client, msg, payload)
            elif kind is Kind.UNWATCH:
                self.guard.check(msg.id, msg.ts, self.wall())
                self._unwatch(client, msg, payload)
            elif msg.session is not None or node is not None:
                self._forward(client, msg, payload, node)
            else:
                raise RemoteProtocolError(
                    ErrorCode.UNKNOWN_KIND,
                    f"a router does not take {kind.value!r} without a session",
                )
        except RemoteProtocolError as exc:
            self._to_client(
                client,
                error_message(
                    exc.code, exc.message, re=msg.id, session=msg.session, detail=exc.detail
                ),
            )

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
            if held.waited and not held.nodes:
                return  # paused for a gone holder's lease: it is sent again then
            target = next(iter(held.nodes), None)
            if target is not None and self._to_node(target, payload, held.id):
                return
            self._error(held, NODE_LOST, "the node that ran this request is gone")
            self._finish(held)
            return
        if node is None:
            assert msg.session is not None
            if self.use_homes and msg.session not in self.homes.known:
                self._look_up(client, msg, payload)
                return
            node = self._owner(msg.session)
            if node is None and self.homes.get(msg.session) is not None:
                raise self._unavailable(msg.session)
        stream = msg.kind is Kind.WATCH or (msg.kind is Kind.LOGS and bool(msg.body.get("follow")))
        if stream:
            self._check_room(client)
        p = Pending(msg.id, msg.kind, Mode.FORWARD, client, msg.session, payload, stream=stream)
        if node is None or not self._to_node(node, payload, p.id):
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
        for name, node in self.nodes.items():
            if node.live and self._to_node(name, payload, p.id):
                p.nodes.add(name)
        self._add(p)
        if mode is Mode.WATCH_ALL:
            # The client hears `watching` once, whatever the number of nodes.
            self._to_client(client, msg.reply(Kind.EVENT, {"type": "watching", "data": None}))
            return
        self._maybe_complete(p)
        if self.pending.get(p.id) is p:
            self._out.append(TimeOut(p.id, FANOUT_TIMEOUT))

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
                if self._to_node(node, payload, p.id):
                    p.nodes.add(node)
        self.pending[msg.id] = p
        self._maybe_complete(p)

    # -- homes -----------------------------------------------------------------

    def _look_up(self, client: bytes, msg: Message, payload: bytes) -> None:
        """Wait for the key's home; ask the store once per key. With no live
        node to propose as its home there is nothing to ask."""
        key = msg.session
        assert key is not None
        proposed = self.placement.owner(key)
        if proposed is None:
            self._to_client(
                client,
                error_message(
                    NODE_LOST, "no live node can take this session now", re=msg.id, session=key
                ),
            )
            return
        waiting = self.looking.setdefault(key, [])
        waiting.append((client, msg, payload))
        if len(waiting) == 1:
            self._out.append(LookUp(key, self.nodes[proposed].spec.data))

    def on_home(self, key: str, home: str | None, why: str = "") -> list[Out]:
        """The store's answer for `key`: its home (None: the store could not
        be read, `why`). The requests that waited for it go on."""
        waiting = self.looking.pop(key, [])
        if home is None:
            for client, msg, _ in waiting:
                self._to_client(
                    client,
                    error_message(
                        HOME_UNAVAILABLE,
                        f"where session {key!r} keeps its history cannot be read now ({why}); "
                        "nothing was sent: try again",
                        re=msg.id,
                        session=key,
                    ),
                )
            return self._take()
        self.homes.learn(key, home)
        for client, msg, payload in waiting:
            self._request(client, msg, payload, None)
        return self._take()

    def _seed(self, name: str, msg: Message) -> None:
        """A node's own sessions: their homes are that node, where none is yet."""
        node = self.nodes.get(name)
        rows = msg.body.get("sessions") if msg.kind is Kind.SESSIONS else None
        if node is None or not isinstance(rows, list):
            return
        data = node.spec.data
        keys = {
            row["key"] for row in rows if isinstance(row, dict) and isinstance(row.get("key"), str)
        }
        fresh = [(key, data) for key in sorted(keys) if self.homes.known.get(key) != data]
        if fresh:
            self._out.append(Record(fresh))

    def on_homes(self, recorded: list[tuple[str, str]], held: dict[str, str]) -> list[Out]:
        """What the store holds for keys a node has (`recorded`: the homes
        asked for): learned; a key it holds elsewhere has two histories."""
        for key, data in recorded:
            home = held.get(key)
            if home is None:
                continue
            self.homes.learn(key, home)
            if home != data:
                log.warning(kv("router_key_two_histories", session=key, home=home, also=data))
        return self._take()

    def _owner(self, key: str) -> str | None:
        """The live node a request about `key` goes to: where placement
        puts it, unless its home is known and that node does not serve it;
        then the best live node that does (a draining one if only it does).
        None if no live node can serve the key."""
        owner = self.placement.owner(key)
        home = self.homes.get(key)
        if home is None or (owner is not None and self.nodes[owner].spec.data == home):
            return owner
        serving = [
            Candidate(name, node.spec.capacity, True, False)
            for name, node in self.nodes.items()
            if node.live and node.spec.data == home
        ]
        taking = [
            c
            for c in serving
            if not (self.nodes[c.name].draining or self.nodes[c.name].spec.draining)
        ]
        return rendezvous(key, taking) or rendezvous(key, serving)

    def _unavailable(self, key: str) -> RemoteProtocolError:
        """`home_unavailable` for a key whose home no live node serves."""
        home = self.homes.get(key) or ""
        node = home_node(home)
        known = sorted(n for n, k in self.nodes.items() if k.spec.data == home)
        if node is not None:
            state = "not in the node list" if node not in self.nodes else "not reachable"
            where = f"node {node}, which is {state} now"
        else:
            where = f"{describe_home(home)}, served by no live node now ({', '.join(known) or 'none known'})"
        return RemoteProtocolError(
            HOME_UNAVAILABLE,
            f"session {key!r} keeps its history on {where}; it is not started anew elsewhere "
            "(that would fork its history): send it again once the node is back",
            detail={"node": node, "data": home},
        )

    # -- answers ---------------------------------------------------------------

    def on_answer(self, node: str, msg: Message, payload: bytes) -> list[Out]:
        """A node's message (verified; `payload` as it came): to the client
        waiting on it, or merged."""
        if msg.re in self.seeding:
            self._seed(self.seeding.pop(msg.re), msg)
            return self._take()
        p = self.pending.get(msg.re or "")
        if p is None or node not in p.nodes:
            return []  # an answer to a request given up on
        self._learn(node, msg)
        if p.mode is Mode.FORWARD:
            if (
                msg.kind is Kind.ERROR
                and msg.body.get("code") == MOVED
                and (self._move(p, msg, node) or self._await_holder(p, msg, node))
            ):
                return self._take()
            p.answered = True
            self._out.append(ToClient(p.client, msg, payload))
            if self._is_final(p, msg):
                self._finish(p)
        elif p.mode is Mode.FANOUT:
            p.answers[node] = msg
            p.nodes.discard(node)
            self._maybe_complete(p)
        elif p.mode is Mode.WATCH_ALL:
            if msg.kind is Kind.ERROR:
                p.nodes.discard(node)  # this node refused the watch; others go on
                if not p.nodes:
                    self._out.append(ToClient(p.client, msg, payload))
                    self._finish(p)
            elif not (msg.kind is Kind.EVENT and msg.body.get("type") == "watching"):
                self._out.append(ToClient(p.client, msg, payload))
        elif p.mode is Mode.UNWATCH:
            p.nodes.discard(node)
            self._maybe_complete(p)
        return self._take()

    def _learn(self, name: str, msg: Message) -> None:
        """A node's own word on its draining: a drain's answer, its status."""
        own: object = None
        if msg.kind is Kind.INFO:
            own = msg.body["supervisor"].get("node")
        elif msg.kind is Kind.NODE:
            own = msg.body.get("node")
        node = self.nodes.get(name)
        if node is not None and isinstance(own, dict) and isinstance(own.get("draining"), bool):
            if own["draining"] != node.draining:
                log.info(kv("router_node_draining", node=name, draining=own["draining"]))
                node.draining = own["draining"]
                self._place(node)

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
        if p.session is None or p.moves >= MAX_MOVES or (p.answered and p.kind is not Kind.SEND):
            # Once a node answered anything, only a turn is safe to send
            # again (its journal); any other request: the client decides.
            return False
        if target is None and msg.body.get("reason") == "draining":
            node = self.nodes.get(name)
            if node is not None and not node.draining:
                log.info(kv("router_node_draining", node=name, draining=True))
                node.draining = True
                self._place(node)
            if self.placement.overrides.get(p.session) == name:
                self.placement.overrides.forget(p.session)
            target = self._owner(p.session)
        elif isinstance(target, str) and target in self.nodes and self.nodes[target].live:
            self.placement.overrides.set(p.session, target)
        else:
            return False
        if target is None or target == name:
            return False
        p.nodes.discard(name)
        p.moves += 1
        if not self._to_node(target, p.payload, p.id):
            return False
        p.nodes.add(target)
        log.info(kv("router_moved", session=p.session, **{"from": name}, to=target))
        return True

    def _await_holder(self, p: Pending, msg: Message, name: str) -> bool:
        """A node says the session's lease is held by a node that is not
        live: pause, then send the request again (on_timeout), while the
        wait allows. The node that said so spent nothing on the request
        (its id may come again: front.py)."""
        holder = msg.body.get("node")
        known = self.nodes.get(holder) if isinstance(holder, str) else None
        if (
            p.session is None
            or (p.answered and p.kind is not Kind.SEND)
            or msg.body.get("reason") != "leased"
            or not isinstance(holder, str)
            or holder == name
            or (known is not None and known.live)
            or p.waited >= HOLDER_GONE_WAIT
        ):
            return False
        pause = min(max(p.waited, FIRST_PAUSE), LONGEST_PAUSE, HOLDER_GONE_WAIT - p.waited)
        p.waited += pause
        p.nodes.discard(name)
        if self.placement.overrides.get(p.session) == holder:
            self.placement.overrides.forget(p.session)
        log.info(kv("router_holder_gone", session=p.session, holder=holder, retry_in=pause))
        self._out.append(TimeOut(p.id, pause))
        return True

    def _send_again(self, p: Pending, lost: str, why: str, shared_data: str | None) -> bool:
        """A turn whose node was lost goes where its session is placed now,
        if that node shares the lost one's data directory (`shared_data`):
        it answers from the session's journal (the turn's end, or
        `interrupted`), waits for the lost node's lease, or runs it if it
        never started. True if it was sent."""
        if p.kind is not Kind.SEND or p.session is None or p.moves >= MAX_MOVES:
            return False
        if shared_data is None:
            return False  # another node's data knows nothing of this turn
        target = self._owner(p.session)
        node = self.nodes.get(target) if target is not None else None
        if target is None or target == lost or node is None:
            return False
        if node.spec.shared_data != shared_data or not self._to_node(target, p.payload, p.id):
            return False
        p.moves += 1
        p.nodes.add(target)
        log.info(kv("router_turn_resent", session=p.session, lost=lost, to=target, why=why))
        return True

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
            body: dict[str, Any] = {
                "sessions": merge_sessions(rows, self.placement.owner, self._data_of)
            }
            return Message(Kind.SESSIONS, body, re=p.id)
        if p.kind is Kind.STATUS:
            answers = {
                n: (m.body["supervisor"] if m is not None and n in ok else None)
                for n, m in p.answers.items()
            }
            nodes = {n: {**k.spec.describe(), "live": k.live} for n, k in self.nodes.items()}
            return Message(
                Kind.INFO, {"supervisor": merge_status(self.about(), answers, nodes)}, re=p.id
            )
        return merge_reloads(p.answers, p.id)

    def _data_of(self, name: str) -> str:
        node = self.nodes.get(name)
        return node.spec.data if node is not None else OWN_DATA + name

    # -- time, failed sends, gone front ends ----------------------------------

    def on_timeout(self, request: str) -> list[Out]:
        """A fanned-out request's time is up: it answers with the nodes that
        did. A request paused for a gone holder's lease is sent again."""
        p = self.pending.get(request)
        if p is not None and p.mode is Mode.FANOUT:
            for name in p.nodes:
                p.answers[name] = None
            p.nodes.clear()
            self._maybe_complete(p)
        elif p is not None and p.mode is Mode.FORWARD and not p.nodes and p.session:
            node = self._owner(p.session)
            if node is not None and self._to_node(node, p.payload, p.id):
                p.nodes.add(node)
            else:
                self._error(p, NODE_LOST, "no live node can take this session now")
                self._finish(p)
        return self._take()

    def on_unsent(self, node: str, request: str | None) -> list[Out]:
        """A ToNode for `request` could not be sent: that node will not answer it."""
        p = self.pending.get(request or "")
        if p is None or node not in p.nodes:
            return []
        p.nodes.discard(node)
        if p.mode is Mode.FORWARD:
            self._error(p, NODE_LOST, f"node {node} is not reachable")
            self._finish(p)
        elif p.mode in (Mode.FANOUT, Mode.UNWATCH):
            self._maybe_complete(p)
        return self._take()

    def on_client_gone(self, client: bytes) -> list[Out]:
        """A front end that is no longer connected: end its watches and log
        follows on their nodes. Left open, they would stay there for good,
        each counted against the router's own connection, which a node
        allows its MAX_WATCHERS in all (supervisor/watchers.py): after that,
        no front end could watch through the router. Its requests in flight
        end as they would anyway, with their final answer."""
        if client not in self.streams:
            return []  # none open: the common case, for every send to it that fails
        ended = [p for p in self.pending.values() if p.client == client and p.stream]
        for p in ended:
            for node in p.nodes:
                self._out.append(ToNode(node, Message(Kind.UNWATCH, {"watch": p.id})))
            self._finish(p)
        if ended:
            log.info(kv("router_client_gone", watches_ended=len(ended)))
        return self._take()

    # -- helpers ---------------------------------------------------------------

    def _to_node(self, name: str, payload: bytes | Message, request: str) -> bool:
        """Send to a live node; False (nothing sent) if it is not live."""
        node = self.nodes.get(name)
        if node is None or not node.live:
            return False
        self._out.append(ToNode(name, payload, request))
        return True

    def _to_client(self, client: bytes, msg: Message) -> None:
        self._out.append(ToClient(client, msg))

    def _error(self, p: Pending, code: str, message: str) -> None:
        self._to_client(p.client, error_message(code, message, re=p.id, session=p.session))

    def _finish(self, p: Pending) -> None:
        if self.pending.get(p.id) is p:
            del self.pending[p.id]
            if p.stream:
                self.streams[p.client] -= 1
                if self.streams[p.client] <= 0:
                    del self.streams[p.client]
