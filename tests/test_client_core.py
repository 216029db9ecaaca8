"""The client's sans-IO core, without sockets: matching answers to requests,
when a stream ends, typed errors and events."""

from __future__ import annotations

import pytest

from hermes_sup.client import (
    ApprovalRequest,
    Backoff,
    Dropped,
    Event,
    Output,
    Overloaded,
    ProtocolError,
    Queued,
    Reply,
    Running,
    SessionFailed,
    SupervisorError,
    Token,
    ToolComplete,
)
from hermes_sup.client.core import ClientCore, check
from hermes_sup.client.events import to_event
from hermes_sup.protocol import Kind, Message, encode

KEY = b"k" * 32


def answer(pending_id: str, kind: Kind, body: dict, key: bytes = KEY) -> list[bytes]:
    return encode(Message(kind, body, session="s", re=pending_id), key)


def test_answers_reach_their_request_and_a_stream_ends_on_its_reply() -> None:
    core = ClientCore(KEY)
    ping, _ = core.request(Kind.PING)
    turn, frames = core.request(Kind.SEND, {"text": "hi"}, "s")
    assert len(frames) == 3 and turn.stream and not ping.stream
    event = {"type": "token", "data": "h"}
    assert core.receive(answer(turn.id, Kind.EVENT, event)) is turn and not turn.done
    assert core.receive(answer(ping.id, Kind.PONG, {"version": "1", "protocol": 1, "pid": 1,
                                                    "uptime": 0.0})) is ping  # fmt: skip
    assert ping.done and ping.id not in core.pending
    assert core.receive(answer(turn.id, Kind.REPLY, {"text": "hi", "ok": True})) is turn
    assert turn.done and core.pending == {}
    assert [m.kind for m in turn.inbox] == [Kind.EVENT, Kind.REPLY]


def test_frames_not_ours_are_dropped_and_counted() -> None:
    core = ClientCore(KEY)
    ping, _ = core.request(Kind.PING)
    pong = {"version": "1", "protocol": 1, "pid": 1, "uptime": 0.0}
    assert core.receive(answer(ping.id, Kind.PONG, pong, key=b"x" * 32)) is None  # wrong key
    assert (
        core.receive(answer("someone-else", Kind.ERROR, {"code": "busy", "message": "m"})) is None
    )
    assert core.receive([b"garbage"]) is None
    assert core.dropped == 3 and not ping.done


def test_a_dropped_notice_on_a_turn_queues_its_send_again_and_on_a_watch_does_not() -> None:
    """The supervisor may have dropped the turn's reply too (beyond what it
    keeps for a lagging client): the very same frames go again, so the
    turn gets its final answer (or an error) instead of waiting for ever."""
    core = ClientCore(KEY)
    turn, frames = core.request(Kind.SEND, {"text": "hi"}, "s")
    watch, _ = core.request(Kind.WATCH, {}, "s")
    notice = {"type": "dropped", "data": {"count": 4, "reason": "slow_consumer"}}
    assert core.receive(answer(turn.id, Kind.EVENT, notice)) is turn
    assert core.receive(answer(watch.id, Kind.EVENT, notice)) is watch
    assert core.take_outbox() == [frames] and core.take_outbox() == []
    event = to_event(turn.inbox[0])
    assert isinstance(event, Dropped) and event.count == 4 and event.reason == "slow_consumer"
    # Its reply (kept, or the answer to the resend) ends it; a second one is
    # an answer to a request no longer pending, and is dropped.
    reply = answer(turn.id, Kind.REPLY, {"text": "hi", "ok": True})
    assert core.receive(reply) is turn and turn.done
    assert core.receive(reply) is None and core.take_outbox() == []


def test_watch_ends_only_when_unwatched_or_on_error() -> None:
    core = ClientCore(KEY)
    watch, _ = core.request(Kind.WATCH, {}, None)
    for body in ({"type": "watching"}, {"type": "state", "data": {"state": "idle"}}):
        core.receive(answer(watch.id, Kind.EVENT, body))
    core.receive(answer(watch.id, Kind.REPLY, {"text": "x", "ok": True}))  # not the end
    assert not watch.done
    core.receive(answer(watch.id, Kind.EVENT, {"type": "unwatched"}))
    assert watch.done
    failed, _ = core.request(Kind.WATCH, {}, None)
    core.receive(answer(failed.id, Kind.ERROR, {"code": "bad_field", "message": "no"}))
    assert failed.done


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        ("overloaded", Overloaded),
        ("session_failed", SessionFailed),
        ("bad_signature", ProtocolError),
        ("a_code_from_the_future", SupervisorError),
    ],
)
def test_error_answers_raise_typed_errors_with_their_code(code: str, cls: type) -> None:
    msg = Message(Kind.ERROR, {"code": code, "message": "why"}, session="s")
    with pytest.raises(cls) as raised:
        check(msg)
    assert raised.value.code == code and raised.value.message == "why"
    assert raised.value.session == "s" and type(raised.value) is cls


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"type": "status", "data": {"state": "queued", "position": 2}}, Queued(
            "status", {"state": "queued", "position": 2}, "s", "t", position=2)),
        ({"type": "status", "data": {"state": "running", "pid": 9}}, Running(
            "status", {"state": "running", "pid": 9}, "s", "t", pid=9)),
        ({"type": "status", "data": {"state": "backoff", "retry_in": 1, "reason": "r"}},
         Backoff("status", {"state": "backoff", "retry_in": 1, "reason": "r"}, "s", "t",
                 retry_in=1.0, reason="r")),
        ({"type": "token", "data": "abc"}, Token("token", "abc", "s", "t", text="abc")),
        ({"type": "output", "data": "line"}, Output("output", "line", "s", "t", line="line")),
        ({"type": "mystery", "data": [1]}, Event("mystery", [1], "s", "t")),
    ],
)  # fmt: skip
def test_events_become_typed(body: dict, expected: Event) -> None:
    assert to_event(Message(Kind.EVENT, body, session="s", re="t")) == expected


def test_approval_tool_and_reply_fields() -> None:
    approval = to_event(
        Message(
            Kind.EVENT,
            {
                "type": "approval",
                "data": {"command": "rm x", "choices": ["once", "deny"], "allow_permanent": True},
            },
            session="s",
            re="t",
        )  # fmt: skip
    )
    assert isinstance(approval, ApprovalRequest)
    assert (approval.command, approval.choices, approval.allow_permanent) == (
        "rm x",
        ("once", "deny"),
        True,
    )
    tool = to_event(
        Message(
            Kind.EVENT,
            {"type": "tool_complete", "data": {"id": "1", "name": "terminal", "result": "ok"}},
            re="t",
        )  # fmt: skip
    )
    assert isinstance(tool, ToolComplete) and (tool.name, tool.result) == ("terminal", "ok")
    reply = to_event(Message(Kind.REPLY, {"text": "done", "ok": False, "data": {"a": 1}}, re="t"))
    assert isinstance(reply, Reply) and (reply.text, reply.ok, reply.data) == (
        "done",
        False,
        {"a": 1},
    )
    assert reply.turn == "t" and reply.events == []


def test_the_core_does_no_io() -> None:
    """core, events and errors import no socket library: the two transports
    are the only I/O."""
    import ast
    from pathlib import Path

    client_dir = Path(__file__).resolve().parent.parent / "client"
    for name in ("core.py", "events.py", "errors.py"):
        tree = ast.parse((client_dir / name).read_text())
        imported = {
            alias.name.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
        } | {
            (node.module or "").split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
        }
        assert not imported & {"zmq", "socket", "asyncio", "threading", "selectors"}, name


from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

# Field names the typed events read, so that wrong types under them get tried.
NAMES = ["state", "position", "pid", "retry_in", "reason", "text", "id", "name", "args",
         "result", "command", "description", "choices", "allow_permanent", "outcome",
         "previous", "data", "ok"]  # fmt: skip
FIELDS = st.sampled_from(NAMES) | st.text(max_size=6)
ANY = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(FIELDS, inner, max_size=4),
    max_leaves=8,
)
TYPES = st.sampled_from(
    ["status", "token", "output", "tool_start", "tool_complete", "approval",
     "approval_timeout", "state", "turn", "reply", "mystery"]
)  # fmt: skip


@given(
    etype=TYPES,
    data=ANY,
    every=st.fixed_dictionaries(dict.fromkeys(NAMES, ANY)),
    as_map=st.booleans(),
    state=ANY,
)
def test_any_schema_valid_event_becomes_an_event_without_raising(
    etype, data, every, as_map, state
) -> None:
    if as_map:  # every field the typed events read, each of any type
        data = {**every, **data} if isinstance(data, dict) else every
        if etype == "status":
            data["state"] = state
    event = to_event(Message(Kind.EVENT, {"type": etype, "data": data}, session="s", re="t"))
    assert isinstance(event, Event) and event.type == etype and event.session == "s"


@given(frames=st.lists(st.binary(max_size=64), max_size=4))
def test_the_core_drops_garbage_frames_without_raising(frames) -> None:
    core = ClientCore(KEY)
    ping, _ = core.request(Kind.PING)
    assert core.receive(frames) is None and not ping.done


def test_answers_with_fields_from_a_newer_supervisor_still_read() -> None:
    from hermes_sup.client import core

    pong = Message(Kind.PONG, {"version": "9", "protocol": 1, "pid": 5, "uptime": 1.0, "new": True})
    assert core.ping().read(pong).pid == 5
    opened = Message(Kind.OPENED, {"pid": 7, "state": "idle", "created": True, "extra": 1})
    assert core.open_session("s", None).read(opened).state == "idle"
    killed = Message(Kind.KILLED, {"pid": None, "reason": "stopped", "signal": "TERM"})
    assert core.kill("s").read(killed).reason == "stopped"
