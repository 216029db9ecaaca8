"""Hermes's messaging gateway on hermes-sup, tried as a hostile session
would: files a session names or links, answers naming the gateway's own
files, forged and flooding notices, another key's notices; and the plugin
on a Hermes it was not tested with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests import test_http
from tests.test_gateway import _output, _run, run_gateway
from tests.test_http import run_events
from tests.waiting import load_factor

# test_http's fixtures: a supervisor (probe runtime) serving the endpoint too.
endpoint = test_http.endpoint
endpoint_factory = test_http.endpoint_factory


# ------------------------------------------------------------------ hostile sessions


def test_a_sessions_files_reach_only_its_own_runs_and_never_another_hosts_file(endpoint) -> None:
    """From a session's shell: a link to a file it may not send, a file too
    large, a name meant to break out; and another key asking for the files."""
    from hermes_sup.httpapi.keys import KeyStore

    def run(text: str) -> tuple[str, list[dict]]:
        started = _run(endpoint, "files", text)
        assert started.status_code == 202, started.text
        run_id = started.json()["run_id"]
        return run_id, run_events(endpoint, run_id, "run.completed")

    _output(endpoint, "files", "sh ln -s /etc/hostname link.ogg && printf hi > 'a;b$(x).ogg'")
    run_id, events = run("media link.ogg voice")
    assert "cannot read link.ogg" in events[-1]["output"]  # a link is not followed
    assert not [e for e in events if e["event"] == "media.available"]
    _output(endpoint, "files", "sh head -c 9000000 /dev/zero > big.ogg")
    run_id, events = run("media big.ogg")
    (big,) = [e for e in events if e["event"] == "media.available"]
    assert big["available"] is False and big["size"] == 9_000_000
    url = f"{endpoint.url}/v1/runs/{run_id}/media/0"
    assert httpx.get(url, headers=endpoint.headers()).status_code == 410
    run_id, events = run("media a;b$(x).ogg voice")
    (odd,) = [e for e in events if e["event"] == "media.available"]
    assert odd["name"] == "a_b__x_.ogg" and odd["voice"] is True
    url = f"{endpoint.url}/v1/runs/{run_id}/media/0"
    got = httpx.get(url, headers=endpoint.headers())
    assert got.status_code == 200 and got.content == b"hi"
    assert got.headers["content-type"] == "audio/ogg"
    for bad in ("1", "-1", "..%2f0", "99999999"):
        missing = httpx.get(f"{url[:-1]}{bad}", headers=endpoint.headers())
        assert missing.status_code == 404, bad
    other = KeyStore(endpoint.sup.data_dir).generate("other")
    assert httpx.get(url, headers={"Authorization": f"Bearer {other}"}).status_code == 404


def test_an_answer_naming_a_file_of_the_gateways_host_uploads_nothing(endpoint, workdir) -> None:
    """A session (an injected prompt) names a file of the gateway's host in
    its answer, as a MEDIA tag and as a bare path: the chat gets the text,
    never the file."""
    pytest.importorskip("gateway.run", reason="needs hermes-agent (the hermes extra)")
    home = workdir / "gateway-home"
    home.mkdir()
    secret = home / "secret-notes.pdf"
    secret.write_text("the gateway's own")
    chat = {
        "platform": "telegram",
        "chat_id": "66",
        "user_id": "u66",
        "steps": [
            {"say": f"[[audio_as_voice]] MEDIA:{secret}", "wait": "document", "match": "secret"},
            {"say": f"here: {secret}", "wait": "document", "match": "secret"},
        ],
    }
    report = run_gateway(endpoint, home, [chat])
    got = report["sent"]["telegram:66"]
    assert len(report["errors"]) == 2, report  # neither step uploaded the file
    assert not [k for k, _ in got if k in ("document", "voice", "audio")], got
    assert any(k == "text" and "here:" in t for k, t in got), got


def test_a_workers_notices_reach_only_its_own_chat_and_not_a_flood(endpoint, workdir) -> None:
    """A session's notices (here the probe's, as a hostile worker would
    send them) name another chat and claim its routing: they reach the
    session's own chat, never that one; a flood is cut at 20 a minute."""
    pytest.importorskip("gateway.run", reason="needs hermes-agent (the hermes extra)")
    other = "agent:main:telegram:dm:82"
    message = {"kind": "message", "text": "msg-from-81", "platform": "telegram", "chat_id": "82"}
    process = {
        "kind": "process",
        "event": {
            "type": "completion",
            "session_id": "proc_x",
            "command": "true",
            "output": "out-from-81",
            "session_key": other,
            "platform": "telegram",
            "chat_id": "82",
        },
    }
    chats = [
        {
            "platform": "telegram",
            "chat_id": "81",
            "user_id": "u81",
            "steps": [
                {
                    "say": f"notice {json.dumps(message)}",
                    "wait": "text",
                    "match": "msg-from-81",
                    "later": True,
                },
                {
                    "say": f"notice {json.dumps(process)}",
                    "wait": "text",
                    "match": "out-from-81",
                    "later": True,
                },
                {
                    "say": 'notice 100 {"kind": "message", "text": "flood-81"}',
                    "wait": "text",
                    "match": "sent 100",
                },
            ],
        },
        {
            "platform": "telegram",
            "chat_id": "82",
            "user_id": "u82",
            "steps": [{"say": "pid", "wait": "text", "match": ""}],
        },
    ]
    report = run_gateway(endpoint, workdir / "gateway-home", chats)
    assert report["errors"] == [], "\n".join(report["errors"]) + report["log"]
    theirs = report["sent"]["telegram:82"]
    assert not [t for _, t in theirs if "from-81" in t or "flood-81" in t], theirs
    mine = [t for k, t in report["sent"]["telegram:81"] if k == "text"]
    # 20 a minute, two of them the first notices: at most 18 of the flood.
    assert 0 < sum(t == "flood-81" for t in mine) <= 18, mine


# ------------------------------------------------------------------ pinned

REFUSAL_SCRIPT = """
import asyncio, sys
import gateway.run
if sys.argv[1] == "signature":
    async def changed(self, message, context_prompt, history, source, session_id, **kw):
        return {"final_response": "plain proxy mode"}
    gateway.run.GatewayRunner._run_agent_via_proxy = changed
from hermes_sup.gateway_plugin import install
install()
proxy = gateway.run.GatewayRunner._run_agent_via_proxy
print(asyncio.run(proxy(None, "hi", "", [], None, "s"))["final_response"])
"""


@pytest.mark.slow  # Hermes's gateway imported in a new interpreter, each case
@pytest.mark.parametrize(
    ("change", "said"), [("signature", "GatewayRunner._run_agent_via_proxy takes")]
)
def test_the_plugin_refuses_every_turn_on_a_hermes_it_was_not_tested_with(
    change: str, said: str, tmp_path: Path
) -> None:
    """The replaced method changed to a layout the plugin does not know
    (tests/test_plugin_layouts.py has the known ones): no turn runs (plain
    proxy mode would lose the chat's identity and approvals without a
    word), and the answer says why."""
    pytest.importorskip("gateway.run", reason="needs hermes-agent (the hermes extra)")
    env = {**os.environ, "HERMES_HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", REFUSAL_SCRIPT, change],
        env=env,
        capture_output=True,
        text=True,
        timeout=120 * load_factor(),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    answer = done.stdout.strip().splitlines()[-1]
    assert answer.startswith("⚠️ hermes-sup gateway plugin: ") and said in answer, answer
    assert "no turn runs until the plugin is updated for it" in answer


def test_notices_go_to_their_own_key_and_a_key_holds_few_streams(endpoint) -> None:
    """A key's notice stream has its own sessions' notices, never another
    key's; a key holds at most 4 streams (each takes one of the endpoint's
    watches, which all keys share)."""
    import threading

    from hermes_sup.httpapi.keys import KeyStore

    other = KeyStore(endpoint.sup.data_dir).generate("other")
    seen: dict[str, list[str]] = {"test": [], "other": []}
    ready = threading.Barrier(3)

    def listen(name: str, key: str) -> None:
        auth = {"Authorization": f"Bearer {key}"}
        with httpx.stream("GET", endpoint.url + "/v1/notices", headers=auth, timeout=30) as got:
            ready.wait()
            for line in got.iter_lines():
                if line.startswith("data: "):
                    seen[name].append(json.loads(line[6:])["notice"]["text"])
                    if seen[name][-1] == "last":
                        return

    threads = [
        threading.Thread(target=listen, args=(n, k), daemon=True)
        for n, k in (("test", endpoint.key), ("other", other))
    ]
    for t in threads:
        t.start()
    ready.wait()
    _output(endpoint, "n1", 'notice {"kind": "message", "text": "mine"}')
    with httpx.Client(headers={"Authorization": f"Bearer {other}"}) as theirs:
        run = theirs.post(endpoint.url + "/v1/runs", json={"input": 'notice {"text": "last"}'})
        assert run.status_code == 202
    _output(endpoint, "n1", 'notice {"kind": "message", "text": "last"}')
    for t in threads:
        t.join(30 * load_factor())
    assert seen == {"test": ["mine", "last"], "other": ["last"]}
    # Four streams of one key at once, not five.
    streams = [
        httpx.stream("GET", endpoint.url + "/v1/notices", headers=endpoint.headers(), timeout=30)
        for _ in range(5)
    ]
    opened, reading = [], []
    try:
        for s in streams[:4]:
            opened.append(s.__enter__())
            reading.append(opened[-1].iter_lines())  # kept: a dropped one closes its stream
            next(reading[-1])  # its first line: it is open
        with streams[4] as fifth:
            assert fifth.status_code == 429
    finally:
        for s, _ in zip(streams, opened, strict=False):
            s.__exit__(None, None, None)
