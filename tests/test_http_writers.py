"""The HTTP endpoint's writers, fed a turn's events by hand: no sockets, no
supervisor. Each API (chat completions, Responses, runs) turns the same
events into its own wire events, and states a gap the same way: where it
happened, and with the whole text at the end (said.py)."""

from __future__ import annotations

from typing import Any

import pytest

from hermes_sup.client import (
    ApprovalRequest,
    Dropped,
    Event,
    Output,
    Reply,
    SupervisorError,
    Token,
    ToolComplete,
    ToolStart,
)
from hermes_sup.httpapi.said import END, GAP_EVENT, MAX_OUTPUT, Said
from hermes_sup.httpapi.writers import ChatChunks, ResponsesEvents, RunEvents, SseEvent

Item = Any  # an Event, a ClientError or END


def token(text: str) -> Token:
    return Token("token", text=text)


def output(line: str) -> Output:
    return Output("output", line=line)


def dropped(count: int) -> Dropped:
    return Dropped("dropped", count=count, reason="slow_consumer")


def reply(text: str, ok: bool = True, data: Any = None) -> Reply:
    return Reply("reply", data, text=text, ok=ok)


def tool_start(call: str, name: str = "terminal") -> ToolStart:
    return ToolStart("tool_start", {"emoji": "💻", "label": "ls"}, id=call, name=name, args={})


def tool_complete(call: str, name: str = "terminal") -> ToolComplete:
    return ToolComplete("tool_complete", {"duration": 1}, id=call, name=name, result="ok")


HELLO = [token("Hello "), dropped(2), token("!"), reply("Hello world!")]


def chat(items: list[Item], resumed: bool = False) -> list[SseEvent]:
    writer = ChatChunks(Said(resumed), "chatcmpl-1", 7, "m")
    out = writer.start()
    for item in items:
        out += writer(item)
    return out


def responses(items: list[Item]) -> tuple[list[dict[str, Any]], ResponsesEvents]:
    base = {"id": "resp_1", "object": "response", "created_at": 7, "model": "m", "output": []}
    writer = ResponsesEvents(Said(), base, "msg_1")
    out = writer.start()
    for item in items:
        out += writer(item)
    for event in out:
        assert event.event == event.data["type"]  # the SSE name is the event's type
    return [event.data for event in out], writer


def runs(items: list[Item]) -> list[dict[str, Any]]:
    writer = RunEvents()
    return [event for item in items for event in writer(item)]


def chat_text(events: list[SseEvent]) -> str:
    chunks = [e.data for e in events if e.event is None and isinstance(e.data, dict)]
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)


def last_chunk(events: list[SseEvent]) -> dict[str, Any]:
    assert events[-1] == SseEvent("[DONE]")
    assert events[-1].encode() == b"data: [DONE]\n\n"
    last = events[-2].data
    assert isinstance(last, dict) and last["choices"][0]["finish_reason"] is not None
    return last


# ------------------------------------------------------------ a gap


def test_chat_states_the_gap_where_it_was_and_ends_with_the_whole_text() -> None:
    events = chat(HELLO)
    gaps = [e for e in events if e.event == GAP_EVENT]
    assert [g.data["count"] for g in gaps] == [2]
    assert events.index(gaps[0]) == 2  # after the role chunk and "Hello "
    last = last_chunk(events)
    # The turn completed: a gap is not an error; the last chunk has it all.
    assert last["choices"][0]["finish_reason"] == "stop" and "error" not in last
    assert last["hermes"] == {
        "completed": True,
        "partial": True,
        "failed": False,
        "dropped": 2,
        "text": "Hello world!",
    }
    assert chat_text(events) == "Hello !"  # the deltas themselves have the gap


def test_responses_states_the_gap_and_its_done_events_carry_the_whole_text() -> None:
    events, writer = responses(HELLO)
    kinds = [e["type"] for e in events]
    assert kinds.count(GAP_EVENT) == 1
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert done["text"] == "Hello world!"
    completed = events[-1]
    assert completed["type"] == "response.completed"
    assert completed["response"]["status"] == "completed"
    assert completed["response"]["hermes"] == {"dropped": 2}
    assert completed["response"]["output"][-1]["content"][0]["text"] == "Hello world!"
    assert writer.final == completed["response"]


def test_runs_mark_the_gap_and_complete_with_the_whole_text() -> None:
    events = runs(HELLO)
    assert [e["event"] for e in events] == [
        "message.delta",
        "events.dropped",
        "message.delta",
        "run.completed",
    ]
    assert events[1]["count"] == 2 and events[1]["reason"] == "slow_consumer"
    assert events[-1]["output"] == "Hello world!" and events[-1]["dropped"] == 2


def test_a_stream_without_a_gap_says_nothing_of_one() -> None:
    items = [token("Hello "), token("world!"), reply("Hello world!")]
    events = chat(items)
    assert not [e for e in events if e.event == GAP_EVENT]
    assert "hermes" not in last_chunk(events)
    assert chat_text(events) == "Hello world!"
    answered, writer = responses(items)
    assert GAP_EVENT not in [e["type"] for e in answered]
    assert "hermes" not in answered[-1]["response"]
    assert "dropped" not in runs(items)[-1]


def test_chat_bytes_without_a_gap_are_as_they_were() -> None:
    items = [token("Hi"), reply("Hi there", data={"usage": {"input_tokens": 3}})]
    body = b"".join(e.encode() for e in chat(items))
    head = '{"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m", '
    assert (
        body
        == (
            f'data: {head}"choices": [{{"index": 0, "delta": {{"role": "assistant"}}, '
            '"finish_reason": null}]}\n\n'
            f'data: {head}"choices": [{{"index": 0, "delta": {{"content": "Hi"}}, '
            '"finish_reason": null}]}\n\n'
            f'data: {head}"choices": [{{"index": 0, "delta": {{"content": " there"}}, '
            '"finish_reason": null}]}\n\n'
            f'data: {head}"choices": [{{"index": 0, "delta": {{}}, "finish_reason": "stop"}}], '
            '"usage": {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}}\n\n'
            "data: [DONE]\n\n"
        ).encode()
    )


def test_a_note_is_left_only_for_an_answer_the_client_holds_whole() -> None:
    whole = ChatChunks(Said(), "c", 1, "m")
    for item in [token("Hi"), reply("Hi")]:
        whole(item)
    assert whole.noted == "Hi"
    gapped = ChatChunks(Said(), "c", 1, "m")
    for item in HELLO:
        gapped(item)
    assert gapped.noted is None


# ------------------------------------------------------------ output lines


def test_output_past_the_cap_is_cut_with_one_line_saying_how_much() -> None:
    line = "x" * 999  # 1000 characters with its newline
    lines = MAX_OUTPUT // 1000 + 5
    items: list[Item] = [output(line) for _ in range(lines)] + [reply("done")]
    kept = (MAX_OUTPUT // 1000) * 1000
    note = f"[{lines * 1000 - kept} more characters of output left out]\n"
    whole = f"{line}\n" * (MAX_OUTPUT // 1000) + note + "done"

    events = chat(items)
    assert chat_text(events) == whole
    assert "hermes" not in last_chunk(events)
    answered, _ = responses(items)
    assert answered[-1]["response"]["output"][-1]["content"][0]["text"] == whole
    assert runs(items)[-1]["output"] == whole


def test_a_retry_that_joined_late_streams_only_the_reply() -> None:
    events = chat([output("ls"), token("Hel"), reply("Hello")], resumed=True)
    assert chat_text(events) == "Hello"


# ------------------------------------------------------------ tools


def test_a_tool_call_in_each_api() -> None:
    items = [tool_start("c1"), tool_complete("c1"), tool_start("c2", "_internal"), reply("ok")]
    progress = [e.data for e in chat(items) if e.event == "hermes.tool.progress"]
    assert progress == [
        {"tool": "terminal", "emoji": "💻", "label": "ls", "toolCallId": "c1", "status": "running"},
        {"tool": "terminal", "toolCallId": "c1", "status": "completed"},
    ]
    answered, _ = responses(items)
    items_seen = [
        (e["type"], e["output_index"], e["item"]["type"])
        for e in answered
        if e["type"].startswith("response.output_item")
    ]
    assert items_seen == [
        ("response.output_item.added", 0, "function_call"),
        ("response.output_item.done", 0, "function_call"),
        ("response.output_item.added", 1, "function_call_output"),
        ("response.output_item.done", 1, "function_call_output"),
        ("response.output_item.added", 2, "message"),
        ("response.output_item.done", 2, "message"),
    ]
    assert [e["event"] for e in runs(items)] == ["tool.started", "tool.completed", "run.completed"]


def test_runs_publish_approvals_and_reasoning_once_a_stretch_ends() -> None:
    request = ApprovalRequest("approval", {}, command="rm -rf /", choices=("once", "deny"), id="a1")
    items = [Event("reasoning", "think"), Event("reasoning", "ing"), request, reply("ok")]
    events = runs(items)
    assert [e["event"] for e in events] == [
        "reasoning.available",
        "approval.request",
        "run.completed",
    ]
    assert events[0]["text"] == "thinking" and events[1]["approval_id"] == "a1"


# ------------------------------------------------------------ failures


@pytest.mark.parametrize(
    ("end", "message", "code"),
    [
        (SupervisorError("worker_died", "the worker died"), "the worker died", "worker_died"),
        (END, "the stream fell behind and its turn was cancelled", "stalled"),
    ],
)
def test_an_end_without_a_reply_fails_in_each_api(end: Any, message: str, code: str) -> None:
    last = last_chunk(chat([token("Hel"), end]))
    assert last["choices"][0]["finish_reason"] == "error"
    assert last["error"] == {"message": message, "type": code}
    answered, writer = responses([token("Hel"), end])
    assert answered[-1]["type"] == "response.failed"
    assert answered[-1]["response"]["error"]["message"] == message
    assert writer.final is not None and writer.final["status"] == "failed"
    assert runs([token("Hel"), end])[-1] == {"event": "run.failed", "error": message}


def test_a_failed_reply_after_a_gap_is_a_failure_that_states_the_gap() -> None:
    items = [token("a"), dropped(1), reply("boom", ok=False)]
    last = last_chunk(chat(items))
    assert last["choices"][0]["finish_reason"] == "error"
    assert last["error"]["type"] == "agent_error"
    assert last["hermes"]["failed"] is True and last["hermes"]["dropped"] == 1
    answered, _ = responses(items)
    assert answered[-1]["response"]["hermes"] == {"dropped": 1}
    assert runs(items)[-1] == {"event": "run.failed", "error": "boom", "dropped": 1}


def test_a_run_asked_to_stop_ends_cancelled() -> None:
    writer = RunEvents()
    writer.stopping = True
    assert writer(reply("partial answer")) == [{"event": "run.cancelled"}]


def test_a_writer_fed_after_its_end_says_so() -> None:
    writer = ChatChunks(Said(), "c", 1, "m")
    writer(reply("x"))
    with pytest.raises(RuntimeError, match="after its end"):
        writer(token("late"))


def test_a_responses_stream_left_early_is_kept_incomplete_with_what_it_said() -> None:
    _, writer = responses([output("ls"), token("Hel")])
    left = writer.incomplete()
    assert left["status"] == "incomplete"
    assert left["output"][-1]["content"][0]["text"] == "ls\nHel"
