"""OpenAI clients nobody here wrote, against the endpoint in front of the
real Hermes agent (the fake model server), each turn with a tool call:
the requests they send and the parsing they do on the answer.

The openai SDK is driven for real. The `llm` CLI, litellm and langchain all
speak through it (`llm`'s `default_plugins/openai_models.py`, litellm's
OpenAI provider, langchain-openai's `ChatOpenAI`), so their requests are
the SDK's; what `llm` then does with each streamed chunk is replayed here
as it does it (it reads `chunk.choices[0]`, catching only IndexError, and
iterates `chunk.choices`), since that parsing is the one that failed on a
frame without `choices`. litellm and langchain skip such frames.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from hermes_sup.httpapi.writers import wants_custom_events

from .test_http_hermes import hermes_http  # noqa: F401  (the fixture)

pytest.importorskip("run_agent", reason="hermes-agent is not installed")


def read_as_llm(chunks: Any) -> tuple[str, str | None, dict[str, Any]]:
    """The text, finish reason and usage `llm` makes of a streamed answer:
    per chunk `choices[0].delta.content` (only an IndexError is expected
    there), then every chunk's `choices` walked to combine them."""
    kept, said, usage = [], [], {}
    for chunk in chunks:
        kept.append(chunk)
        if chunk.usage:
            usage = chunk.usage.model_dump()
        try:
            content = chunk.choices[0].delta.content
        except IndexError:
            content = None
        if content:
            said.append(content)
    finish = None
    for chunk in kept:
        for choice in chunk.choices:
            if choice.finish_reason is not None:
                finish = choice.finish_reason
    return "".join(said), finish, usage


def test_llm_and_the_openai_sdk_read_a_tool_call_turn(hermes_http) -> None:  # noqa: F811
    """Streamed and whole, as a plain client and as one naming its
    conversation (X-Hermes-Session-Id, as a front end serving many people
    under one key should): every streamed frame is a chunk they can read."""
    url, key, _ = hermes_http
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)

    def streamed(text: str, **headers: str) -> tuple[str, str | None, dict[str, Any]]:
        # llm's streamed request: stream_options asks for usage.
        return read_as_llm(
            client.chat.completions.create(
                model="hermes-agent",
                messages=[{"role": "user", "content": text}],
                stream=True,
                stream_options={"include_usage": True},
                extra_headers=headers,
            )
        )

    text, finish, usage = streamed("run: echo plain-stream")
    assert '"output": "plain-stream"' in text and finish == "stop"
    assert usage["total_tokens"] == 0  # the fake model reports none
    # Named: the SDK says `Accept: application/json`, so no frame without
    # `choices` reaches it (before, one did, and `choices[0]` raised TypeError).
    text, finish, _ = streamed("run: echo named-stream", **{"X-Hermes-Session-Id": "llm-1"})
    assert '"output": "named-stream"' in text and finish == "stop"
    # The same conversation goes on in the same shell.
    text, _, _ = streamed("run: echo again", **{"X-Hermes-Session-Id": "llm-1"})
    assert '"output": "again"' in text

    # llm --no-stream: usage dumped, tool_calls read, then the content.
    whole = client.chat.completions.create(
        model="hermes-agent",
        messages=[{"role": "user", "content": "run: echo whole"}],
        extra_headers={"X-Hermes-Session-Id": "llm-2"},
    )
    assert whole.usage is not None and whole.usage.model_dump()["total_tokens"] == 0
    assert whole.choices[0].message.tool_calls is None  # the agent ran the tool itself
    assert '"output": "whole"' in (whole.choices[0].message.content or "")

    # Hermes's own chat client (hermes-webui's chat backend: a named
    # conversation read as events) still gets the tool's progress frames.
    headers = {
        "Authorization": f"Bearer {key}",
        "Accept": "text/event-stream",
        "X-Hermes-Session-Id": "webui-1",
        "X-Hermes-Session-Key": "webui:webui-1",
    }
    body = {
        "model": "hermes-agent",
        "stream": True,
        "messages": [{"role": "user", "content": "run: echo to-webui"}],
    }
    events = []
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=120
    ) as response:
        assert response.status_code == 200
        events = [line[7:] for line in response.iter_lines() if line.startswith("event: ")]
    assert events == ["hermes.tool.progress", "hermes.tool.progress"]


@pytest.mark.parametrize(
    ("headers", "wanted"),
    [
        # The openai SDK (and llm, litellm, langchain on it) naming a conversation.
        ({"X-Hermes-Session-Id": "c1", "Accept": "application/json"}, False),
        # hermes-webui's chat backend.
        ({"X-Hermes-Session-Id": "c1", "Accept": "text/event-stream"}, True),
        ({"X-Hermes-Session-Id": "c1", "Accept": "*/*"}, True),  # curl, httpx
        ({"X-Hermes-Session-Id": "c1", "Accept": "application/json, text/*;q=0.5"}, True),
        ({"X-Hermes-Session-Id": "c1", "Accept": "text/event-stream;q=0"}, False),
        # Asking outright wins over what it accepts.
        ({"X-Hermes-Events": "1", "Accept": "application/json"}, True),
        ({"Accept": "text/event-stream"}, False),  # reads events, names nothing
    ],
)
def test_who_reads_custom_frames_by_what_it_accepts(headers: dict, wanted: bool) -> None:
    assert wants_custom_events(httpx.Headers(headers), {}) is wanted


def test_the_sdk_sends_accept_application_json_when_streaming() -> None:
    """What the rule above rests on, checked against the installed SDK."""
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        done = {"choices": [], "id": "x", "object": "chat.completion.chunk", "created": 0}
        sse = f"data: {json.dumps(done)}\n\ndata: [DONE]\n\n"
        return httpx.Response(200, text=sse, headers={"Content-Type": "text/event-stream"})

    client = openai.OpenAI(
        base_url="http://127.0.0.1:9/v1",
        api_key="k",
        max_retries=0,
        http_client=httpx.Client(transport=httpx.MockTransport(answer)),
    )
    list(client.chat.completions.create(model="m", messages=[], stream=True))
    assert seen[0].headers["Accept"] == "application/json"
