"""The router's pure parts: rendezvous placement, overrides, merging many
nodes' answers, and the node list file. No processes, no sockets."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

from hermes_sup.cluster.merge import merge_sessions, merge_status
from hermes_sup.cluster.nodes import NodeConfigError, load_nodes
from hermes_sup.cluster.placement import Candidate, Placement, rendezvous

KEYS = st.lists(
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9:._@-]{0,20}", fullmatch=True), min_size=1, max_size=60
)
NAMES = st.lists(
    st.from_regex(r"[a-z][a-z0-9]{0,6}", fullmatch=True), min_size=2, max_size=6, unique=True
)


@given(keys=KEYS, names=NAMES, data=st.data())
def test_only_the_keys_of_a_node_that_leaves_move(keys, names, data) -> None:
    capacities = {n: data.draw(st.integers(1, 8)) for n in names}
    nodes = [Candidate(n, capacities[n]) for n in names]
    gone = data.draw(st.sampled_from(names))
    before = {k: rendezvous(k, nodes) for k in keys}
    after = {k: rendezvous(k, [n for n in nodes if n.name != gone]) for k in keys}
    for key in keys:
        if before[key] != gone:
            assert after[key] == before[key], key
        else:
            assert after[key] != gone and after[key] is not None


@given(keys=KEYS, names=NAMES, data=st.data())
def test_a_node_that_joins_takes_keys_only_for_itself(keys, names, data) -> None:
    nodes = [Candidate(n) for n in names[1:]]
    before = {k: rendezvous(k, nodes) for k in keys}
    after = {k: rendezvous(k, [*nodes, Candidate(names[0])]) for k in keys}
    assert all(after[k] in (before[k], names[0]) for k in keys)


def test_draining_dead_and_empty_nodes_take_no_new_keys() -> None:
    nodes = [Candidate("a", live=False), Candidate("b", draining=True), Candidate("c")]
    assert {rendezvous(f"k{i}", nodes) for i in range(200)} == {"c"}
    assert rendezvous("k", [Candidate("a", live=False)]) is None


def test_capacity_weights_the_share_of_keys() -> None:
    nodes = [Candidate("big", 3), Candidate("small", 1)]
    picked = [rendezvous(f"user:{i}", nodes) for i in range(4000)]
    share = picked.count("big") / len(picked)
    # 3:1 capacity is a 75% share in expectation; the hash is fixed, so this is exact per run.
    assert 0.70 < share < 0.80


def test_an_override_wins_while_its_node_is_live_and_goes_with_it() -> None:
    p = Placement()
    for name in ("a", "b", "c"):
        p.update(Candidate(name))
    key = "telegram:42"
    hashed = p.owner(key)
    other = next(n for n in ("a", "b", "c") if n != hashed)
    p.overrides.set(key, other)
    assert p.owner(key) == other
    p.update(Candidate(other, draining=True))  # a draining node still serves what it holds
    assert p.owner(key) == other
    p.update(Candidate(other, live=False))
    assert p.owner(key) == hashed
    p.update(Candidate(other))
    p.remove(other)
    assert p.overrides.get(key) is None and p.owner(key) == hashed


def test_the_override_table_is_bounded() -> None:
    p = Placement(override_capacity=3)
    for i in range(10):
        p.overrides.set(f"k{i}", "a")
    assert len(p.overrides) == 3 and p.overrides.get("k9") == "a" and p.overrides.get("k0") is None


def test_a_key_placed_off_its_hash_goes_back_once_its_override_is_old() -> None:
    """A failover or a restart left keys on another node (an override per
    key); after OVERRIDE_TTL the key is asked of its hashed node again: if
    the other still holds it, `moved` sets the override anew; if its
    session let its lease go (hibernated), the hashed node takes it."""
    from hermes_sup.cluster.nodes import NodeSpec
    from hermes_sup.cluster.placement import OVERRIDE_TTL, Overrides
    from hermes_sup.cluster.routing import RoutingTable, ToNode
    from hermes_sup.protocol import Kind, Message, encode, error_message

    now = [0.0]
    routing = RoutingTable()
    routing.placement.overrides = Overrides(clock=lambda: now[0])
    for name in ("a", "b"):
        routing.set_node(
            NodeSpec(
                name, f"tcp://{name}:1", "S" * 40, b"h" * 32, "P" * 40, "X" * 40, shared_data="nfs"
            )  # fmt: skip
        )
        routing.on_node_up(name)
    key = next(f"k{i}" for i in range(50) if routing.placement.owner(f"k{i}") == "a")

    def ask() -> str:
        msg = Message(Kind.SEND, {"text": "hi"}, session=key)
        (out,) = routing.on_request(b"\x00c", msg, encode(msg, b"k" * 32)[2])
        assert isinstance(out, ToNode)
        return out.node

    def moved_to_b() -> None:
        (p,) = routing.pending.values()
        held = error_message("moved", "held by b", re=p.id, session=key,
                             detail={"reason": "leased", "node": "b", "endpoint": None})  # fmt: skip
        (out,) = routing.on_answer("a", held, encode(held, b"k" * 32)[2])
        assert isinstance(out, ToNode) and out.node == "b"
        routing.pending.clear()

    assert ask() == "a"
    moved_to_b()  # the session is live on b (a failover left it there)
    assert ask() == "b"
    routing.pending.clear()
    now[0] += OVERRIDE_TTL + 1
    assert ask() == "a"  # asked of its node again: b still holds it
    moved_to_b()
    assert ask() == "b"
    routing.pending.clear()
    now[0] += OVERRIDE_TTL + 1
    assert ask() == "a"  # b's session went idle and let go: a takes it, and keeps it
    routing.pending.clear()
    assert routing.placement.overrides.get(key) is None


def test_list_merge_adds_the_node_and_prefers_the_live_row() -> None:
    answers = {
        "a": [{"key": "x", "state": "exited"}, {"key": "y", "state": "idle"}],
        "b": [{"key": "x", "state": "busy"}, {"key": "z", "state": "exited", "node": "b2"}],
    }
    rows = merge_sessions(answers)
    assert [(r["key"], r["node"], r["state"]) for r in rows] == [
        ("x", "b", "busy"),
        ("y", "a", "idle"),
        ("z", "b2", "exited"),
    ]
    # Two exited rows: the one of the node the key is placed on.
    both = {"a": [{"key": "q", "state": "exited"}], "b": [{"key": "q", "state": "exited"}]}
    assert merge_sessions(both, lambda key: "b")[0]["node"] == "b"
    assert merge_sessions(both, lambda key: "a")[0]["node"] == "a"
    assert merge_sessions({"a": [{"no": "key"}, "junk"]}) == []  # type: ignore[list-item]


def test_status_merge_sums_and_shows_every_node() -> None:
    info = merge_status(
        {"pid": 1, "role": "router"},
        {
            "a": {"sessions": {"idle": 2, "busy": 1}, "max_sessions": 10, "accepting": True},
            "b": {
                "sessions": {"idle": 3},
                "max_sessions": 5,
                "node": {"draining": True, "capacity": 5},
            },
            "c": None,
        },
        {"a": {"live": True}, "b": {"live": True, "capacity": 2.0}, "c": {"live": False}},
    )
    assert info["sessions"] == {"idle": 5, "busy": 1}
    assert info["max_sessions"] == 15 and info["accepting"] is True and info["pid"] == 1
    rows = {r["name"]: r for r in info["nodes"]}
    assert rows["b"]["draining"] is True and rows["c"]["answered"] is False
    assert rows["a"]["status"]["max_sessions"] == 10
    # The router's weight for a node stays its `capacity`; the node's own room is apart.
    assert rows["b"]["capacity"] == 2.0 and rows["b"]["max_sessions"] == 5


def _connection(path: Path, port: int) -> Path:
    server_public, _ = zmq.curve_keypair()
    public, secret = zmq.curve_keypair()
    path.write_text(
        json.dumps(
            {
                "endpoint": f"tcp://127.0.0.1:{port}",
                "hmac_key": os.urandom(32).hex(),
                "curve": {
                    "server_public": server_public.decode(),
                    "public": public.decode(),
                    "secret": secret.decode(),
                },
            }
        )
    )
    path.chmod(0o600)
    return path


def test_node_file_reads_connection_files_and_refuses_bad_ones(tmp_path: Path) -> None:
    _connection(tmp_path / "a.json", 7001)
    nodes = tmp_path / "nodes.toml"
    nodes.write_text('[[node]]\nname = "a"\nconnection = "a.json"\ncapacity = 4\n')
    (spec,) = load_nodes(nodes)
    assert (spec.name, spec.endpoint, spec.capacity) == ("a", "tcp://127.0.0.1:7001", 4.0)
    assert "secret" not in json.dumps(spec.describe())

    (tmp_path / "a.json").chmod(0o644)
    with pytest.raises(NodeConfigError, match="readable by others"):
        load_nodes(nodes)
    (tmp_path / "a.json").chmod(0o600)
    for bad, why in [
        ('[[node]]\nname = "../x"\nconnection = "a.json"\n', "node name"),
        ('[[node]]\nname = "a"\nconnection = "a.json"\ncapacity = 0\n', "capacity"),
        ('[[node]]\nname = "a"\nendpoint = "tcp://h:1"\n', "missing"),
        (
            '[[node]]\nname = "a"\nconnection = "a.json"\n[[node]]\nname = "a"\nconnection = "a.json"\n',
            "twice",
        ),
        ("nodes = 1\n", "unknown key"),
    ]:
        nodes.write_text(bad)
        with pytest.raises(NodeConfigError, match=why):
            load_nodes(nodes)


def test_route_command_refuses_a_bad_node_list_before_it_binds(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from hermes_sup.cli.route import route

    runner = CliRunner()
    both = runner.invoke(route, ["--state-dir", str(tmp_path / "r")])
    assert both.exit_code == 2 and "exactly one of --nodes" in both.output
    bad = tmp_path / "nodes.toml"
    bad.write_text('[[node]]\nname = "a"\n')
    refused = runner.invoke(route, ["--nodes", str(bad), "--state-dir", str(tmp_path / "r")])
    assert refused.exit_code == 1 and "missing 'endpoint'" in refused.output
    assert not (tmp_path / "r").exists()


def test_status_of_a_router_prints_each_node_with_its_weight_and_room() -> None:
    from hermes_sup.cli.router_status import router_lines

    info = {
        "version": "1", "protocol": 1, "pid": 5, "uptime": 3.0, "role": "router",
        "endpoints": {"control": "ipc:///r/c", "tcp": "tcp://127.0.0.1:9"},
        "sessions": {"idle": 2}, "total_sessions": 2, "max_sessions": 10, "queued": 0,
        "accepting": True,
        "nodes": [
            {"name": "a", "endpoint": "tcp://127.0.0.1:1", "capacity": 1.0, "live": True,
             "answered": True, "max_sessions": 10, "status": {"total_sessions": 2}},
            {"name": "b", "endpoint": "tcp://127.0.0.1:2", "capacity": 2.5, "live": False,
             "answered": False, "draining": True},
        ],
    }  # fmt: skip
    lines = router_lines(info)
    assert "1 of 2 answering" in lines[3]
    assert lines[-2] == "  a: answering, tcp://127.0.0.1:1, weight 1, 2 session(s), at most 10 live"
    assert lines[-1] == "  b: DOWN, tcp://127.0.0.1:2, weight 2.5, DRAINING"
