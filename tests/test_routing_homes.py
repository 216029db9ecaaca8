"""One history per key (cluster/homes.py, cluster/routing.py), without
sockets: a key is sent only to nodes serving the data directory it was
first placed on, and refused `home_unavailable` while none is live."""

from __future__ import annotations

from click.testing import CliRunner

from hermes_sup.cli.route import forked_keys
from hermes_sup.cluster.homes import MemoryHomes, describe_home, home_node
from hermes_sup.cluster.merge import merge_sessions
from hermes_sup.cluster.nodes import NodeSpec
from hermes_sup.cluster.routing import (
    HOME_UNAVAILABLE,
    NODE_LOST,
    LookUp,
    Out,
    Record,
    RoutingTable,
    ToClient,
    ToNode,
)
from hermes_sup.protocol import Kind, Message, encode

ALICE = b"\x00alice"
KEY = b"k" * 32


def spec(name: str, shared: str | None = None) -> NodeSpec:
    return NodeSpec(
        name, f"tcp://{name}:7000", "S" * 40, b"h" * 32, "P" * 40, "X" * 40, shared_data=shared
    )


def table(*nodes: NodeSpec) -> RoutingTable:
    routing = RoutingTable(lambda: {"role": "router"}, homes=True)
    for node in nodes:
        routing.set_node(node)
        routing.on_node_up(node.name)
    return routing


def send(key: str) -> Message:
    return Message(Kind.SEND, {"text": "hi"}, session=key)


def payload(msg: Message) -> bytes:
    return encode(msg, KEY)[2]


def ask(routing: RoutingTable, msg: Message) -> list[Out]:
    return routing.on_request(ALICE, msg, payload(msg))


def resolve(routing: RoutingTable, outs: list[Out], store: MemoryHomes) -> list[Out]:
    """Answer every LookUp as the router does, from `store`."""
    done: list[Out] = []
    for out in outs:
        if isinstance(out, LookUp):
            done += resolve(
                routing, routing.on_home(out.key, store.claim(out.key, out.data)), store
            )
        else:
            done.append(out)
    return done


def test_a_key_waits_for_its_home_once_and_is_recorded_where_it_is_placed() -> None:
    routing = table(spec("a"), spec("b"))
    store = MemoryHomes()
    first, second = send("chat:1"), send("chat:1")
    (look,) = ask(routing, first)
    assert ask(routing, second) == []  # one look-up per key
    owner = routing.placement.owner("chat:1")
    assert look == LookUp("chat:1", f"node:{owner}")
    assert routing.on_home("chat:1", store.claim(look.key, look.data)) == [
        ToNode(owner, payload(first), first.id),
        ToNode(owner, payload(second), second.id),
    ]
    assert store.table == {"chat:1": f"node:{owner}"}
    # Known now: no look-up again.
    third = send("chat:1")
    assert ask(routing, third) == [ToNode(owner, payload(third), third.id)]


def test_a_key_whose_node_is_away_is_refused_naming_it_and_never_started_anew() -> None:
    store = MemoryHomes()
    routing = table(spec("a"), spec("b"))
    owner = routing.placement.owner("chat:1")
    other = "b" if owner == "a" else "a"
    resolve(routing, ask(routing, send("chat:1")), store)
    routing.on_node_lost(owner, "its connection closed")

    refused = ask(routing, send("chat:1"))
    (out,) = refused
    assert isinstance(out, ToClient) and out.msg.kind is Kind.ERROR
    assert out.msg.body["code"] == HOME_UNAVAILABLE
    assert out.msg.body["node"] == owner and out.msg.body["data"] == f"node:{owner}"
    assert f"node {owner}" in out.msg.body["message"]
    assert routing.pending == {}

    # Another router, which never saw the key, asks the store: the same.
    fresh = table(spec(other))
    assert fresh.placement.owner("chat:1") == other
    outs = resolve(fresh, ask(fresh, send("chat:1")), store)
    assert [o.msg.body["code"] for o in outs if isinstance(o, ToClient)] == [HOME_UNAVAILABLE]
    assert store.table["chat:1"] == f"node:{owner}"  # not overwritten

    # Its node back: it goes there again, to its one history.
    routing.on_node_up(owner)
    again = send("chat:1")
    assert ask(routing, again) == [ToNode(owner, payload(again), again.id)]


def test_a_node_that_left_the_node_list_is_named_too() -> None:
    store = MemoryHomes()
    store.claim("chat:1", "node:gone")
    routing = table(spec("a"))
    outs = resolve(routing, ask(routing, send("chat:1")), store)
    (out,) = outs
    assert isinstance(out, ToClient)
    assert out.msg.body["code"] == HOME_UNAVAILABLE
    assert "node gone, which is not in the node list now" in out.msg.body["message"]


def test_shared_data_serves_a_key_on_any_node_of_its_data_directory() -> None:
    store = MemoryHomes()
    routing = table(spec("a", "nfs"), spec("b", "nfs"), spec("c"))
    keys = [f"chat:{i}" for i in range(40)]
    placed = {k: routing.placement.owner(k) for k in keys}
    on_shared = next(k for k in keys if placed[k] in ("a", "b"))
    resolve(routing, ask(routing, send(on_shared)), store)
    assert store.table[on_shared] == "nfs"
    # Its node lost: another node of the same data directory serves it,
    # never the node with data of its own.
    routing.on_node_lost(placed[on_shared], "test")
    again = send(on_shared)
    (to,) = ask(routing, again)
    assert isinstance(to, ToNode) and to.node in ("a", "b") and to.node != placed[on_shared]
    # Both lost: refused, naming the data directory and its nodes.
    routing.on_node_lost(to.node, "test")
    (out,) = ask(routing, send(on_shared))
    assert isinstance(out, ToClient) and out.msg.body["code"] == HOME_UNAVAILABLE
    assert out.msg.body["node"] is None
    assert "shared data directory nfs" in out.msg.body["message"]


def test_a_store_that_cannot_be_read_refuses_the_waiting_requests_clearly() -> None:
    routing = table(spec("a"))
    msg = send("chat:1")
    (look,) = ask(routing, msg)
    assert isinstance(look, LookUp)
    (out,) = routing.on_home("chat:1", None, "the GCS is away")
    assert isinstance(out, ToClient) and out.msg.re == msg.id
    assert out.msg.body["code"] == HOME_UNAVAILABLE
    assert "the GCS is away" in out.msg.body["message"]
    # No live node at all: nothing to look up, node_lost as before.
    routing.on_node_lost("a", "test")
    (out,) = ask(routing, send("chat:2"))
    assert isinstance(out, ToClient) and out.msg.body["code"] == NODE_LOST


def test_list_shows_a_key_once_per_history_and_every_live_session() -> None:
    data = {"a": "node:a", "b": "node:b", "n1": "nfs", "n2": "nfs"}.__getitem__
    rows = merge_sessions(
        {
            "a": [{"key": "k1", "state": "idle"}, {"key": "k2", "state": "exited"}],
            "b": [{"key": "k1", "state": "exited"}],
            "n1": [{"key": "k3", "state": "exited"}, {"key": "k4", "state": "idle"}],
            "n2": [{"key": "k3", "state": "exited"}, {"key": "k4", "state": "busy"}],
        },
        data_of=data,
    )
    assert [(r["key"], r["node"], r["state"]) for r in rows] == [
        ("k1", "a", "idle"),
        ("k1", "b", "exited"),  # another node's own history of k1: shown
        ("k2", "a", "exited"),
        ("k3", "n1", "exited"),  # one shared history, listed once
        ("k4", "n1", "idle"),  # live on two nodes: both shown, never hidden
        ("k4", "n2", "busy"),
    ]
    assert sorted(forked_keys(rows)) == ["k1", "k4"]


def test_homes_describe_themselves() -> None:
    assert home_node("node:a") == "a" and home_node("3f2a") is None
    assert describe_home("node:a") == "node a"
    assert describe_home("3f2a") == "shared data directory 3f2a"
    assert spec("a").data == "node:a" and spec("a", "nfs").data == "nfs"


def test_reconcile_is_a_route_subcommand() -> None:
    from hermes_sup.cli.route import route

    result = CliRunner().invoke(route, ["reconcile", "--help"])
    assert result.exit_code == 0, result.output
    assert "two nodes" in result.output


def test_a_node_with_its_own_data_that_comes_up_has_its_keys_homes_recorded(caplog) -> None:
    store = MemoryHomes()
    store.claim("old:1", "node:b")  # already somewhere else: two histories
    routing = RoutingTable(lambda: {"role": "router"}, homes=True)
    routing.set_node(spec("a"))
    routing.set_node(spec("b"))
    (ask_list,) = routing.on_node_up("a")
    assert isinstance(ask_list, ToNode) and isinstance(ask_list.payload, Message)
    assert ask_list.payload.kind is Kind.LIST
    listed = Message(
        Kind.SESSIONS,
        {"sessions": [{"key": "old:1", "state": "exited"}, {"key": "old:2", "state": "idle"}]},
        re=ask_list.payload.id,
    )
    (record,) = routing.on_answer("a", listed, payload(listed))
    assert isinstance(record, Record)
    assert record.homes == [("old:1", "node:a"), ("old:2", "node:a")]
    with caplog.at_level("WARNING", logger="hermes_sup.router"):
        assert routing.on_homes(record.homes, store.claim_many(record.homes)) == []
    assert "router_key_two_histories session=old:1" in caplog.text
    assert store.table == {"old:1": "node:b", "old:2": "node:a"}
    # Known without a look-up; and refused, naming a, once a is away.
    msg = send("old:2")
    assert ask(routing, msg) == [ToNode("a", payload(msg), msg.id)]
    routing.on_node_lost("a", "test")
    routing.on_node_up("b")
    assert set(routing.seeding.values()) == {"b"}  # a's, unanswered, forgotten with it
    (out,) = ask(routing, send("old:2"))
    assert isinstance(out, ToClient) and out.msg.body["code"] == HOME_UNAVAILABLE
    # A node on a shared data directory is not asked: any of its nodes serves its keys.
    shared = RoutingTable(lambda: {"role": "router"}, homes=True)
    shared.set_node(spec("n", "nfs"))
    assert shared.on_node_up("n") == []
