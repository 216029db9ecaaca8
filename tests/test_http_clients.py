"""What the endpoint's clients do with it, done as they do it: the openai
SDK's strict `responses.stream()` helper, hermes-webui's Stop on its chat
backend, a health check asking which Hermes runs, and a person running a
command in a session over HTTP (the probe's `sh`, whose output lines are
the answer). A real supervisor (probe runtime) and endpoint over real HTTP
on 127.0.0.1."""

from __future__ import annotations

import json

import httpx
import pytest

from hermes_sup.client import Reply
from tests import test_http

endpoint = test_http.endpoint
endpoint_factory = test_http.endpoint_factory


def test_a_commands_output_lines_are_the_answer_everywhere(endpoint) -> None:
    """The isolation demo over HTTP (docs/getting-started.md): `sh echo
    $HERMES_SESSION_KEY`."""
    url, named = endpoint.url, {"X-Hermes-Session-Id": "demo"}
    command = "sh echo $HERMES_SESSION_KEY; echo second line"
    expected = f"{endpoint.session('demo')}\nsecond line\nexit 0"
    client = endpoint.openai()
    whole = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": command}], extra_headers=named
    )
    assert whole.choices[0].message.content == expected
    streamed = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": command}],
        extra_headers=named,
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected
    response = client.responses.create(model="m", input=command, conversation="demo-r")
    assert response.output_text == f"{endpoint.session('demo-r')}\nsecond line\nexit 0"
    events = list(client.responses.create(model="m", input=command, conversation="demo-r",
                                          stream=True))  # fmt: skip
    assert events[-1].response.output_text == response.output_text
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == response.output_text

    run = httpx.post(url + "/v1/runs", json={"input": command, "session_id": "demo"},
                     headers=endpoint.headers())  # fmt: skip
    events = test_http.run_events(endpoint, run.json()["run_id"], "run.completed")
    assert events[-1]["output"] == expected
    # Deltas are what streamed (the lines); the reply, not streamed, ends the output.
    deltas = "".join(e["delta"] for e in events if e["event"] == "message.delta")
    assert deltas == expected.removesuffix("exit 0")


def test_the_openai_sdks_responses_stream_helper_follows_the_events(endpoint) -> None:
    """It adds text only to a content part it was told of (IndexError else)."""
    client = endpoint.openai()
    for text, expected in (("stream one two three", "one two three"), ("hello", "hello")):
        with client.responses.stream(model="m", input=text) as stream:
            seen = [event.type for event in stream]
            final = stream.get_final_response()
        assert final.output_text == expected and final.status == "completed"
        assert seen.index("response.content_part.added") < seen.index("response.output_text.delta")
        assert seen.index("response.content_part.done") < seen.index("response.output_item.done")
        text_done = seen.index("response.output_text.done")
        assert text_done < seen.index("response.content_part.done")
    with client.responses.stream(model="m", input="sh echo a line") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        assert stream.get_final_response().output_text == "a line\nexit 0"
    assert "".join(deltas) == "a line\nexit 0"


def test_webuis_stop_on_its_chat_backend_cancels_the_turn_promptly(endpoint) -> None:
    """hermes-webui reads its chat stream line by line and looks at Stop only
    when a line arrives; it then closes the stream, which cancels the turn.
    A silent turn must still send lines often: a keepalive every 30 s left
    the turn running up to 30 s after Stop."""
    headers = endpoint.headers(
        **{"X-Hermes-Session-Id": "w9", "X-Hermes-Session-Key": "webui:w9",
           "Accept": "text/event-stream"}
    )  # fmt: skip
    body = {"model": "default", "stream": True,
            "messages": [{"role": "user", "content": "sleep 120"}]}  # fmt: skip
    first = {"messages": [{"role": "user", "content": "pid"}]}
    chat = endpoint.url + "/v1/chat/completions"
    assert httpx.post(chat, json=first, headers=headers, timeout=30).status_code == 200
    with endpoint.sup.client() as hs:
        watched = hs.watch(endpoint.session("webui:w9"), replay=1)
        next(watched)  # watching from now on: the cancelled reply is seen live
        # A read timeout far below 30 s: a line must come while the turn is silent.
        timeout = httpx.Timeout(30, read=10)
        with httpx.stream("POST", chat, json=body, headers=headers,
                          timeout=timeout) as response:  # fmt: skip
            assert response.status_code == 200
            lines = response.iter_lines()
            assert next(lines).startswith("data: ") and next(lines) == ""  # the role chunk
            # Stop is pressed now, with nothing more to read: webui sees it at
            # the next line, and closes the stream.
            next(lines)
        for event in watched:
            if isinstance(event, Reply):
                assert event.data == {"cancelled": True}
                break


def test_health_says_which_hermes_the_workers_run(endpoint) -> None:
    from hermes_sup.local.version import version

    pytest.importorskip("run_agent", reason="needs hermes-agent (the hermes extra)")
    from importlib.metadata import version as installed

    health = httpx.get(endpoint.url + "/health").json()
    assert health["status"] == "ok" and health["platform"] == "hermes-agent"
    assert health["hermes_agent"] == health["version"] == installed("hermes-agent")
    assert health["hermes_sup"] == version() and health["runtime"] == "probe"
    assert httpx.get(endpoint.url + "/v1/health").json() == health
    assert json.loads(json.dumps(health)) == health


def test_an_answer_carries_a_bounded_part_of_endless_output(endpoint) -> None:
    from hermes_sup.httpapi.said import MAX_OUTPUT

    command = "sh head -c 1500000 /dev/zero | tr '\\0' x | fold -w 99"
    client = endpoint.openai()
    whole = (
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": command}])
        .choices[0]
        .message.content
    )
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": command}], stream=True
        )
        if c.choices
    )
    for text in (whole, streamed):
        assert len(text) <= MAX_OUTPUT + 100 and text.endswith("\nexit 0")
        kept, _, cut = text.removesuffix("\nexit 0").rpartition("\n[")
        assert set(kept.replace("\n", "")) == {"x"}
        assert cut.endswith("more characters of output left out]"), cut
