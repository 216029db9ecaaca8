"""The router's decisions (cluster/routing.py), without sockets or
processes: what arrives goes in, what to send comes out."""

from __future__ import annotations

from hermes_sup.cluster.nodes import NodeSpec
from hermes_sup.cluster.routing import (
    FANOUT_TIMEOUT,
    HOLDER_GONE_WAIT,
    MAX_MOVES,
    MOVED,
    NODE_LOST,
    Out,
    RoutingTable,
    TimeOut,
    ToClient,
    ToNode,
)
from hermes_sup.protocol import MAX_WATCHES_PER_CLIENT, Kind, Message, encode, error_message

ALICE = b"\x00alice"  # client ids: the front socket's byte, then the routing id
BOB = b"\x01bob"
KEY = b"k" * 32


def spec(name: str, shared: str | None = None) -> NodeSpec:
    return NodeSpec(
        name, f"tcp://{name}:7000", "S" * 40, b"h" * 32, "P" * 40, "X" * 40, shared_data=shared
    )


def table(*names: str, down: tuple[str, ...] = (), shared: str | None = None) -> RoutingTable:
    """A routing table over `names`, each live unless in `down` (sharing
    one data directory if `shared` names it)."""
    routing = RoutingTable(lambda: {"role": "router"})
    for name in names:
        routing.set_node(spec(name, shared))
        if name not in down:
            assert routing.on_node_up(name) == []
    return routing


def request(kind: Kind, body: dict | None = None, session: str | None = None) -> Message:
    return Message(kind, body or {}, session=session)


def payload(msg: Message) -> bytes:
    return encode(msg, KEY)[2]


def ask(routing: RoutingTable, client: bytes, msg: Message) -> list[Out]:
    return routing.on_request(client, msg, payload(msg))


def answer(routing: RoutingTable, node: str, msg: Message) -> list[Out]:
    return routing.on_answer(node, msg, payload(msg))


def event(req: Message, type_: str, data: object = None) -> Message:
    return Message(Kind.EVENT, {"type": type_, "data": data}, session=req.session, re=req.id)


def errors(outs: list[Out]) -> list[tuple[str, str]]:
    return [
        (o.msg.body["code"], o.msg.body["message"])
        for o in outs
        if isinstance(o, ToClient) and o.msg.kind is Kind.ERROR
    ]


def test_a_request_goes_to_its_keys_node_and_its_answers_back_to_the_final_one() -> None:
    routing = table("a", "b")
    send = request(Kind.SEND, {"text": "hi"}, session="chat:1")
    owner = routing.placement.owner("chat:1")
    other = "b" if owner == "a" else "a"
    assert ask(routing, ALICE, send) == [ToNode(owner, payload(send), send.id)]

    running = event(send, "status", {"state": "running"})
    assert answer(routing, owner, running) == [ToClient(ALICE, running, payload(running))]
    assert answer(routing, other, running) == []  # not the node it waits on
    reply = send.reply(Kind.REPLY, {"text": "ok", "ok": True})
    assert answer(routing, owner, reply) == [ToClient(ALICE, reply, payload(reply))]
    assert routing.pending == {}
    assert answer(routing, owner, running) == []  # late: given up on

    # No live node: answered at once, nothing kept.
    routing.on_node_lost("a", "test")
    routing.on_node_lost("b", "test")
    lone = request(Kind.SEND, {"text": "hi"}, session="chat:2")
    assert errors(ask(routing, ALICE, lone)) == [
        (NODE_LOST, "no live node can take this session now")
    ]
    assert routing.pending == {}


def test_a_node_lost_ends_its_requests_with_node_lost_without_shared_data() -> None:
    routing = table("a", "b")
    send = request(Kind.SEND, {"text": "sleep 60"}, session="chat:1")
    (to,) = ask(routing, ALICE, send)
    assert isinstance(to, ToNode)
    # The other node has data of its own: it knows nothing of the turn.
    assert errors(routing.on_node_lost(to.node, "its connection closed")) == [
        (NODE_LOST, f"node {to.node} was lost (its connection closed) while this request ran there")
    ]
    assert routing.pending == {}


def test_a_node_lost_sends_a_turn_where_its_session_is_now_and_ends_other_requests() -> None:
    routing = table("a", "b", shared="nfs")
    send = request(Kind.SEND, {"text": "sleep 60"}, session="chat:1")
    (to,) = ask(routing, ALICE, send)
    assert isinstance(to, ToNode)
    there = "b" if to.node == "a" else "a"
    answer(routing, to.node, event(send, "status", {"state": "running"}))
    # The turn (its id is in the session's journal) goes to the live node,
    # which joins it, answers it from the journal, or runs it if it never
    # started: never twice.
    assert routing.on_node_lost(to.node, "its connection closed") == [
        ToNode(there, payload(send), send.id)
    ]
    final = Message(Kind.REPLY, {"text": "done", "ok": True}, session="chat:1", re=send.id)
    assert answer(routing, there, final) == [ToClient(ALICE, final, payload(final))]
    # Any other request ends with node_lost.
    info = request(Kind.INSPECT, session="chat:1")
    (to,) = ask(routing, ALICE, info)
    assert isinstance(to, ToNode)
    (lost,) = routing.on_node_lost(to.node, "its connection closed")
    assert isinstance(lost, ToClient) and lost.msg.re == info.id
    assert errors([lost]) == [
        (NODE_LOST, f"node {to.node} was lost (its connection closed) while this request ran there")
    ]
    # A send the link cannot make comes back, and is answered the same way;
    # with no live node left, a lost node's turn ends with node_lost too.
    routing.on_node_up(to.node)
    again = request(Kind.SEND, {"text": "hi"}, session="chat:1")
    (to2,) = ask(routing, ALICE, again)
    assert isinstance(to2, ToNode)
    assert errors(routing.on_unsent(to2.node, again.id)) == [
        (NODE_LOST, f"node {to2.node} is not reachable")
    ]
    lone = request(Kind.SEND, {"text": "hi"}, session="chat:1")
    (to3,) = ask(routing, ALICE, lone)
    other = "b" if to3.node == "a" else "a"
    routing.on_node_lost(other, "gone")
    assert errors(routing.on_node_lost(to3.node, "gone")) == [
        (NODE_LOST, f"node {to3.node} was lost (gone) while this request ran there")
    ]
    assert routing.pending == {}


def test_a_fan_out_answers_once_with_a_lost_node_and_a_timed_out_one_not_answered() -> None:
    routing = table("a", "b", "c")
    status = request(Kind.STATUS)
    outs = ask(routing, ALICE, status)
    assert outs == [
        ToNode("a", payload(status), status.id),
        ToNode("b", payload(status), status.id),
        ToNode("c", payload(status), status.id),
        TimeOut(status.id, FANOUT_TIMEOUT),
    ]
    info = status.reply(Kind.INFO, {"supervisor": {"sessions": {"idle": 2}, "max_sessions": 5}})
    assert answer(routing, "a", info) == []
    assert routing.on_node_lost("b", "its connection closed") == []
    (merged,) = routing.on_timeout(status.id)  # c never answers
    assert isinstance(merged, ToClient) and merged.client == ALICE
    assert merged.msg.kind is Kind.INFO and merged.msg.re == status.id
    body = merged.msg.body["supervisor"]
    assert body["role"] == "router" and body["sessions"] == {"idle": 2}
    rows = {row["name"]: row for row in body["nodes"]}
    assert [rows[n]["answered"] for n in "abc"] == [True, False, False]
    assert [rows[n]["live"] for n in "abc"] == [True, False, True]
    assert routing.pending == {}
    assert answer(routing, "c", info) == []  # too late
    assert routing.on_timeout(status.id) == []  # its timer, after it ended


def test_moved_is_followed_at_most_max_moves_times_and_never_after_an_answer() -> None:
    routing = table("a", "b")
    send = request(Kind.SEND, {"text": "hi"}, session="chat:1")
    (to,) = ask(routing, ALICE, send)
    assert isinstance(to, ToNode)
    here = to.node
    for _ in range(MAX_MOVES):
        there = "b" if here == "a" else "a"
        moved = error_message(MOVED, "held elsewhere", re=send.id, session="chat:1")
        moved.body.update(node=there, reason="leased")
        # Followed unseen by the client, and the key pinned there.
        assert answer(routing, here, moved) == [ToNode(there, payload(send), send.id)]
        assert routing.placement.overrides.get("chat:1") == there
        here = there
    moved = error_message(MOVED, "held elsewhere", re=send.id, session="chat:1")
    moved.body.update(node="b" if here == "a" else "a", reason="leased")
    assert answer(routing, here, moved) == [ToClient(ALICE, moved, payload(moved))]
    assert routing.pending == {}

    # Once a node answered anything, a `moved` is followed only for a turn
    # (the session's journal keeps it from running twice); for anything
    # else it goes to the client.
    turn = request(Kind.SEND, {"text": "hi"}, session="chat:2")
    (to,) = ask(routing, ALICE, turn)
    assert isinstance(to, ToNode)
    other = "b" if to.node == "a" else "a"
    answer(routing, to.node, event(turn, "status", {"state": "running"}))
    late = error_message(MOVED, "taken over", re=turn.id, session="chat:2")
    late.body.update(node=other, reason="leased")
    assert answer(routing, to.node, late) == [ToNode(other, payload(turn), turn.id)]
    follow = request(Kind.LOGS, {"follow": True}, session="chat:2")
    (to,) = ask(routing, ALICE, follow)
    assert isinstance(to, ToNode)
    lines = Message(Kind.LOG_LINES, {"lines": []}, session="chat:2", re=follow.id)
    answer(routing, to.node, lines)
    late = error_message(MOVED, "taken over", re=follow.id, session="chat:2")
    late.body.update(node="b" if to.node == "a" else "a", reason="leased")
    assert answer(routing, to.node, late) == [ToClient(ALICE, late, payload(late))]
    assert follow.id not in routing.pending


def test_moved_naming_a_lost_node_waits_for_its_lease_then_sends_again() -> None:
    """The node a session's lease names is lost, its lock not yet dropped
    (its processes still dying; on NFS, until the server's lease time):
    the request is paused and sent again, as signed, until the lease comes
    free or HOLDER_GONE_WAIT is spent; only then does the client hear it."""
    routing = table("a", "b")
    key = next(k for k in (f"k:{i}" for i in range(100)) if routing.placement.owner(k) == "b")
    routing.on_node_lost("b", "gone")
    send = request(Kind.SEND, {"text": "hi"}, session=key)
    (to,) = ask(routing, ALICE, send)
    assert to == ToNode("a", payload(send), send.id)
    held = error_message(MOVED, "held by b", re=send.id, session=key)
    held.body.update(node="b", reason="leased")
    (pause,) = answer(routing, "a", held)
    assert isinstance(pause, TimeOut) and pause.id == send.id and pause.seconds > 0
    # The client's own resend meanwhile is held, not refused.
    assert ask(routing, ALICE, send) == []
    assert routing.on_timeout(send.id) == [ToNode("a", payload(send), send.id)]
    running = event(send, "status", {"state": "running"})
    assert answer(routing, "a", running) == [ToClient(ALICE, running, payload(running))]

    # A holder that never lets go: the client hears `moved` once the wait is spent.
    turn = request(Kind.SEND, {"text": "hi"}, session=key)
    ask(routing, ALICE, turn)
    pauses = []
    while True:
        stuck = error_message(MOVED, "held by b", re=turn.id, session=key)
        stuck.body.update(node="b", reason="leased")
        outs = answer(routing, "a", stuck)
        if outs != [] and isinstance(outs[0], ToClient):
            assert outs == [ToClient(ALICE, stuck, payload(stuck))]
            break
        (pause,) = outs
        assert isinstance(pause, TimeOut)
        pauses.append(pause.seconds)
        assert routing.on_timeout(turn.id) == [ToNode("a", payload(turn), turn.id)]
    assert abs(sum(pauses) - HOLDER_GONE_WAIT) < 1e-9 and pauses[:-1] == sorted(pauses[:-1])
    assert turn.id not in routing.pending

    # A holder that is live is followed at once, never waited for.
    routing.on_node_up("b")
    again = request(Kind.SEND, {"text": "hi"}, session="k:live")
    (to,) = ask(routing, ALICE, again)
    moved = error_message(MOVED, "held elsewhere", re=again.id, session="k:live")
    other = "b" if to.node == "a" else "a"
    moved.body.update(node=other, reason="leased")
    assert answer(routing, to.node, moved) == [ToNode(other, payload(again), again.id)]


def test_moved_for_a_draining_node_places_the_key_again_and_the_node_takes_no_new_keys() -> None:
    routing = table("a", "b")
    keys = [f"k:{i}" for i in range(40)]
    on_a = [k for k in keys if routing.placement.owner(k) == "a"]
    send = request(Kind.SEND, {"text": "hi"}, session=on_a[0])
    ask(routing, ALICE, send)
    draining = error_message(MOVED, "draining", re=send.id, session=on_a[0])
    draining.body.update(node=None, reason="draining")
    assert answer(routing, "a", draining) == [ToNode("b", payload(send), send.id)]
    assert {routing.placement.owner(k) for k in keys} == {"b"}


def test_a_watch_of_all_sessions_spans_the_nodes_and_one_unwatch_ends_it() -> None:
    routing = table("a", "b", down=("b",))
    watch = request(Kind.WATCH)
    outs = ask(routing, ALICE, watch)
    assert outs[0] == ToNode("a", payload(watch), watch.id)
    assert isinstance(outs[1], ToClient) and outs[1].msg.body["type"] == "watching"
    # A node that comes up joins it; its own `watching` is not passed on.
    (join,) = routing.on_node_up("b")
    assert isinstance(join, ToNode) and join.node == "b"
    assert isinstance(join.payload, Message) and join.payload.id == watch.id
    assert answer(routing, "b", event(watch, "watching")) == []
    state = event(watch, "state", {"state": "busy"})
    assert answer(routing, "b", state) == [ToClient(ALICE, state, payload(state))]

    unwatch = request(Kind.UNWATCH, {"watch": watch.id})
    assert set(ask(routing, ALICE, unwatch)) == {
        ToNode("a", payload(unwatch), unwatch.id),
        ToNode("b", payload(unwatch), unwatch.id),
    }
    assert answer(routing, "a", event(unwatch, "unwatched")) == []
    (done,) = answer(routing, "b", event(unwatch, "unwatched"))
    assert isinstance(done, ToClient) and done.msg.body["type"] == "unwatched"
    assert routing.pending == {} and routing.streams == {}


def test_a_gone_front_ends_watches_are_ended_on_their_nodes() -> None:
    routing = table("a", "b")
    everything = request(Kind.WATCH)
    ask(routing, ALICE, everything)
    one = request(Kind.WATCH, session="chat:1")
    (to,) = ask(routing, ALICE, one)
    assert isinstance(to, ToNode)
    turn = request(Kind.SEND, {"text": "hi"}, session="chat:2")
    ask(routing, ALICE, turn)
    assert routing.on_client_gone(BOB) == []  # nothing open: nothing to do

    outs = routing.on_client_gone(ALICE)
    ended = sorted(
        (o.node, o.payload.body["watch"])
        for o in outs
        if isinstance(o, ToNode) and isinstance(o.payload, Message)
    )
    assert all(isinstance(o, ToNode) and o.payload.kind is Kind.UNWATCH for o in outs)
    assert ended == sorted([("a", everything.id), ("b", everything.id), (to.node, one.id)])
    assert routing.streams == {}
    assert set(routing.pending) == {turn.id}  # its turn ends as it would, with its answer
    assert routing.on_client_gone(ALICE) == []  # once


def test_each_front_end_is_held_to_the_per_client_stream_limit() -> None:
    routing = table("a", "b")
    for i in range(MAX_WATCHES_PER_CLIENT - 1):
        ask(routing, ALICE, request(Kind.WATCH, session=f"chat:{i}"))
    ask(routing, ALICE, request(Kind.LOGS, {"follow": True}, session="chat:x"))  # counts too
    refused = request(Kind.WATCH)
    assert errors(ask(routing, ALICE, refused)) == [
        (
            "busy",
            f"this client already has {MAX_WATCHES_PER_CLIENT} watches and log follows open "
            f"(limit {MAX_WATCHES_PER_CLIENT} per client); end one (unwatch) first",
        )
    ]
    assert refused.id not in routing.pending
    # Another front end is not held to this one's count; a plain `logs` is no stream.
    assert isinstance(ask(routing, BOB, request(Kind.WATCH))[0], ToNode)
    logs = request(Kind.LOGS, {}, session="chat:x")
    assert isinstance(ask(routing, ALICE, logs)[0], ToNode)


def test_a_resend_goes_to_the_node_that_runs_the_request_and_only_from_its_client() -> None:
    routing = table("a", "b")
    send = request(Kind.SEND, {"text": "hi"}, session="chat:1")
    (to,) = ask(routing, ALICE, send)
    assert isinstance(to, ToNode)
    assert ask(routing, ALICE, send) == [to]  # the node answers it as a duplicate
    assert errors(ask(routing, BOB, send)) == [
        ("replayed", f"message id {send.id!r} is another connection's request")
    ]
    # A request without a session that the router does not fan out (one
    # the protocol lets through without a session, or a kind to come).
    assert errors(routing.on_request(ALICE, request(Kind.KILL), b"")) == [
        ("unknown_kind", "a router does not take 'kill' without a session")
    ]
