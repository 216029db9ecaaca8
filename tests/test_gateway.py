"""Hermes's messaging gateway on hermes-sup: a chat's identity reaches its
worker with every turn (HERMES_SESSION_*), and the gateway plugin
(hermes_sup.gateway) runs Hermes's real GatewayRunner against the endpoint
with a fake platform adapter: streamed text, tool progress and approvals in
the chat that asked, and only there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests import test_http
from tests.test_http import run_events
from tests.waiting import load_factor

# test_http's fixtures: a supervisor (probe runtime) serving the endpoint too.
endpoint = test_http.endpoint
endpoint_factory = test_http.endpoint_factory

CHAT = {
    "platform": "telegram",
    "chat_id": "-1001",
    "chat_name": "Team room",
    "chat_type": "forum",
    "thread_id": "7",
    "user_id": "42",
    "user_name": "ann",
}
SHOW = (
    "sh echo $HERMES_SESSION_PLATFORM/$HERMES_SESSION_CHAT_ID/$HERMES_SESSION_CHAT_NAME/"
    "$HERMES_SESSION_THREAD_ID/$HERMES_SESSION_USER_ID/$HERMES_SESSION_USER_NAME"
)


def _run(ep, session_id: str, text: str, session_env=None) -> httpx.Response:
    body = {"input": text, "session_id": session_id}
    if session_env is not None:
        body["session_env"] = session_env
    return httpx.post(ep.url + "/v1/runs", json=body, headers=ep.headers())


def _output(ep, session_id: str, text: str, session_env=None) -> str:
    started = _run(ep, session_id, text, session_env)
    assert started.status_code == 202, started.text
    ended = run_events(ep, started.json()["run_id"], "run.completed")[-1]
    assert ended["event"] == "run.completed", ended
    return ended["output"]


def test_a_turns_chat_identity_reaches_its_worker_and_its_children(endpoint) -> None:
    """Each turn's session_env is the worker's HERMES_SESSION_* (a child
    process sees it); a group chat's next speaker replaces the user; an empty
    value unsets; another chat's session never sees it."""
    shown = _output(endpoint, "tg-1", SHOW, CHAT)
    assert shown.splitlines()[0] == "telegram/-1001/Team room/7/42/ann"
    bob = {**CHAT, "user_id": 43, "user_name": ""}  # a number is taken as its text
    assert _output(endpoint, "tg-1", SHOW, bob).splitlines()[0] == "telegram/-1001/Team room/7/43/"
    # A turn without session_env keeps what the chat last said.
    assert _output(endpoint, "tg-1", "env HERMES_SESSION_USER_ID") == "43"
    assert _output(endpoint, "tg-2", "env HERMES_SESSION_CHAT_ID") == ""
    # The session key stays the supervisor's.
    assert _output(endpoint, "tg-1", "env HERMES_SESSION_KEY") == endpoint.session("tg-1")


def test_a_bad_identity_is_refused_by_name_and_the_endpoint_serves_on(endpoint) -> None:
    for bad, named in [
        ({"key": "other"}, "unknown name 'key'"),
        ({"home": "/"}, "unknown name 'home'"),
        ({"chat_id": "1\n2"}, "session_env'.chat_id holds a control"),
        ({"platform": ["telegram"]}, "must be a string, got list"),
        ({"user_name": "x" * 513}, "over 512"),
        ("telegram", "must be a map"),
    ]:
        refused = _run(endpoint, "tg-bad", "pid", bad)
        assert refused.status_code == 400, (bad, refused.text)
        assert refused.json()["error"]["code"] == "invalid_session_env"
        assert named in refused.json()["error"]["message"], refused.text
    assert _output(endpoint, "tg-bad", "env HERMES_SESSION_PLATFORM", CHAT) == "telegram"


def test_the_identity_a_session_was_opened_with_is_not_a_turns_to_change(endpoint) -> None:
    """An operator opened the session for one chat: a turn naming another
    chat runs, but in the chat the session was opened for."""
    key = endpoint.session("fixed")
    with endpoint.sup.client() as hs:
        hs.open(key, session_env={"platform": "discord", "chat_id": "9"})
    shown = _output(endpoint, "fixed", SHOW, CHAT)
    assert shown.splitlines()[0] == "discord/9/Team room/7/42/ann"


# ------------------------------------------------------------------ the gateway

GATEWAY_CONFIG = """
plugins:
  enabled: [hermes-sup]
display:
  tool_progress: all
approvals:
  timeout: 120
"""


def run_gateway(ep, home: Path, chats: list[dict], plugin: bool = True) -> dict:
    """Hermes's GatewayRunner (tests/gateway_driver.py) in its own process,
    in front of the endpoint `ep` (its proxy URL and key)."""
    home.mkdir(exist_ok=True)
    (home / "config.yaml").write_text(GATEWAY_CONFIG if plugin else "")
    env = {
        **os.environ,
        "HERMES_HOME": str(home),
        "GATEWAY_ALLOW_ALL_USERS": "true",
        "DRIVER_STEP_TIMEOUT": str(60 * load_factor()),
    }
    if ep is not None:
        env.update(GATEWAY_PROXY_URL=ep.url, GATEWAY_PROXY_KEY=ep.key)
    driver = Path(__file__).with_name("gateway_driver.py")
    done = subprocess.run(
        [sys.executable, str(driver), json.dumps({"chats": chats, "plugin": plugin})],
        env=env,
        capture_output=True,
        text=True,
        timeout=300 * load_factor(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_gateway_plugin_gives_each_chat_its_identity_and_its_own_approvals(
    endpoint, workdir
) -> None:
    """Four chats on two platforms through Hermes's real gateway and the
    plugin: each worker knows its chat; each chat's approval prompt appears
    in that chat, and its /approve there releases that command only."""
    pytest.importorskip("gateway.run", reason="needs hermes-agent (the hermes extra)")
    chats = []
    for platform, chat_id in [
        ("telegram", "11"),
        ("telegram", "12"),
        ("discord", "21"),
        ("discord", "22"),
    ]:
        chats.append(
            {
                "platform": platform,
                "chat_id": chat_id,
                "user_id": "u" + chat_id,
                "steps": [
                    {"say": SHOW, "wait": "text", "match": f"{platform}/{chat_id}/chat {chat_id}"},
                    {
                        "say": f"ask touch ok-{chat_id}",
                        "wait": "approval",
                        "match": f"ok-{chat_id}",
                    },
                    {"say": "/approve", "wait": "text", "match": "exit 0"},
                    {"say": "sh ls", "wait": "text", "match": f"ok-{chat_id}"},
                    {"say": f"write note-{chat_id}.ogg hi", "wait": "text", "match": "note"},
                    {
                        "say": f"media note-{chat_id}.ogg voice",
                        "wait": "voice" if platform == "telegram" else "audio",
                        "match": f"note-{chat_id}.ogg",
                    },
                ],
            }
        )
    report = run_gateway(endpoint, workdir / "gateway-home", chats)
    assert report["errors"] == [], "\n".join(report["errors"])
    for c in chats:
        mine = f"{c['platform']}:{c['chat_id']}"
        got = report["sent"][mine]
        approvals = [text for kind, text in got if kind == "approval"]
        assert approvals == [f"touch ok-{c['chat_id']}"], got
        # Nothing of another chat reached this one.
        others = [x["chat_id"] for x in chats if x is not c]
        assert not [t for _, t in got for o in others if f"ok-{o}" in t or f"/{o}/" in t], got
    assert sorted(report["sent"]) == sorted(f"{c['platform']}:{c['chat_id']}" for c in chats)
