"""The HTTP endpoint (Hermes's API-server contract) against a real
supervisor with the probe runtime, over real HTTP on 127.0.0.1, driven by
clients nobody here wrote: the openai SDK, and raw HTTP shaped as
hermes-webui and the Hermes gateway send it."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import psutil
import pytest

from hermes_sup.client import AsyncClient, Reply
from hermes_sup.httpapi.keys import KeyStore
from hermes_sup.httpapi.turns import Pump, QueueSink, open_turn
from tests.conftest import wait_gone
from tests.test_clients import free_port
from tests.waiting import load_factor

if TYPE_CHECKING:
    import openai

READY = re.compile(r"http_ready url=(\S+)")


@dataclass
class Endpoint:
    url: str
    key: str
    sup: object  # tests.conftest.Supervisor
    proc: subprocess.Popen[bytes] | None
    log_path: Path
    prefix: str = ""  # the namespace of the key's sessions

    def headers(self, **extra: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}", **extra}

    def session(self, id_: str) -> str:
        """The session key a client's id becomes for this key."""
        return self.prefix + id_

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def openai(self) -> openai.OpenAI:
        import openai  # here: its import is most of this module's collection

        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.key, max_retries=0)


def wait_ready(log_path: Path, proc: subprocess.Popen[bytes] | None, timeout: float = 20) -> str:
    """The endpoint's URL once its log says it listens; `timeout` is stretched by the load."""
    deadline = time.monotonic() + timeout * load_factor()
    while True:
        text = log_path.read_text(errors="replace") if log_path.exists() else ""
        found = READY.search(text)
        if found:
            return found.group(1)
        if (proc is not None and proc.poll() is not None) or time.monotonic() > deadline:
            raise AssertionError(f"the endpoint did not start:\n{text}")
        time.sleep(0.05)


def hs(*args: object, data_dir: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HERMES_SUP_DATA_DIR": str(data_dir)} if data_dir else None
    return subprocess.run(
        [sys.executable, "-m", "hermes_sup.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


@pytest.fixture
def endpoint_factory(supervisor_factory):
    """make(*serve_args): a supervisor (probe runtime) serving the endpoint
    too (`serve --http`), with one key."""

    def make(*serve_args: str) -> Endpoint:
        sup = supervisor_factory(*serve_args, "--http", "127.0.0.1:0", start=False)
        keys = KeyStore(sup.data_dir)
        key = keys.generate("test")
        sup.start()
        url = wait_ready(sup.log_path, None)
        return Endpoint(url, key, sup, None, sup.log_path, keys.tenant("test").prefix)

    return make


@pytest.fixture
def endpoint(endpoint_factory) -> Endpoint:
    return endpoint_factory()


def sse_lines(response: httpx.Response) -> list[str]:
    return [line for line in response.iter_lines() if line]


# ------------------------------------------------------------------ openai SDK


def test_the_openai_sdk_chats_streaming_and_not(endpoint) -> None:
    client = endpoint.openai()
    done = client.chat.completions.create(
        model="hermes-agent",
        messages=[{"role": "user", "content": "stream the quick brown fox"}],
        extra_headers={"X-Hermes-Session-Id": "sdk-1"},
    )
    assert done.object == "chat.completion"
    assert done.choices[0].message.content == "the quick brown fox"
    assert done.choices[0].finish_reason == "stop"
    assert done.usage is not None and done.usage.total_tokens == 0  # the probe counts none

    chunks = list(
        client.chat.completions.create(
            model="hermes-agent",
            messages=[{"role": "user", "content": "stream jumps over the dog"}],
            stream=True,
            extra_headers={"X-Hermes-Session-Key": "webui:sdk-2"},
        )
    )
    pieces = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    # Token by token, in order; a worker may merge two that come close together.
    assert "".join(pieces) == "jumps over the dog" and len(pieces) >= 2, pieces
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].usage is not None

    # A reply that was not streamed arrives whole; models and capabilities answer.
    echo = client.chat.completions.create(
        model="hermes-agent", messages=[{"role": "user", "content": "hello"}], stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in echo if c.choices) == "hello"
    assert [m.id for m in client.models.list()] == ["hermes-agent"]
    caps = httpx.get(endpoint.url + "/v1/capabilities", headers=endpoint.headers()).json()
    assert caps["object"] == "hermes.api_server.capabilities"
    assert caps["platform"] == "hermes-agent" and caps["auth"] == {
        "type": "bearer",
        "required": True,
    }
    # Sessions are sealed by default, and the endpoint says so.
    assert caps["runtime"]["sealed"] in ("root", "user") and caps["runtime"]["warning"] is None
    features = caps["features"]
    assert features["chat_completions"] and features["chat_completions_streaming"]
    assert features["approval_events"] and features["run_approval_response"]
    assert features["responses_api"] and features["responses_streaming"]
    assert caps["endpoints"]["responses"] == {"method": "POST", "path": "/v1/responses"}
    assert features["session_resources"] is False
    health = httpx.get(endpoint.url + "/health").json()
    assert health["status"] == "ok" and health["platform"] == "hermes-agent"


def test_each_conversation_is_its_own_worker(endpoint) -> None:
    client = endpoint.openai()

    def say(text: str, **headers: str) -> str:
        return (
            client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": text}], extra_headers=headers
            )
            .choices[0]
            .message.content
        )

    alice = {"X-Hermes-Session-Id": "alice"}
    bob = {"X-Hermes-Session-Key": "webui:bob", "X-Hermes-Session-Id": "rotating-1"}
    assert say("setenv SECRET alice-only", **alice) == "SECRET=alice-only"
    pids = {say("pid", **alice), say("pid", **bob)}
    assert len(pids) == 2  # two workers
    assert say("env SECRET", **alice) == "alice-only"
    assert say("env SECRET", **bob) == ""  # never another session's export
    assert say("env HERMES_SESSION_KEY", **alice) == endpoint.session("alice")
    assert say("env HERMES_SESSION_KEY", **bob) == endpoint.session("webui:bob")  # the key header
    assert say("pid", **alice) in pids and say("pid", **bob) in pids

    # The front end's system prompt, earlier messages and conversation id go
    # with the turn, for the runtime to use if it keeps no history itself.
    context = client.chat.completions.create(
        model="m",
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "context"},
        ],
        extra_headers=alice,
    )
    assert json.loads(context.choices[0].message.content) == {
        "conversation": "alice",
        "instructions": "be brief",
        "history": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
    }

    # A client that resends the whole history and names no session gets a
    # session of its own, which its next turn finds again: one worker per chat.
    history = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "pid"}]
    first = client.chat.completions.create(model="m", messages=history)
    pid = first.choices[0].message.content
    history += [{"role": "assistant", "content": pid}, {"role": "user", "content": "pid"}]
    assert (
        client.chat.completions.create(model="m", messages=history).choices[0].message.content
        == pid
    )

    # An id that breaks the key rules still gets its own session, named readably.
    odd = "chat 42/#1"
    named = say("env HERMES_SESSION_KEY", **{"X-Hermes-Session-Id": odd})
    assert named.startswith(endpoint.session("chat_42_"))
    with endpoint.sup.client() as client:
        rows = {row["key"]: row for row in client.sessions()}
    alice_key = endpoint.session("alice")
    assert {alice_key, endpoint.session("webui:bob")} <= set(rows)
    assert any(k.startswith(endpoint.session("api-")) for k in rows)
    mapped = next(k for k in rows if k.startswith(endpoint.session("chat_42__1=")))
    assert 'id="chat 42/#1"' in endpoint.log()  # the exact id, for the operator
    # ... and as the session's label, in `list` and `inspect`; an id that is
    # its own key needs none.
    assert rows[mapped]["label"] == odd and rows[alice_key]["label"] is None
    state = ["--state-dir", endpoint.sup.state_dir]
    listed = hs(*state, "list", "--no-trunc")
    assert listed.returncode == 0 and odd in listed.stdout, listed.stderr
    assert odd in hs(*state, "inspect", mapped).stdout


# ------------------------------------------------------------------ responses API


def test_the_responses_api_chains_to_one_session(endpoint) -> None:
    client = endpoint.openai()
    first = client.responses.create(model="m", input="pid", instructions="be brief")
    assert first.object == "response" and first.status == "completed"
    assert first.id.startswith("resp_") and first.output_text.isdigit()
    assert first.usage is not None and first.usage.total_tokens == 0
    # previous_response_id reaches the same worker, with the instructions carried on.
    second = client.responses.create(model="m", input="pid", previous_response_id=first.id)
    assert second.output_text == first.output_text
    told = client.responses.create(model="m", input="context", previous_response_id=second.id)
    assert json.loads(told.output_text) == {"conversation": first.id, "instructions": "be brief"}
    # A conversation by name is one session; it is not another conversation's.
    named = client.responses.create(model="m", input="setenv WHO named", conversation="conv-1")
    assert named.output_text == "WHO=named"
    again = client.responses.create(model="m", input="env WHO", conversation="conv-1")
    assert again.output_text == "named"
    assert client.responses.create(model="m", input="env WHO").output_text == ""
    assert client.responses.create(model="m", input="pid").output_text != first.output_text
    # An input array: its earlier messages are the turn's history.
    history = client.responses.create(
        model="m",
        input=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": [{"type": "input_text", "text": "context"}]},
        ],
    )
    assert json.loads(history.output_text)["history"] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]

    # Streaming, as Hermes streams it: created, the message item, its text
    # deltas in order, done, completed; every event numbered.
    events = list(
        client.responses.create(
            model="m", input="stream one two three", previous_response_id=first.id, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert deltas == ["one", " two", " three"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds.index("response.output_item.added") < kinds.index("response.output_text.delta")
    assert "response.output_text.done" in kinds and "response.output_item.done" in kinds
    streamed = events[-1].response
    assert streamed.output_text == "one two three" and streamed.status == "completed"

    # Stored: GET returns it, DELETE forgets it; store=false keeps nothing.
    url, auth = endpoint.url, endpoint.headers()
    got = httpx.get(f"{url}/v1/responses/{streamed.id}", headers=auth)
    assert got.status_code == 200 and got.json()["output"][-1]["content"][0]["text"] == (
        "one two three"
    )
    gone = httpx.delete(f"{url}/v1/responses/{streamed.id}", headers=auth)
    assert gone.json() == {"id": streamed.id, "object": "response", "deleted": True}
    assert httpx.get(f"{url}/v1/responses/{streamed.id}", headers=auth).status_code == 404
    unstored = client.responses.create(model="m", input="pid", store=False)
    assert httpx.get(f"{url}/v1/responses/{unstored.id}", headers=auth).status_code == 404

    # No answer channel: an approval is denied at once, as on chat completions.
    asked = client.responses.create(model="m", input="ask touch never.txt")
    assert asked.output_text == "denied: touch never.txt"

    # The session headers name the session when nothing else does.
    keyed = httpx.post(
        url + "/v1/responses",
        json={"input": "env HERMES_SESSION_KEY"},
        headers=endpoint.headers(**{"X-Hermes-Session-Key": "webui:r1"}),
    )
    assert keyed.json()["output"][-1]["content"][0]["text"] == endpoint.session("webui:r1")
    assert keyed.headers["X-Hermes-Session-Key"] == "webui:r1"

    def error(body: dict, status: int, code: str) -> None:
        response = httpx.post(url + "/v1/responses", json=body, headers=auth)
        assert response.status_code == status, response.text
        assert response.json()["error"]["code"] == code

    error({}, 400, "missing_input")
    error({"input": 5}, 400, "invalid_input")
    error({"input": "x", "conversation": "c", "previous_response_id": first.id}, 400,
          "conflicting_conversation")  # fmt: skip
    error({"input": "x", "previous_response_id": "resp_nope"}, 404, "response_not_found")


# ------------------------------------------------------------------ errors


def test_errors_are_openai_shaped_with_the_right_status(endpoint) -> None:
    url = endpoint.url
    chat = url + "/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "pid"}]}

    def error(response: httpx.Response, status: int, code: str) -> None:
        assert response.status_code == status, response.text
        err = response.json()["error"]
        assert err["code"] == code and err["message"] and err["type"]

    error(httpx.post(chat, json=body), 401, "invalid_api_key")
    error(
        httpx.post(chat, json=body, headers={"Authorization": "Bearer nope"}),
        401,
        "invalid_api_key",
    )
    error(httpx.get(url + "/v1/models"), 401, "invalid_api_key")
    auth = endpoint.headers(**{"Content-Type": "application/json"})
    error(httpx.post(chat, content=b"{not json", headers=auth), 400, "invalid_json")
    error(httpx.post(chat, json={"messages": []}, headers=auth), 400, "invalid_messages")
    no_user = {"messages": [{"role": "system", "content": "hi"}]}
    error(httpx.post(chat, json=no_user, headers=auth), 400, "no_user_message")
    bad_id = {**auth, "X-Hermes-Session-Id": "x" * 300}
    error(httpx.post(chat, json=body, headers=bad_id), 400, "invalid_session_id")
    error(httpx.get(url + "/v1/runs/run_nope", headers=auth), 404, "run_not_found")
    error(httpx.post(url + "/v1/runs/run_nope/stop", headers=auth), 404, "run_not_found")

    # Too large: by its declared length (nothing read), and chunked without one.
    address = httpx.URL(url)
    with socket.create_connection((address.host, address.port)) as raw:
        raw.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            + f"Authorization: Bearer {endpoint.key}\r\n".encode()
            + b"Content-Type: application/json\r\nContent-Length: 20000000\r\n\r\n"
        )
        raw.settimeout(10)
        answer = b""
        while b"}}" not in answer:  # the head and the JSON body may come apart
            piece = raw.recv(65536)
            if not piece:
                break
            answer += piece
    assert answer.startswith(b"HTTP/1.1 413") and b"body_too_large" in answer

    def big() -> object:
        for _ in range(10):
            yield b" " * 1_000_000
        yield b" "  # one byte over: the endpoint reads it all, then refuses

    error(httpx.post(chat, content=big(), headers=auth), 413, "body_too_large")
    # The supervisor keeps serving everyone after all that.
    assert httpx.post(chat, json=body, headers=auth).status_code == 200


def test_overloaded_is_503_with_retry_after(endpoint_factory) -> None:
    endpoint = endpoint_factory("--max-sessions", "1")
    chat = endpoint.url + "/v1/chat/completions"
    busy = {"messages": [{"role": "user", "content": "sleep 30"}], "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", chat, json=busy, headers=endpoint.headers()) as held:
            assert held.status_code == 200
            lines = held.iter_lines()  # kept: a dropped iterator closes the stream
            next(lines)  # the role chunk: the only slot is busy now
            other = http.post(
                chat,
                json={"messages": [{"role": "user", "content": "pid"}]},
                headers=endpoint.headers(**{"X-Hermes-Session-Id": "other"}),
            )
            assert other.status_code == 503 and other.headers["Retry-After"], endpoint.log()
            assert other.json()["error"]["code"] == "overloaded"


# ------------------------------------------------------------------ streams


def test_a_client_that_hangs_up_on_a_whole_answer_cancels_its_turn(endpoint) -> None:
    """Not streaming, the turn is read in the request's own task; a hang-up
    still cancels it at once."""
    chat = endpoint.url + "/v1/chat/completions"
    headers = endpoint.headers(**{"X-Hermes-Session-Id": "quitter"})
    with httpx.Client(timeout=30) as http, endpoint.sup.client() as hs:
        first = {"messages": [{"role": "user", "content": "pid"}]}
        assert http.post(chat, json=first, headers=headers).status_code == 200
        watched = hs.watch(endpoint.session("quitter"), replay=1)
        next(watched)  # watching from now on: the cancelled reply is seen live
        long = {"messages": [{"role": "user", "content": "sleep 60"}]}
        with pytest.raises(httpx.ReadTimeout):  # and httpx closes the connection
            http.post(chat, json=long, headers=headers, timeout=httpx.Timeout(30, read=2))
        for event in watched:
            if isinstance(event, Reply):
                assert event.data == {"cancelled": True}
                break
        again = http.post(chat, json=first, headers=headers)
    assert again.status_code == 200
    assert "http_turn_cancelled" in endpoint.log()


def test_a_client_that_disconnects_mid_stream_cancels_its_turn(endpoint) -> None:
    chat = endpoint.url + "/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "sleep 60"}], "stream": True}
    headers = endpoint.headers(**{"X-Hermes-Session-Id": "leaver"})
    with httpx.Client(timeout=30) as http, endpoint.sup.client() as hs:
        first = {"messages": [{"role": "user", "content": "pid"}]}
        assert http.post(chat, json=first, headers=headers).status_code == 200
        watched = hs.watch(endpoint.session("leaver"), replay=1)
        next(watched)  # watching from now on: the cancelled reply is seen live
        with http.stream("POST", chat, json=body, headers=headers) as response:
            next(response.iter_lines())
        # Hung up. The turn ends cancelled, not after its 60 s.
        for event in watched:
            if isinstance(event, Reply):
                assert event.data == {"cancelled": True}
                break
        # The session takes the next turn at once.
        again = http.post(
            chat, json={"messages": [{"role": "user", "content": "pid"}]}, headers=headers
        )
    assert again.status_code == 200
    assert "http_turn_cancelled" in endpoint.log()

    # The same on the Responses API; the response is kept as incomplete.
    responses = endpoint.url + "/v1/responses"
    body = {"input": "sleep 60", "conversation": "leaver-2", "stream": True}
    with httpx.Client(timeout=30) as http, endpoint.sup.client() as hs:
        first = {"input": "pid", "conversation": "leaver-2"}
        assert http.post(responses, json=first, headers=endpoint.headers()).status_code == 200
        watched = hs.watch(endpoint.session("leaver-2"), replay=1)
        next(watched)  # watching from now on: the cancelled reply is seen live
        with http.stream("POST", responses, json=body, headers=endpoint.headers()) as response:
            lines = response.iter_lines()
            created = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
        for event in watched:
            if isinstance(event, Reply):
                assert event.data == {"cancelled": True}
                break
        kept = http.get(f"{responses}/{created['response']['id']}", headers=endpoint.headers())
    assert kept.json()["status"] == "incomplete"


def test_a_stalled_reader_cancels_its_turn_and_stalls_nobody_else(supervisor) -> None:
    """The pump of a stream nobody reads gives up after its stall timeout and
    cancels the turn, while another session's turn on the same client runs."""

    async def main() -> tuple[object, str, bool]:
        async with AsyncClient(supervisor.state_dir) as client:
            tasks: set[asyncio.Task[object]] = set()
            opened = await open_turn(client, "stuck", "stream " + "w " * 200)
            sink = QueueSink(maxsize=2, stall_timeout=0.5, what="test")
            pump = Pump(opened, sink, tasks)  # nobody reads sink.queue
            other = await client.run("other", "stream a b c")
            await pump.wait()
            async for event in client.watch("stuck", replay=400):
                if isinstance(event, Reply):
                    return event.data, other.text, sink.stalled
        raise AssertionError("unreachable")

    data, other, stalled = asyncio.run(main())
    assert stalled and data == {"cancelled": True} and other == "a b c"


def test_approvals_on_chat_completions_are_denied_as_webui_sends_it(endpoint) -> None:
    """Chat completions cannot answer an approval: the command is denied at
    once (Hermes does not run it either), and the reply says so. The request
    is shaped as hermes-webui's chat-completions path sends it."""
    headers = endpoint.headers(
        **{
            "Accept": "text/event-stream",
            "X-Hermes-Session-Id": "w7",
            "X-Hermes-Session-Key": "webui:w7",
        }
    )
    body = {
        "model": "default",
        "stream": True,
        "messages": [
            {"role": "system", "content": "You are in the WebUI."},
            {"role": "user", "content": "ask touch should-not-exist"},
        ],
        "provider": "custom",
        "reasoning_effort": "low",
    }
    content = []
    with httpx.stream(
        "POST", endpoint.url + "/v1/chat/completions", json=body, headers=headers, timeout=30
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["X-Hermes-Session-Id"] == "w7"
        assert response.headers["X-Hermes-Session-Key"] == "webui:w7"
        for line in sse_lines(response):
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                content.append(chunk["choices"][0]["delta"].get("content") or "")
    assert "".join(content) == "denied: touch should-not-exist"
    with endpoint.sup.client() as hs:
        listed = [
            e.line
            for e in hs.run(endpoint.session("webui:w7"), "sh ls").events
            if hasattr(e, "line")
        ]
    assert "should-not-exist" not in listed
    assert "http_approval_denied" in endpoint.log()


# ------------------------------------------------------------------ runs API


def run_events(endpoint: Endpoint, run_id: str, until: str) -> list[dict]:
    """Follow a run's SSE events until one named `until` (or the stream ends)."""
    seen = []
    with httpx.stream(
        "GET", f"{endpoint.url}/v1/runs/{run_id}/events", headers=endpoint.headers(), timeout=30
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                seen.append(json.loads(line[6:]))
                if seen[-1]["event"] == until:
                    break
    return seen


def test_runs_with_approvals_and_stop(endpoint) -> None:
    url, auth = endpoint.url, endpoint.headers()
    # hermes-webui's shape: headers, input, session_id, instructions, history.
    webui = endpoint.headers(**{"X-Hermes-Session-Id": "w1", "X-Hermes-Session-Key": "webui:w1"})

    def start(text: str) -> str:
        response = httpx.post(
            url + "/v1/runs",
            json={
                "model": "default",
                "input": text,
                "session_id": "w1",
                "instructions": "be careful",
                "conversation_history": [{"role": "user", "content": "earlier"}],
            },
            headers=webui,
        )
        assert response.status_code == 202, response.text
        assert response.json()["status"] == "started"
        return response.json()["run_id"]

    # Denied: the target survives.
    denied = start("ask touch denied.txt")
    events = run_events(endpoint, denied, "approval.request")
    request = events[-1]
    assert request["command"] == "touch denied.txt" and "deny" in request["choices"]
    assert request["approval_id"]
    status = httpx.get(f"{url}/v1/runs/{denied}", headers=auth).json()
    assert status["object"] == "hermes.run" and status["status"] == "waiting_for_approval"
    bad = httpx.post(f"{url}/v1/runs/{denied}/approval", json={"choice": "maybe"}, headers=auth)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_approval_choice"
    answer = httpx.post(f"{url}/v1/runs/{denied}/approval", json={"choice": "deny"}, headers=auth)
    assert answer.json() == {
        "object": "hermes.run.approval_response",
        "run_id": denied,
        "choice": "deny",
        "resolved": 1,
    }
    events = run_events(endpoint, denied, "run.completed")
    names = [e["event"] for e in events]
    assert names == ["approval.request", "approval.responded", "run.completed"]
    assert events[-1]["output"] == "denied: touch denied.txt"
    again = httpx.post(f"{url}/v1/runs/{denied}/approval", json={"choice": "once"}, headers=auth)
    assert again.status_code == 409

    # Approved ("approve" is Hermes's alias for once): the command runs.
    allowed = start("ask touch allowed.txt")
    run_events(endpoint, allowed, "approval.request")
    httpx.post(f"{url}/v1/runs/{allowed}/approval", json={"choice": "approve"}, headers=auth)
    assert run_events(endpoint, allowed, "run.completed")[-1]["output"] == "exit 0"
    with endpoint.sup.client() as hs:
        shown = [
            e.line
            for e in hs.run(endpoint.session("webui:w1"), "sh ls").events
            if hasattr(e, "line")
        ]
    assert "allowed.txt" in shown and "denied.txt" not in shown

    # Stopped: the run ends cancelled, long before its sleep would.
    slow = start("sleep 60")
    stop = httpx.post(f"{url}/v1/runs/{slow}/stop", headers=auth)
    assert stop.json() == {"run_id": slow, "status": "stopping"}
    assert run_events(endpoint, slow, "run.cancelled")[-1]["event"] == "run.cancelled"
    assert httpx.get(f"{url}/v1/runs/{slow}", headers=auth).json()["status"] == "cancelled"
    # And a stop waiting on an approval denies it: nothing is run.
    pending = start("ask touch never.txt")
    run_events(endpoint, pending, "approval.request")
    httpx.post(f"{url}/v1/runs/{pending}/stop", headers=auth)
    assert run_events(endpoint, pending, "run.cancelled")[-1]["event"] == "run.cancelled"

    # webui's instructions, history and session id reach the runtime.
    told = run_events(endpoint, start("context"), "run.completed")[-1]["output"]
    assert json.loads(told) == {
        "conversation": "w1",
        "instructions": "be careful",
        "history": [{"role": "user", "content": "earlier"}],
    }

    # Text streams as message.delta; a subscriber that comes after the end
    # still gets it all, kept as one delta.
    streamed = start("stream one two three")
    live = run_events(endpoint, streamed, "run.completed")
    assert "".join(e["delta"] for e in live if e["event"] == "message.delta") == "one two three"
    late = run_events(endpoint, streamed, "run.completed")
    assert [(e["event"], e.get("delta")) for e in late] == [
        ("message.delta", "one two three"),
        ("run.completed", None),
    ]


# ------------------------------------------------------------------ Hermes's gateway

GATEWAY_SCRIPT = """
import asyncio, json, sys
from gateway.config import GatewayConfig, Platform
from gateway.run import GatewayRunner
from gateway.session import SessionSource

async def main():
    runner = GatewayRunner(GatewayConfig())

    async def chat(chat_id, texts):
        source = SessionSource(platform=Platform.TELEGRAM, chat_id=chat_id, user_id="u" + chat_id)
        replies = []
        for text in texts:
            result = await runner._run_agent(
                message=text, context_prompt="You are on Telegram.", history=[], source=source,
                session_id="tg-" + chat_id, session_key="agent:main:telegram:dm:" + chat_id,
            )
            replies.append(result["final_response"])
        return replies

    chats = json.loads(sys.argv[1])
    replies = await asyncio.gather(*(chat(c, texts) for c, texts in chats.items()))
    print(json.dumps(dict(zip(chats, replies))))

asyncio.run(main())
"""


def test_hermes_gateway_proxy_mode_runs_each_chat_in_its_own_worker(endpoint, workdir) -> None:
    """Hermes's own gateway code (GATEWAY_PROXY_URL) pointed at the endpoint:
    two chats at once, each reply to its own chat, each in its own worker."""
    if not os.environ.get("HSUP_REQUIRE_ALL"):
        pytest.importorskip("aiohttp", reason="Hermes's proxy mode needs aiohttp")
    pytest.importorskip("gateway.run", reason="needs hermes-agent (the hermes extra)")
    home = workdir / "gateway-home"
    home.mkdir()
    env = {
        **os.environ,
        "HERMES_HOME": str(home),
        "GATEWAY_PROXY_URL": endpoint.url,
        "GATEWAY_PROXY_KEY": endpoint.key,
    }
    chats = {
        "1": ["setenv TOKEN one", "env TOKEN", "env HERMES_SESSION_KEY", "stream streamed to one"],
        "2": ["env TOKEN", "env HERMES_SESSION_KEY", "stream streamed to two", "pid"],
    }
    done = subprocess.run(
        [sys.executable, "-c", GATEWAY_SCRIPT, json.dumps(chats)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    replies = json.loads(done.stdout.strip().splitlines()[-1])
    assert replies["1"] == ["TOKEN=one", "one", endpoint.session("tg-1"), "streamed to one"]
    # Chat 2 never sees chat 1's export (Hermes shows an empty reply so).
    assert replies["2"][:3] == [
        "(No response from remote agent)",
        endpoint.session("tg-2"),
        "streamed to two",
    ]
    with endpoint.sup.client() as hs:
        assert hs.run(endpoint.session("tg-1"), "pid").text != replies["2"][3]


def test_an_unsealed_supervisor_is_named_so_to_http_clients(endpoint_factory) -> None:
    """A client that decides what to let sessions do learns that they are
    no boundary here, from /v1/capabilities and /health."""
    endpoint = endpoint_factory("--sealed", "off")
    caps = httpx.get(endpoint.url + "/v1/capabilities", headers=endpoint.headers()).json()
    assert caps["runtime"]["sealed"] is None
    assert "sessions run unsealed" in caps["runtime"]["warning"]
    health = httpx.get(endpoint.url + "/health").json()
    assert health["sealed"] is None and "sessions run unsealed" in health["warning"]


# ------------------------------------------------------------------ running it


def test_serve_http_needs_a_key_and_ends_with_its_supervisor(supervisor_factory, workdir) -> None:
    sup = supervisor_factory("--http", "127.0.0.1:0", start=False)
    serve = ["--state-dir", sup.state_dir, "serve", "--data-dir", sup.data_dir]
    refused = hs(*serve, "--http", "127.0.0.1:0")
    assert refused.returncode == 1 and "keys http generate" in refused.stderr  # no key, no service
    star = hs(*serve, "--http", "*:8642")
    assert star.returncode == 2 and "0.0.0.0" in star.stderr
    made = hs("keys", "http", "generate", "ops", data_dir=sup.data_dir)
    assert made.returncode == 0 and made.stdout.startswith("hsk-")
    key = made.stdout.strip()
    listed = hs("keys", "http", "list", data_dir=sup.data_dir).stdout
    assert listed.startswith("ops  sessions ops+") and "reaches its own sessions" in listed
    sup.start()
    url = wait_ready(sup.log_path, None)
    pid = int(re.search(r"http_ready .* pid=(\d+)", sup.log()).group(1))
    assert psutil.Process(pid).ppid() != sup.pid  # not the supervisor's child: never culled
    chat = url + "/v1/chat/completions"
    auth = {"Authorization": f"Bearer {key}"}
    turn = {"messages": [{"role": "user", "content": "pid"}]}
    assert httpx.post(chat, json=turn, headers=auth).status_code == 200
    prefix = KeyStore(sup.data_dir).tenant("ops").prefix
    with sup.client() as client:
        made = httpx.post(chat, json=turn, headers=auth).headers["X-Hermes-Session-Id"]
        client.kill(prefix + made)
    # A worker's exit makes the supervisor cull children it does not know: not this one.
    assert httpx.post(chat, json=turn, headers=auth).status_code == 200
    # Revoked: refused at the next request, no restart.
    assert hs("keys", "http", "revoke", "ops", data_dir=sup.data_dir).returncode == 0
    assert httpx.post(chat, json=turn, headers=auth).status_code == 401
    os.kill(sup.pid, signal.SIGKILL)
    sup.proc.wait()
    assert wait_gone(str(workdir), timeout=10.0) == []  # the endpoint went with it


def test_a_dead_endpoint_is_restarted_on_its_port_and_goes_with_its_supervisor(
    endpoint, workdir
) -> None:
    chat = endpoint.url + "/v1/chat/completions"
    turn = {"messages": [{"role": "user", "content": "pid"}]}
    auth = endpoint.headers()
    ready = re.compile(r"http_ready url=(\S+) pid=(\d+)")

    def endpoints() -> list[tuple[str, int]]:
        return [(url, int(pid)) for url, pid in ready.findall(endpoint.log())]

    def wait_for(count: int) -> tuple[str, int]:
        deadline = time.monotonic() + 60
        while len(endpoints()) < count:
            assert time.monotonic() < deadline, endpoint.log()
            time.sleep(0.05)
        return endpoints()[count - 1]

    url, first = wait_for(1)
    keeper = psutil.Process(first).ppid()
    assert keeper != endpoint.sup.pid and psutil.Process(keeper).ppid() != endpoint.sup.pid
    assert httpx.post(chat, json=turn, headers=auth).status_code == 200
    for n in (2, 3):  # twice: the second restart waits longer (back-off)
        os.kill(endpoints()[-1][1], signal.SIGKILL)
        again, pid = wait_for(n)
        assert again == url and pid != first  # the same port, a new process
        assert psutil.Process(pid).ppid() == keeper
        assert httpx.post(chat, json=turn, headers=auth, timeout=30).status_code == 200
    restarts = re.findall(r"http_endpoint_exited .*restart_in=(\S+)", endpoint.log())
    assert [float(r) for r in restarts] == [0.5, 1.0]
    # The supervisor dies: the keeper and its endpoint go with it.
    os.kill(endpoint.sup.pid, signal.SIGKILL)
    endpoint.sup.proc.wait()
    assert wait_gone(str(workdir), timeout=20.0) == []
    assert not psutil.pid_exists(keeper) or psutil.Process(keeper).status() == "zombie"


def test_the_endpoint_on_its_own_against_a_remote_supervisor(supervisor_factory, workdir) -> None:
    port = free_port()
    sup = supervisor_factory("--tcp", str(port))
    conn = workdir / "front.json"
    made = hs("keys", "generate", "front", "--endpoint", f"127.0.0.1:{port}", "-o", conn,
              data_dir=sup.data_dir)  # fmt: skip
    assert made.returncode == 0, made.stderr
    front = workdir / "front"  # the front end's host keeps its own HTTP keys
    key = KeyStore(front).generate("web")
    log_path = workdir / "front.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hermes_sup.cli", "http", "--connection", str(conn),
             "--listen", "127.0.0.1:0", "--data-dir", str(front)],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        url = wait_ready(log_path, proc)
        import openai

        client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
        reply = client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "env HERMES_SESSION_KEY"}],
            extra_headers={"X-Hermes-Session-Id": "far"},
        )
        assert reply.choices[0].message.content == KeyStore(front).tenant("web").prefix + "far"
        assert httpx.get(url + "/health").json()["status"] == "ok"
    finally:
        proc.terminate()
        assert proc.wait(15) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled


def test_the_endpoints_connections_send_without_delay() -> None:
    """Accepted connections get TCP_NODELAY (asyncio sets it only when the
    listening socket says it is TCP): without it, Nagle's algorithm and
    delayed ACKs held every response of `hermes-sup http` back 40 ms."""
    from hermes_sup.httpapi.serve import bind

    async def main() -> int:
        sock = bind("127.0.0.1", 0)
        accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            raw = writer.get_extra_info("socket")
            accepted.set_result(raw.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connection, sock=sock)  # as uvicorn does
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        try:
            return await asyncio.wait_for(accepted, 10)
        finally:
            writer.close()
            server.close()

    assert asyncio.run(main()) != 0


def test_the_endpoint_is_a_client_and_loads_nothing_of_the_server_side() -> None:
    """Like any front end, it uses the client library (and hermes_sup.local,
    as the client does); nothing of the supervisor's package."""
    from tests.test_layout import SERVER_SIDE, modules_loaded_by, package

    loaded = modules_loaded_by("hermes_sup.httpapi", "hermes_sup.httpapi.serve")
    assert "hermes_sup.httpapi.serve" in loaded and "uvicorn" not in loaded  # imported when run
    server_side = [m for m in loaded if package(m) in SERVER_SIDE]
    assert server_side == []


def test_serve_http_web_serves_the_page_beside_the_api(endpoint_factory) -> None:
    page = Path(__file__).resolve().parent.parent / "examples" / "web"
    endpoint = endpoint_factory("--http-web", str(page))
    index = httpx.get(endpoint.url + "/", timeout=30)
    assert index.status_code == 200 and "<html" in index.text.lower()
    assert (page / "index.html").read_text() == index.text
    # The page needs no key; the API still does.
    assert httpx.get(endpoint.url + "/v1/models", timeout=30).status_code == 401
