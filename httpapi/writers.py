"""A turn's client events in, one API's wire events out: no I/O, no clock.

As h11's writers turn events into bytes, a `TurnWriter` turns what a turn
streams (Token, Output, ToolStart, ToolComplete, Dropped, then its Reply,
a ClientError, or END when its reader fell behind) into one API's events:
`ChatChunks` the chat completion chunks, `ResponsesEvents` the Responses
API's events, `RunEvents` a run's events. Each is fed one item at a time
and returns what to send for it (often nothing). What the turn said is
folded once, in said.py, and so is the gap rule every writer states.

The routes do the I/O: stream.py sends the SSE events of chat and
Responses, runs.py records a run's events for its subscribers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Generic, NamedTuple, TypeVar

from hermes_sup.client import (
    ApprovalRequest,
    ApprovalTimeout,
    ClientError,
    Dropped,
    Event,
    Output,
    Reply,
    Token,
    ToolComplete,
    ToolStart,
)

from .response_items import ToolItems, message_item, shortened, text_part, usage_in_responses
from .said import END, GAP_EVENT, Ending, Said, gap_notice, usage_of

W = TypeVar("W")

REASONING = "reasoning"  # a piece of the model's reasoning (the Hermes runtime's event)
TOOL_PROGRESS = "tool_progress"
CLARIFY = "clarify"  # a question the agent asks its user (worker/hermes.py)
# What a run says of the subagents Hermes's delegate tool starts: their start
# and end reach the worker as tool progress (tools/delegate_tool.py), and a
# run publishes them, with these fields, as upstream's runs API does
# (gateway/platforms/api_server_runs.py, `_SUBAGENT_EVENT_KEYS`). The
# child's own text, thinking and tool calls stay off the wire, as there.
SUBAGENT_EVENTS = ("subagent.start", "subagent.complete")
INTERRUPTED = "interrupted"  # the supervisor's code for a turn its restart cut
SUBAGENT_FIELDS = (
    "goal",
    "task_count",
    "task_index",
    "subagent_id",
    "child_session_id",
    "delegation_id",
    "parent_id",
    "depth",
    "model",
    "tool_count",
    "status",
    "summary",
    "duration_seconds",
    "input_tokens",
    "output_tokens",
    "reasoning_tokens",
    "api_calls",
    "cost_usd",
    "files_read",
    "files_written",
    "output_tail",
)
SUBAGENT_TEXT = ("preview", "goal", "summary", "output_tail")  # free text: secrets redacted
SUBAGENT_TEXT_LIMIT = 4000  # characters of one free-text field a run keeps


# A chat stream's own frames (`hermes.tool.progress`, the gap notice) carry
# no `choices`: a plain OpenAI client (the `llm` CLI, the openai SDK's usual
# `chunk.choices[0]`) fails on one, so only a client that asks gets them. It
# asks with this header or query flag, or by naming its conversation with
# X-Hermes-Session-Id while reading the stream as events, as Hermes's own
# hermes-webui chat backend does (`Accept: text/event-stream`). The openai
# SDK, and litellm, langchain and `llm` on it, say `Accept:
# application/json` even when streaming: naming a conversation (as a front
# end serving many people should) does not give them frames they fail on.
CUSTOM_EVENTS_HEADER = "X-Hermes-Events"
CUSTOM_EVENTS_QUERY = "hermes_events"
_ASKS_BY_CONVERSATION = "X-Hermes-Session-Id"
_YES = ("1", "true", "yes", "on")
_EVENT_STREAM_RANGES = ("text/event-stream", "text/*", "*/*")


def _reads_events(accept: str) -> bool:
    """Whether an `Accept` header takes `text/event-stream` (no header
    takes anything); a range with `q=0` refuses it."""
    if not accept.strip():
        return True
    for part in accept.split(","):
        media, *params = (piece.strip().lower() for piece in part.split(";"))
        if media not in _EVENT_STREAM_RANGES:
            continue
        refused = any(p.replace(" ", "") in ("q=0", "q=0.0", "q=0.00", "q=0.000") for p in params)
        if not refused:
            return True
    return False


def wants_custom_events(headers: Mapping[str, str], query: Mapping[str, str]) -> bool:
    """Whether a chat client asked for Hermes's custom SSE frames
    (`headers` as case-insensitive as Starlette's)."""
    flags = (headers.get(CUSTOM_EVENTS_HEADER, ""), query.get(CUSTOM_EVENTS_QUERY, ""))
    if any(flag.strip().lower() in _YES for flag in flags):
        return True
    named = bool(headers.get(_ASKS_BY_CONVERSATION, "").strip())
    return named and _reads_events(headers.get("Accept", ""))


class SseEvent(NamedTuple):
    """One server-sent event: `data` a JSON object, or a bare string
    (`[DONE]`); `event` its name, for the lines that have one."""

    data: Any
    event: str | None = None

    def encode(self) -> bytes:
        body = self.data if isinstance(self.data, str) else json.dumps(self.data)
        head = f"event: {self.event}\n" if self.event else ""
        return f"{head}data: {body}\n\n".encode()


class TurnWriter(Generic[W]):
    """The one dispatch of a turn's items; subclasses say what each becomes."""

    def __init__(self, said: Said) -> None:
        self.said = said
        self.finished = False  # the turn's end was written

    def __call__(self, item: Event | ClientError | object) -> list[W]:
        if self.finished:
            raise RuntimeError(f"{type(self).__name__} fed {type(item).__name__} after its end")
        if isinstance(item, (Token, Output)):
            piece = self.said.add(item)
            return self.on_text(piece) if piece else []
        if isinstance(item, ToolStart):
            return self.on_tool_start(item)
        if isinstance(item, ToolComplete):
            return self.on_tool_complete(item)
        if isinstance(item, Dropped):
            self.said.drop(item)
            return self.on_dropped(item)
        if isinstance(item, (Reply, ClientError)) or item is END:
            self.finished = True
            return self.on_end(self.said.end(item))
        return self.on_other(item)

    def start(self) -> list[W]:
        """What a stream opens with, before any event."""
        return []

    def on_text(self, piece: str) -> list[W]:
        raise NotImplementedError

    def on_tool_start(self, item: ToolStart) -> list[W]:
        return []

    def on_tool_complete(self, item: ToolComplete) -> list[W]:
        return []

    def on_dropped(self, item: Dropped) -> list[W]:
        raise NotImplementedError

    def on_end(self, ending: Ending) -> list[W]:
        raise NotImplementedError

    def on_other(self, item: Any) -> list[W]:
        """Any other event (approvals, reasoning, status): none by default."""
        return []


# ------------------------------------------------------------------ chat


def _tool_display(name: str, data: Any) -> tuple[str, str]:
    """The emoji and label Hermes shows for a tool call."""
    d = data if isinstance(data, dict) else {}
    emoji, label = d.get("emoji"), d.get("label") or d.get("preview")
    if isinstance(emoji, str) and isinstance(label, str):
        return emoji, label
    try:  # the agent's own display helpers, when hermes-agent is installed here
        from agent.display import build_tool_preview, get_tool_emoji

        args = d.get("args") if isinstance(d.get("args"), dict) else {}
        return str(get_tool_emoji(name)), str(build_tool_preview(name, args) or name)
    except Exception:  # not installed, or it could not describe this call
        return "⚙️", name


class ToolProgress:
    """Hermes's `hermes.tool.progress` payloads, paired by tool call id."""

    def __init__(self) -> None:
        self.started: set[str] = set()

    def payload(self, event: Event) -> dict[str, Any] | None:
        if isinstance(event, ToolStart):
            if not event.id or event.name.startswith("_"):
                return None  # internal tools stay off the wire, as in Hermes
            self.started.add(event.id)
            emoji, label = _tool_display(event.name, event.data)
            return {
                "tool": event.name,
                "emoji": emoji,
                "label": label,
                "toolCallId": event.id,
                "status": "running",
            }
        if isinstance(event, ToolComplete) and event.id in self.started:
            self.started.discard(event.id)
            return {"tool": event.name, "toolCallId": event.id, "status": "completed"}
        return None


def stream_gaps(ending: Ending) -> dict[str, Any]:
    """Hermes's `hermes` object of a chat stream's last chunk when events
    went missing: how the turn ended, how many were dropped, and the
    whole text (the deltas have gaps)."""
    return {
        "completed": ending.ok,
        "partial": True,
        "failed": not ending.ok,
        "dropped": ending.dropped,
        "text": ending.text,
    }


class ChatChunks(TurnWriter[SseEvent]):
    """`chat.completion.chunk` events, Hermes's `hermes.tool.progress` lines,
    a last chunk with `finish_reason` and `usage`, then `[DONE]` (chat.py).
    `custom`: the client asked for the frames without `choices` (tool
    progress, the gap notice; `wants_custom_events`); without them a gap is
    still stated, in the last chunk's `hermes` object."""

    def __init__(
        self, said: Said, completion_id: str, created: int, model: str, custom: bool = True
    ) -> None:
        super().__init__(said)
        self.completion_id = completion_id
        self.created = created
        self.model = model
        self.custom = custom
        self.tools = ToolProgress()
        # The text a client now holds whole, once the turn succeeded without
        # a gap: where its conversation goes on (continuity.py).
        self.noted: str | None = None

    def chunk(self, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {
            "id": self.completion_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }

    def start(self) -> list[SseEvent]:
        return [SseEvent(self.chunk({"role": "assistant"}))]

    def on_text(self, piece: str) -> list[SseEvent]:
        return [SseEvent(self.chunk({"content": piece}))]

    def _progress(self, item: ToolStart | ToolComplete) -> list[SseEvent]:
        progress = self.tools.payload(item) if self.custom else None
        return [] if progress is None else [SseEvent(progress, "hermes.tool.progress")]

    def on_tool_start(self, item: ToolStart) -> list[SseEvent]:
        return self._progress(item)

    def on_tool_complete(self, item: ToolComplete) -> list[SseEvent]:
        return self._progress(item)

    def on_dropped(self, item: Dropped) -> list[SseEvent]:
        return [SseEvent(gap_notice(item, "stream"), GAP_EVENT)] if self.custom else []

    def on_end(self, ending: Ending) -> list[SseEvent]:
        reply = ending.reply
        if reply is not None:
            head = [self.on_text(text)[0] for text in (ending.left_out, ending.rest) if text]
            last = self.chunk({}, "stop" if reply.ok else "error")
            last["usage"] = usage_of(reply)
            if not reply.ok:
                last["error"] = {"message": reply.text, "type": "agent_error"}
        else:
            assert ending.failure is not None
            message, code = ending.failure
            head = []
            last = self.chunk({}, "error")
            last["usage"] = usage_of(None)
            last["error"] = {"message": message, "type": code}
        if ending.dropped:
            last["hermes"] = stream_gaps(ending)
        elif ending.ok:
            self.noted = ending.said
        return [*head, SseEvent(last), SseEvent("[DONE]")]


# ------------------------------------------------------------- Responses


class ResponsesEvents(TurnWriter[SseEvent]):
    """The Responses API's events (responses.py), each with its
    `sequence_number`; `final` is the response object the stream ended
    with, to be kept."""

    def __init__(self, said: Said, response: dict[str, Any], message_id: str) -> None:
        super().__init__(said)
        self.response = response  # the response object as created (in_progress)
        self.message_id = message_id
        self.sequence = 0
        self.message_index: int | None = None  # the message's output index, once opened
        self.next_index = 0
        self.tools = ToolItems()
        self.indexes: dict[str, int] = {}  # output index of each output item, by id
        self.final: dict[str, Any] | None = None

    def event(self, kind: str, **data: Any) -> SseEvent:
        payload = {"type": kind, **data, "sequence_number": self.sequence}
        self.sequence += 1
        return SseEvent(payload, kind)

    def envelope(self, status: str, **more: Any) -> dict[str, Any]:
        return {**self.response, "status": status, **more}

    def _index(self) -> int:
        index, self.next_index = self.next_index, self.next_index + 1
        return index

    def start(self) -> list[SseEvent]:
        return [self.event("response.created", response=self.envelope("in_progress"))]

    def _open_message(self) -> list[SseEvent]:
        """The message item and its one text part, opened (once)."""
        if self.message_index is not None:
            return []
        self.message_index = self._index()
        item = {**message_item("", self.message_id, "in_progress"), "content": []}
        return [
            self.event("response.output_item.added", output_index=self.message_index, item=item),
            # A strict client (the openai SDK's `responses.stream()`) adds
            # text only to a part it was told of.
            self.event(
                "response.content_part.added",
                item_id=self.message_id,
                output_index=self.message_index,
                content_index=0,
                part=text_part(""),
            ),
        ]

    def on_text(self, piece: str) -> list[SseEvent]:
        out = self._open_message()
        out.append(
            self.event(
                "response.output_text.delta",
                item_id=self.message_id,
                output_index=self.message_index,
                content_index=0,
                delta=piece,
                logprobs=[],
            )
        )
        return out

    def on_tool_start(self, item: ToolStart) -> list[SseEvent]:
        call = self.tools.start(item)
        if call is None:
            return []
        self.indexes[call["id"]] = self._index()
        return [
            self.event(
                "response.output_item.added", output_index=self.indexes[call["id"]], item=dict(call)
            )
        ]

    def on_tool_complete(self, item: ToolComplete) -> list[SseEvent]:
        pair = self.tools.complete(item)
        if pair is None:
            return []
        call, output = pair
        done = self.event(
            "response.output_item.done", output_index=self.indexes[call["id"]], item=dict(call)
        )
        self.indexes[output["id"]] = index = self._index()
        shown = {**output, "output": [{"type": "input_text", "text": output["output"]}]}
        return [
            done,
            self.event("response.output_item.added", output_index=index, item=shown),
            self.event("response.output_item.done", output_index=index, item=shown),
        ]

    def on_dropped(self, item: Dropped) -> list[SseEvent]:
        return [self.event(GAP_EVENT, **gap_notice(item, "stream"))]

    def final_items(self, text: str) -> list[dict[str, Any]]:
        done = [{k: v for k, v in i.items() if k != "status"} for i in self.tools.items]
        return shortened(done) + [message_item(text)]

    def _close_message(self, text: str) -> list[SseEvent]:
        if self.message_index is None:
            return []
        where = {"item_id": self.message_id, "output_index": self.message_index}
        return [
            self.event(
                "response.output_text.done", **where, content_index=0, text=text, logprobs=[]
            ),
            self.event(
                "response.content_part.done", **where, content_index=0, part=text_part(text)
            ),
            self.event(
                "response.output_item.done",
                output_index=self.message_index,
                item=message_item(text, self.message_id, "completed"),
            ),
        ]

    def on_end(self, ending: Ending) -> list[SseEvent]:
        out = self.on_text(ending.left_out) if ending.left_out else []
        if ending.ok and ending.rest:
            # What the reply adds to the tokens streamed (all of it from a
            # runtime that does not stream).
            out += self.on_text(ending.rest)
        said = ending.text  # with a gap in the deltas, the done events carry the whole
        out += self._close_message(said)
        usage = usage_in_responses(ending.reply)
        gaps = {"hermes": {"dropped": ending.dropped}} if ending.dropped else {}
        if ending.ok:
            self.final = self.envelope(
                "completed", output=self.final_items(said), usage=usage, **gaps
            )
            out.append(self.event("response.completed", response=self.final))
            return out
        if ending.reply is not None:
            message = ending.reply.text or "the agent failed"
        else:
            assert ending.failure is not None
            message = ending.failure[0]
        self.final = self.envelope(
            "failed",
            output=self.final_items(said or message),
            usage=usage,
            error={"message": message, "type": "server_error"},
            **gaps,
        )
        out.append(self.event("response.failed", response=self.final))
        return out

    def incomplete(self) -> dict[str, Any]:
        """The response object of a stream its reader left before the end."""
        said = "".join(self.said.parts)
        return self.envelope("incomplete", output=self.final_items(said) if said else [])


# ------------------------------------------------------------------ runs


class RunEvents(TurnWriter[dict[str, Any]]):
    """A run's events (runs.py) as `{"event": name, ...}` dicts; the run
    adds its id and the time as it records them. `stopping`: the run was
    asked to stop, so its end is a cancellation."""

    def __init__(self, said: Said | None = None) -> None:
        super().__init__(said or Said())
        self.stopping = False
        self.reasoning: list[str] = []  # the model's reasoning, not yet published

    def __call__(self, item: Event | ClientError | object) -> list[dict[str, Any]]:
        if isinstance(item, Event) and item.type == REASONING:
            # The model's reasoning streams in pieces; a front end gets it
            # as one `reasoning.available` when the stretch of it ends.
            if isinstance(item.data, str) and item.data:
                self.reasoning.append(item.data)
            return []
        out = []
        if self.reasoning:
            out.append({"event": "reasoning.available", "text": "".join(self.reasoning)})
            self.reasoning.clear()
        return out + super().__call__(item)

    def on_text(self, piece: str) -> list[dict[str, Any]]:
        return [{"event": "message.delta", "delta": piece}]

    def on_dropped(self, item: Dropped) -> list[dict[str, Any]]:
        return [{"event": "events.dropped", **gap_notice(item, "run")}]

    def on_tool_start(self, item: ToolStart) -> list[dict[str, Any]]:
        if item.name.startswith("_"):
            return []
        d = item.data if isinstance(item.data, dict) else {}
        emoji = d.get("emoji") if isinstance(d.get("emoji"), str) else None
        return [
            {
                "event": "tool.started",
                "tool": item.name,
                "preview": d.get("preview") or d.get("label"),
                "tool_call_id": item.id,
                "emoji": emoji,
            }
        ]

    def on_tool_complete(self, item: ToolComplete) -> list[dict[str, Any]]:
        if item.name.startswith("_"):
            return []
        d = item.data if isinstance(item.data, dict) else {}
        return [
            {
                "event": "tool.completed",
                "tool": item.name,
                "duration": d.get("duration", 0),
                "error": bool(d.get("is_error", False)),
                "tool_call_id": item.id,
            }
        ]

    def on_other(self, item: Any) -> list[dict[str, Any]]:
        if isinstance(item, ApprovalRequest):
            d = item.data if isinstance(item.data, dict) else {}
            keys = d.get("pattern_keys") if isinstance(d.get("pattern_keys"), list) else []
            return [
                {
                    "event": "approval.request",
                    "command": item.command,
                    "description": item.description,
                    "pattern_key": keys[0] if keys else None,
                    "pattern_keys": keys,
                    "allow_permanent": item.allow_permanent,
                    "choices": list(item.choices),
                    # The request an answer may name: `approval_id` as
                    # hermes-webui reads it, `request_id` as upstream names it.
                    "approval_id": item.id,
                    "request_id": item.id,
                }
            ]
        if isinstance(item, ApprovalTimeout):
            return [
                {
                    "event": "approval.responded",
                    "choice": "deny",
                    "resolved": 0,
                    "reason": "timeout",
                }
            ]
        if not isinstance(item, Event) or not isinstance(item.data, dict):
            return []
        d = item.data
        if item.type == TOOL_PROGRESS and d.get("event") == "reasoning.available":
            # What Hermes itself reports (the agent's words beside its tool
            # calls), as its API server's runs report it.
            preview = d.get("preview")
            return [
                {
                    "event": "reasoning.available",
                    "text": preview if isinstance(preview, str) else "",
                }
            ]
        if item.type == TOOL_PROGRESS and d.get("event") in SUBAGENT_EVENTS:
            return [subagent_event(d)]
        if item.type == CLARIFY:
            asked = d.get("choices")  # the next message answers it
            choices = [str(c) for c in asked] if isinstance(asked, list) else []
            return [
                {"event": "clarify.request", "question": str(d.get("question")), "choices": choices}
            ]
        return []

    def on_end(self, ending: Ending) -> list[dict[str, Any]]:
        reply = ending.reply
        d = reply.data if reply is not None and isinstance(reply.data, dict) else {}
        # The probe says cancelled, Hermes interrupted.
        if self.stopping or d.get("cancelled") or d.get("interrupted"):
            last: dict[str, Any] = {"event": "run.cancelled"}
        elif reply is None:
            assert ending.failure is not None
            message, code = ending.failure
            # A turn its supervisor's restart cut (PROTOCOL.md, "Turn ids")
            # reads `interrupted`, as upstream's runs cut by a restart do.
            ended = "run.interrupted" if code == INTERRUPTED else "run.failed"
            last = {"event": ended, "error": message}
        elif not reply.ok:
            last = {"event": "run.failed", "error": reply.text}
        else:
            usage = usage_of(reply)
            last = {
                "event": "run.completed",
                "output": ending.whole,
                "usage": {
                    "input_tokens": usage["prompt_tokens"],
                    "output_tokens": usage["completion_tokens"],
                    "total_tokens": usage["total_tokens"],
                },
            }
        if ending.dropped:
            last["dropped"] = ending.dropped
        return [last]


def _redacted(text: str) -> str:
    """Free text a subagent wrote (its summary, its output's tail), with the
    secrets Hermes's own redaction finds masked, as upstream's runs stream
    does; without hermes-agent here, as it came."""
    try:
        from agent.redact import redact_sensitive_text
    except ImportError:
        return text
    return str(redact_sensitive_text(text, force=True))


def subagent_event(data: dict[str, Any]) -> dict[str, Any]:
    """A `subagent.start` or `subagent.complete` tool-progress event (worker/
    hermes.py's `_on_tool_progress` data) as a run's event: its preview and
    the known fields it has, free text bounded and redacted."""
    event: dict[str, Any] = {"event": data["event"]}
    for key in ("preview", *SUBAGENT_FIELDS):
        value = data.get(key)
        if value is None:
            continue
        if key in SUBAGENT_TEXT:
            value = _redacted(str(value)[:SUBAGENT_TEXT_LIMIT])
        event[key] = value
    return event
