"""`send` with `ack: false`: no `running` event when the turn starts.

The real Turns and Front with a fake pool and fake endpoints (no process,
no socket), and once end to end with a real supervisor."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack
import pytest

from hermes_sup.protocol import ErrorCode, Kind, Message, RemoteProtocolError, decode, encode
from hermes_sup.protocol.wire import sign

from .fakes import ALICE, CLIENT_KEY, Rig


@pytest.fixture
def rig(tmp_path, monkeypatch) -> Callable[..., Rig]:
    return lambda **settings: Rig(tmp_path, monkeypatch, **settings)


def sent(h: Rig, key: str, text: str, **flags: Any) -> str:
    """A `send` of `text` to `key` with body `flags` (e.g. ack=False)."""
    msg = Message(Kind.SEND, {"text": text, **flags}, session=key)
    h.front.on_frames(ALICE[0], [ALICE[1:], *encode(msg, CLIENT_KEY)])
    return msg.id


def test_a_turn_that_asked_for_no_ack_gets_no_running_event(rig) -> None:
    h = rig()

    async def scenario() -> None:
        warm = sent(h, "a", "hi")
        proc = await h.started("a")
        assert h.statuses(warm)[-1] == {"state": "running", "pid": proc.pid}  # the default
        h.reply("a", "hello")

        quiet = sent(h, "a", "again", ack=False)
        assert [m.id for m in h.to_worker("a", Kind.TURN)][-1] == quiet  # it runs
        assert h.statuses(quiet) == []
        h.reply("a", "done")
        assert [m.kind for m in h.answers(quiet)] == [Kind.REPLY]  # the answer, nothing else

        loud = sent(h, "a", "and again", ack=True)
        assert h.statuses(loud) == [{"state": "running", "pid": proc.pid}]
        h.reply("a", "ok")
        assert h.turns.unacked == set()

    h.run(scenario())


def test_a_queued_turn_is_still_told_it_waits_but_not_that_it_runs(rig) -> None:
    h = rig()

    async def scenario() -> None:
        first = sent(h, "a", "hi", ack=False)
        await h.started("a")
        second = sent(h, "a", "next", ack=False)
        # A new session's first turn waits for its worker, and says so.
        assert h.statuses(first) == [{"state": "queued", "position": 1}]
        assert h.statuses(second) == [{"state": "queued", "position": 1}]
        h.reply("a", "one")
        assert [m.id for m in h.to_worker("a", Kind.TURN)][-1] == second
        assert h.statuses(second) == [{"state": "queued", "position": 1}]  # no `running`
        h.reply("a", "two")
        assert [m.body["text"] for m in h.finals(second)] == ["two"]
        assert h.turns.unacked == set()

    h.run(scenario())


def test_a_quiet_turn_that_never_ran_is_forgotten(rig) -> None:
    h = rig()

    async def scenario() -> None:
        sent(h, "a", "hi")
        await h.started("a")
        queued = sent(h, "a", "next", ack=False)
        assert queued in h.turns.unacked
        h.cancel("a", queued)
        assert h.finals(queued)[0].kind is Kind.ERROR
        assert h.turns.unacked == set()  # nothing kept for a turn that ended

    h.run(scenario())


def test_ack_must_be_a_boolean() -> None:
    good = Message(Kind.SEND, {"text": "x", "ack": False}, session="a")
    assert decode(encode(good, CLIENT_KEY), CLIENT_KEY).body["ack"] is False
    frames = encode(good, CLIENT_KEY)
    envelope = msgpack.unpackb(frames[2])
    envelope["body"]["ack"] = "no"
    frames[2] = msgpack.packb(envelope)
    frames[1] = sign(CLIENT_KEY, frames[2])
    with pytest.raises(RemoteProtocolError) as err:
        decode(frames, CLIENT_KEY)
    assert err.value.code is ErrorCode.BAD_FIELD and "'ack'" in err.value.message


@pytest.mark.e2e
def test_a_real_supervisor_sends_no_running_event_to_a_turn_that_asked_for_none(
    supervisor,
) -> None:
    with supervisor.client() as client:
        client.run("a", "x")  # a worker, idle: the next turn starts at once

        def messages(body: dict[str, Any]) -> list[Message]:
            req = client.submit(Kind.SEND, body, session="a")
            got = [client.answer(req)]
            while got[-1].kind is Kind.EVENT:
                got.append(client.answer(req))
            return got

        loud = messages({"text": "x"})
        assert [m.body.get("data", {}).get("state") for m in loud[:-1]] == ["running"]
        quiet = messages({"text": "x", "ack": False})
        assert [m.kind for m in quiet] == [Kind.REPLY] and quiet[0].body["text"] == "x"
