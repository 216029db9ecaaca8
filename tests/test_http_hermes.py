"""The HTTP endpoint in front of the real Hermes agent (against the fake
model server): the bleed Hermes's own API server shows between sessions
does not happen here, and tool activity streams as Hermes sends it."""

from __future__ import annotations

import asyncio
import json
import os
import re

import httpx
import pytest

from hermes_sup.httpapi.keys import KeyStore

from .conftest import needs_hermes
from .fake_model import FakeModel, _text
from .test_http import wait_ready

pytestmark = needs_hermes


@pytest.fixture
def hermes_http(supervisor_factory, workdir):
    model = FakeModel()
    config = workdir / "agent.toml"
    config.write_text(
        f'model = "fake-model"\nbase_url = "{model.url}"\nprovider = "custom"\n'
        f'toolsets = ["terminal"]\napi_key_env = "FAKE_MODEL_KEY"\n'
    )
    home = workdir / "user-home"
    home.mkdir()
    env = dict(os.environ, FAKE_MODEL_KEY="sk-fake-secret", HOME=str(home))
    sup = supervisor_factory(
        "--agent", "hermes", "--agent-config", str(config), "--http", "127.0.0.1:0",
        env=env, start=False,
    )  # fmt: skip
    key = KeyStore(sup.data_dir).generate("test")
    sup.start()
    try:
        yield wait_ready(sup.log_path, None), key, model
    finally:
        model.close()


async def chat(url: str, key: str, session: str, text: str) -> tuple[str, list[dict], list[str]]:
    """One streamed turn, as the Hermes gateway sends it: the reply's text,
    the tool progress events, and every SSE line."""
    headers = {"Authorization": f"Bearer {key}", "X-Hermes-Session-Id": session}
    body = {
        "model": "hermes-agent",
        "stream": True,
        "messages": [{"role": "system", "content": "ctx"}, {"role": "user", "content": text}],
    }
    lines, progress, content = [], [], []
    async with httpx.AsyncClient(timeout=120) as http:
        async with http.stream(
            "POST", url + "/v1/chat/completions", json=body, headers=headers
        ) as response:
            assert response.status_code == 200, await response.aread()
            event = None
            async for line in response.aiter_lines():
                lines.append(line)
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: ") and line != "data: [DONE]":
                    data = json.loads(line[6:])
                    if event == "hermes.tool.progress":
                        progress.append(data)
                    elif data["choices"]:
                        content.append(data["choices"][0]["delta"].get("content") or "")
                    event = None
    assert [line for line in lines if line][-1] == "data: [DONE]"
    return "".join(content), progress, lines


def test_sessions_behind_the_endpoint_never_bleed(hermes_http) -> None:
    url, key, _ = hermes_http

    async def main() -> tuple:
        a_set = await chat(url, key, "tg-a", "run: export LEAK=from-a; echo exported")
        a_again, b_seen = await asyncio.gather(
            chat(url, key, "tg-a", "run: echo again=$LEAK key=$HERMES_SESSION_KEY"),
            chat(url, key, "tg-b", "run: echo leak=$LEAK key=$HERMES_SESSION_KEY"),
        )
        return a_set, a_again, b_seen

    a_set, a_again, b_seen = asyncio.run(main())
    # The tool call streamed as Hermes's API server streams it.
    running, completed = a_set[1]
    assert running["tool"] == "terminal" and running["status"] == "running"
    assert running["toolCallId"] and running["emoji"] and "echo exported" in running["label"]
    assert completed == {
        "tool": "terminal",
        "toolCallId": running["toolCallId"],
        "status": "completed",
    }
    assert "exported" in a_set[0]
    # Session A's shell keeps its export; session B's never sees it, nor A's key.
    assert "again=from-a" in a_again[0] and re.search(r"key=test\+[0-9a-f]{12}\+tg-a\b", a_again[0])
    assert re.search(r"leak= key=test\+[0-9a-f]{12}\+tg-b\b", b_seen[0])
    assert "from-a" not in b_seen[0] and "tg-a" not in b_seen[0]


def test_the_responses_api_streams_tool_calls_as_function_call_items(hermes_http) -> None:
    url, key, _ = hermes_http
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)
    events = list(client.responses.create(model="m", input="run: echo from-responses", stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
    added = [e.item for e in events if e.type == "response.output_item.added"]
    call = next(i for i in added if i.type == "function_call")
    assert (
        call.name == "terminal" and "echo from-responses" in json.loads(call.arguments)["command"]
    )
    output = next(i for i in added if i.type == "function_call_output")
    assert output.call_id == call.call_id and "from-responses" in output.output[0]["text"]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert any(i.type == "function_call" and i.status == "completed" for i in done)
    final = events[-1].response
    assert [i.type for i in final.output] == ["function_call", "function_call_output", "message"]
    assert "from-responses" in final.output_text
    # Chained, not streamed: the same session's shell, the same conversation.
    again = client.responses.create(
        model="m", input="run: echo key=$HERMES_SESSION_KEY", previous_response_id=final.id
    )
    assert [i.type for i in again.output] == ["function_call", "function_call_output", "message"]
    assert re.search(rf"key=test\+[0-9a-f]{{12}}\+{final.id}\b", again.output_text)
    # A conversation named with characters Hermes cannot take as an id (a
    # `/`) still keeps its history from turn to turn.
    named = [
        client.responses.create(model="m", input=text, conversation="team/chat 1").output_text
        for text in ("first", "second")
    ]
    assert named == ["echo: first (turn 1)", "echo: second (turn 2)"]


def run_events(url: str, key: str, text: str) -> list[dict]:
    """Start a run and follow its events to its end."""
    auth = {"Authorization": f"Bearer {key}"}
    started = httpx.post(url + "/v1/runs", json={"input": text}, headers=auth)
    assert started.status_code == 202, started.text
    events = []
    with httpx.stream(
        "GET", f"{url}/v1/runs/{started.json()['run_id']}/events", headers=auth, timeout=120
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if events[-1]["event"].startswith("run."):
                    break
    return events


def test_runs_report_the_models_reasoning_as_reasoning_available(hermes_http) -> None:
    url, key, _ = hermes_http
    thought = run_events(url, key, "think: weigh it first, then answer ;; yes")
    kinds = [e["event"] for e in thought]
    assert kinds[-1] == "run.completed" and thought[-1]["output"] == "said: yes"
    reasoning = [e for e in thought if e["event"] == "reasoning.available"]
    # The model's reasoning, whole, before the text; then what Hermes's own
    # API server reports as reasoning too: the words of each model answer.
    assert [e["text"] for e in reasoning] == ["weigh it first, then answer", "said: yes"]
    assert kinds.index("reasoning.available") < kinds.index("message.delta")
    narrated = run_events(url, key, "narrate: echo narrated")
    said = [e["text"] for e in narrated if e["event"] == "reasoning.available"]
    assert said[0] == "Running echo narrated for you." and said[1].startswith("done: ")
    assert [e["event"] for e in narrated if e["event"].startswith("tool.")] == [
        "tool.started",
        "tool.completed",
    ]


def test_chats_that_name_no_session_are_exactly_what_their_client_sent(hermes_http) -> None:
    """Clients that resend the whole history and send no session header
    (Open WebUI, the plain openai SDK): each model request holds exactly
    the conversation its client sent, never another's that began alike,
    never a message twice after a regenerate or an edit; a conversation
    that goes on as it was left keeps its worker."""
    url, key, model = hermes_http
    system = {"role": "system", "content": "You are helpful."}

    def turn(*said: str) -> tuple[str, list[str], str]:
        """One turn of a chat holding `said` (user, assistant, ..., user):
        the reply, the user messages of the model's request, all of it."""
        messages = [system] + [
            {"role": "user" if i % 2 == 0 else "assistant", "content": text}
            for i, text in enumerate(said)
        ]
        before = len(model.requests)
        answer = httpx.post(
            url + "/v1/chat/completions",
            json={"model": "hermes-agent", "messages": messages},
            headers={"Authorization": f"Bearer {key}"},
            timeout=120,
        )
        assert answer.status_code == 200, answer.text
        asked = model.requests[before:][-1]
        users = [_text(m) for m in asked["messages"] if m.get("role") == "user"]
        return answer.json()["choices"][0]["message"]["content"], users, json.dumps(asked)

    secret = "my password is X-SECRET-32717"
    x1, users, _ = turn("hi")
    assert users == ["hi"]
    x2, users, _ = turn("hi", x1, secret)
    assert users == ["hi", secret]
    y1, users, request = turn("hi")  # another client, the same start
    assert users == ["hi"] and "X-SECRET" not in request
    y2, users, request = turn("hi", y1, "what is my password?")
    assert users == ["hi", "what is my password?"] and "X-SECRET" not in request
    # X regenerates its last answer, then edits its message: each once.
    _, users, _ = turn("hi", x1, secret)
    assert users == ["hi", secret]
    _, users, request = turn("hi", x1, "my password is different")
    assert users == ["hi", "my password is different"] and "X-SECRET" not in request

    # A conversation that goes on as it was left stays in its worker, and so
    # does a regenerate or an edit of its last message (a new conversation
    # there, with the history sent); X's, that began like Y's, did not.
    ask = "run: echo key=$HERMES_SESSION_KEY"
    z1, users, _ = turn(ask)
    z2, users, _ = turn(ask, z1, ask + " again")
    assert users == [ask, ask + " again"]
    z3, users, _ = turn(ask, z1, ask + " again")
    assert users == [ask, ask + " again"]
    z4, users, _ = turn(ask, z1, ask + " edited")
    assert users == [ask, ask + " edited"]
    keys = [re.search(r"key=([\w.+:=@-]+)", z).group(1) for z in (z1, z2, z3, z4)]
    assert len(set(keys)) == 1 and keys[0].startswith("test+"), (z1, z2, z3, z4)
