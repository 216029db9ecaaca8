"""Approvals end to end, with the probe runtime's `ask`: every request has an
id, an answer goes only to the request it names, and an answer with nothing
waiting is refused, never acknowledged as approved."""

from __future__ import annotations

import pytest

from hermes_sup.client import ApprovalRequest, SupervisorError
from hermes_sup.protocol import Kind

from .test_faults import final


def approval_of(client, req: str) -> dict:
    """Read the turn's events until its approval request; return its data."""
    while True:
        msg = client.answer(req, timeout=20)
        assert msg.kind is Kind.EVENT, msg.body
        if msg.body["type"] == "approval":
            return msg.body["data"]


def test_approve_with_no_request_waiting_is_refused(supervisor) -> None:
    with supervisor.client() as client:
        req = client.submit(Kind.SEND, {"text": "sleep 600"}, session="calm")  # till cancelled
        while client.answer(req, timeout=20).body["data"]["state"] != "running":
            pass
        with pytest.raises(SupervisorError) as err:
            client.approve("calm", "once")
        assert err.value.code == "nothing_to_approve"
        assert "no approval request waiting" in err.value.message
        client.cancel("calm")
        assert final(client, req).body["text"] == "cancelled"


def test_an_answer_goes_only_to_the_request_it_names(supervisor, workdir) -> None:
    with supervisor.client() as client:
        # A request that ends unanswered (its turn is cancelled, which denies it).
        first = client.submit(Kind.SEND, {"text": "ask touch first"}, session="ops")
        stale = approval_of(client, first)["id"]
        client.cancel("ops")
        assert final(client, first).kind is Kind.REPLY
        # The next one, for another command.
        second = client.submit(Kind.SEND, {"text": "ask echo second-ran"}, session="ops")
        waiting = approval_of(client, second)
        assert waiting["id"] and waiting["id"] != stale
        # A late "once" meant for the first request approves nothing.
        with pytest.raises(SupervisorError) as err:
            client.approve("ops", "once", approval=stale)
        assert err.value.code == "nothing_to_approve"
        assert repr(stale) in err.value.message and repr(waiting["id"]) in err.value.message
        # The request it does name runs, once.
        assert client.approve("ops", "once", approval=waiting["id"]) == "once"
        output = []
        while (msg := client.answer(second, timeout=20)).kind is Kind.EVENT:
            if msg.body["type"] == "output":
                output.append(msg.body["data"])
        assert msg.kind is Kind.REPLY and output == ["second-ran"], (msg.body, output)
        with pytest.raises(SupervisorError) as err:
            client.approve("ops", "once", approval=waiting["id"])
        assert err.value.code == "nothing_to_approve"
    session_dir = next((supervisor.data_dir / "sessions").iterdir())
    assert not (session_dir / "workspace" / "first").exists()


def test_the_typed_events_carry_the_request_id(supervisor) -> None:
    with supervisor.client() as client:
        events = client.send("typed", "ask echo typed")
        for event in events:
            if isinstance(event, ApprovalRequest):
                assert event.id
                assert client.approve("typed", "deny", approval=event.id) == "deny"
                break
        reply = events.collect()
        assert reply.text.startswith("denied")
