"""Notices reach their chats across a gateway restart, through Hermes's
real gateway with the plugin (tests/gateway_driver.py): 8 chats on two
platforms speak once; the gateway goes down; each chat's worker then ends a
background process and a cron job (notices sent while no gateway listens);
the gateway starts again and no chat speaks. Each chat is told of its own
process and gets its own cron output, and no chat anything of another's."""

from __future__ import annotations

import json

import httpx
import pytest

from tests import test_http
from tests.test_gateway import run_gateway

# test_http's fixtures: a supervisor (probe runtime) serving the endpoint too.
endpoint = test_http.endpoint
endpoint_factory = test_http.endpoint_factory

CHATS = [("telegram", str(n)) for n in range(21, 25)] + [("discord", str(n)) for n in range(25, 29)]


def notify(ep, session_key: str, notice: dict) -> None:
    """The session's worker sends `notice` (the probe, in a turn of its own
    started beside the gateway, as a background process's end would be)."""
    started = httpx.post(
        ep.url + "/v1/runs",
        json={"input": f"notice {json.dumps(notice)}"},
        headers={**ep.headers(), "X-Hermes-Session-Key": session_key},
    )
    assert started.status_code == 202, started.text
    test_http.run_events(ep, started.json()["run_id"], "run.completed")


def test_notices_sent_while_the_gateway_was_down_reach_their_chats(endpoint, workdir) -> None:
    pytest.importorskip("gateway.run", reason="needs hermes-agent (the hermes extra)")
    home = workdir / "gateway-home"
    chats = [
        {"platform": p, "chat_id": c, "user_id": f"u{c}",
         "steps": [{"say": "pid", "wait": "text", "match": ""}]}
        for p, c in CHATS
    ]  # fmt: skip
    first = run_gateway(endpoint, home, chats)
    assert first["errors"] == [], "\n".join(first["errors"]) + first["log"]

    # The gateway is down: each chat's worker ends a process and runs a cron job.
    for platform, chat in CHATS:
        key = f"agent:main:{platform}:dm:{chat}"
        process = {
            "kind": "process",
            "event": {"type": "completion", "session_id": f"proc_{chat}", "command": "sleep 1",
                      "output": f"process-done-{chat}", "started_at": 1.0},
        }  # fmt: skip
        notify(endpoint, key, process)
        notify(endpoint, key, {"kind": "message", "text": f"cron-output-{chat}"})

    # It starts again, and no chat speaks.
    quiet = [{**c, "steps": []} for c in chats]
    wanted = {f"{p}:{c}": [f"process-done-{c}", f"cron-output-{c}"] for p, c in CHATS}
    second = run_gateway(endpoint, home, quiet, listen=wanted)
    assert second["errors"] == [], "\n".join(second["errors"]) + second["log"]
    for platform, chat in CHATS:
        texts = [t for _, t in second["sent"][f"{platform}:{chat}"]]
        others = [c for _, c in CHATS if c != chat]
        assert not [t for t in texts for o in others if f"-done-{o}" in t or f"-output-{o}" in t]
    # The driver waited until the endpoint kept none unacknowledged: a third
    # start is handed nothing again.
    third = run_gateway(endpoint, home, quiet, listen={})
    assert third["errors"] == [] and third["sent"] == {}, third


def test_answers_of_turns_a_gateway_crash_cut_reach_their_chats(endpoint, workdir) -> None:
    """8 chats' turns are running when the gateway dies; started again with
    no chat speaking, it sends each chat its turn's answer."""
    pytest.importorskip("gateway.run", reason="needs hermes-agent (the hermes extra)")
    home = workdir / "gateway-home"
    chats = [
        {"platform": p, "chat_id": c, "user_id": f"u{c}",
         "steps": [{"say": f"sleep 3.{c}", "wait": "busy"}]}
        for p, c in CHATS
    ]  # fmt: skip
    cut = run_gateway(endpoint, home, chats, crash=True)
    assert cut["errors"] == [], "\n".join(cut["errors"]) + cut["log"]
    assert not [t for sent in cut["sent"].values() for _, t in sent if "slept" in t], cut["sent"]

    quiet = [{**c, "steps": []} for c in chats]
    wanted = {f"{p}:{c}": [f"slept 3.{c}"] for p, c in CHATS}
    back = run_gateway(endpoint, home, quiet, listen=wanted)
    assert back["errors"] == [], "\n".join(back["errors"]) + back["log"]
    for platform, chat in CHATS:
        texts = [t for _, t in back["sent"][f"{platform}:{chat}"]]
        assert [t for t in texts if "slept" in t] == [f"slept 3.{chat}"], texts
    ledger = home / "hermes-sup" / "runs-in-flight.json"
    assert json.loads(ledger.read_text()) == {}  # each one told once
