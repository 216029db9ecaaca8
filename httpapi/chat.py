"""`POST /v1/chat/completions`, as Hermes's API server answers it.

Streaming: a `chat.completion.chunk` with the assistant role, one chunk per
piece of text the agent streams, tool activity as `event:
hermes.tool.progress` lines (`tool`, `emoji`, `label`, `toolCallId`,
`status` running, then `tool`, `toolCallId`, `status` completed), a last
chunk with `finish_reason` and `usage`, then `data: [DONE]`. A failure
after the stream has started ends it with `finish_reason: "error"`, an
`error` object and `data: [DONE]`, as Hermes does. Not streaming: one
`chat.completion` object; an agent failure is a 502 error. Not streaming,
a repeat with the same `Idempotency-Key` gets the first answer again
instead of a second turn (idempotency.py).

With an `Idempotency-Key`, streamed or not, a retry is the same turn
(retries.py), also on an endpoint restarted since: it never runs twice,
and a retry's answer has the first try's `id`. A retry of a turn not yet
started, or still queued, is answered as the first try would have been. A
retry of a turn that had started streams tool progress from where the
turn is now, then the whole reply as its text when the turn ends (what
the first try was sent is not sent again, and output lines of commands
that ran before are not in it), its last chunk and `[DONE]`; a retry of a
turn that had ended gets the recorded reply as that short stream at once,
or the recorded error. A client that hangs up leaves such a turn running
for a while for its retry (retries.py), instead of cancelling it at once.

While a turn is silent (a tool runs, the model thinks), a streamed answer
sends a `: keepalive` comment every `chat_keepalive` second (1 s), not
every 30 s as on the other streams: hermes-webui's chat backend looks at
its Stop button only when a line arrives, and closes the stream then,
which is what cancels the turn.

A turn's output lines (a command's, such as the probe's `sh`) are part of
the answer's text, each with its newline, before the reply's: streamed as
they come, and at the start of a whole answer's content.

If the endpoint fell behind the supervisor and some of a stream's events
were dropped (a `dropped` notice, PROTOCOL.md "Slow consumers"), the
streamed text has gaps: the stream then ends with `finish_reason: "error"`,
an `error` of type `output_incomplete` and Hermes's `hermes` object
(`completed: true, partial: true`), never a plain `stop`. Not streaming,
the text is the turn's reply, which is never dropped (the client asks the
supervisor for it again if need be), so it is whole.

Chat completions has no way to answer an approval. Hermes's API server
does not run a command that needs one there (no approval callback is
registered, so the command stays unapproved and the agent is told so); we
do the same by answering `deny` at once. Use the runs API to approve.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from hermes_sup.client import (
    ApprovalRequest,
    ClientError,
    Dropped,
    Event,
    Output,
    Reply,
    SupervisorError,
    Token,
    ToolComplete,
    ToolStart,
)

from .continuity import digest, new_conversation_id
from .errors import ApiError, from_client_error
from .idempotency import CHAT_FIELDS, HUNG_UP
from .keys import Tenant
from .logsafe import kv
from .retries import conversation_id, turn_id_of
from .sessions import (
    SESSION_ID_HEADER,
    SESSION_KEY_HEADER,
    ChatTurn,
    SessionRef,
    check_id,
    parse_chat,
    tenant_of,
    turn_context,
)
from .turns import (
    END,
    IDLE,
    EventStream,
    OpenTurn,
    Pump,
    QueueSink,
    next_item,
    read_turn,
    unless_hung_up,
)

if TYPE_CHECKING:
    from .app import Api

log = logging.getLogger("hermes_sup.httpapi")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_data(obj: Any) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def usage_of(reply: Reply | None) -> dict[str, int]:
    """OpenAI `usage` from the reply's data (zeros when the runtime has none)."""
    data = reply.data if reply is not None and isinstance(reply.data, dict) else {}
    nested = data.get("usage")
    raw: dict[str, Any] = nested if isinstance(nested, dict) else data

    def count(*names: str) -> int:
        for name in names:
            value = raw.get(name)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return 0

    prompt = count("input_tokens", "prompt_tokens")
    completion = count("output_tokens", "completion_tokens")
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": count("total_tokens") or prompt + completion,
    }


def rest_of_reply(streamed: str, reply: Reply) -> str:
    """Text of the reply the client has not seen: all of it if nothing was
    streamed (a runtime that does not stream), the tail if the stream was
    its start; nothing if the stream already showed something else (Hermes
    streams interim text around tool calls, then answers with the last part)."""
    if not streamed:
        return reply.text
    if reply.text.startswith(streamed):
        return reply.text[len(streamed) :]
    return ""


MAX_OUTPUT = 1 << 20  # characters of output lines an answer carries at most
NOTE_LIMIT = 4 << 20  # a streamed answer longer than this leaves no note (continuity.py)


class Outputs:
    """A turn's output lines (a command's, such as the probe's `sh`) as the
    text they make before the reply's: each with its newline, at most
    MAX_OUTPUT characters of them (a command may print without end), then
    one line saying how much was left out."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.size = 0
        self.left_out = 0

    def add(self, item: Output) -> str | None:
        """The text this line adds to the answer; None once it is full."""
        piece = f"{item.line}\n"
        if self.size + len(piece) > MAX_OUTPUT:
            self.left_out += len(piece)
            return None
        self.parts.append(piece)
        self.size += len(piece)
        return piece

    def end(self) -> str:
        """The line that closes the output, if any was left out."""
        return f"[{self.left_out} more characters of output left out]\n" if self.left_out else ""

    @property
    def text(self) -> str:
        return "".join(self.parts) + self.end()


def outputs_of(items: list[Any]) -> str:
    """The output lines among a turn's events as the answer's text (`Outputs`)."""
    lines = [item for item in items if isinstance(item, Output)]
    if not lines:
        return ""  # the usual turn: no command ran
    outputs = Outputs()
    for line in lines:
        outputs.add(line)
    return outputs.text


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


async def chat_completions(api: Api, request: Request) -> Response:
    body = await api.read_json(request)
    stream = body.get("stream") in (True, "true", "True", "1", 1)
    # With an Idempotency-Key, a retry is the same turn (retries.py).
    first = turn_id_of(request, "chat", body, CHAT_FIELDS)
    turn_id = api.retries.attempt(first)
    if stream:
        return await _answer(api, request, body, stream, turn_id)

    async def answer() -> Response:
        try:
            return await _answer(api, request, body, stream, turn_id)
        except (ApiError, ClientError) as exc:
            if not (isinstance(exc, ApiError) and exc.status == 409):  # 409: still running
                api.retries.failed(first)
            raise

    # A whole answer: a repeat with its Idempotency-Key gets it again (idempotency.py).
    return await api.idempotency.run(request, body, CHAT_FIELDS, answer)


async def _answer(
    api: Api, request: Request, body: dict[str, Any], stream: bool, turn_id: str | None
) -> Response:
    chat = parse_chat(body)
    tenant = tenant_of(request)
    place = _place(api, request, tenant, chat, turn_id)
    ref = place.ref
    model = api.model_of(body)
    # A retry's answer has its first try's id.
    completion_id = f"chatcmpl-{(turn_id or uuid.uuid4().hex)[:29]}"
    created = int(time.time())
    # The history goes too: a runtime that holds the conversation already
    # (the usual case) keeps its own, one whose data was purged uses it.
    context = turn_context(chat.system, chat.history, place.conversation)
    opened = await api.open_turn(ref, chat.text, context, turn_id)
    # As Hermes answers: the conversation's id (the client's, or the one
    # made for it), and the session key header echoed when there was one.
    headers = {SESSION_ID_HEADER: place.conversation}
    key_header = request.headers.get(SESSION_KEY_HEADER, "").strip()
    if key_header:
        headers[SESSION_KEY_HEADER] = key_header

    def answered(text: str) -> None:
        """The reply the client now holds: where its next turn goes on."""
        if place.noted is not None:
            said = [*chat.history, {"role": "user", "content": chat.text}]
            said.append({"role": "assistant", "content": text})
            owner = tenant.prefix
            api.continuations.leave(owner, place.noted(said), ref, place.conversation)

    deny_approvals = approval_denier(opened)
    if not stream:
        return await _complete(
            api, request, opened, deny_approvals, completion_id, created, model, headers, answered
        )
    sink = QueueSink(api.settings.stream_queue, api.settings.stall_timeout, f"chat {ref.key}")
    pump = Pump(opened, sink, api.tasks, on_event=deny_approvals)
    chunks = _chunks(api, pump, sink, completion_id, created, model, answered, opened.resumed)
    return EventStream(chunks, media_type="text/event-stream", headers={**SSE_HEADERS, **headers})


@dataclass(frozen=True)
class ChatPlace:
    """Where a chat turn goes (continuity.py); `noted` makes the digest of
    the conversation as its client will hold it, when its turn is to leave
    a note (no X-Hermes-Session-Id named its conversation)."""

    ref: SessionRef
    conversation: str
    noted: Callable[[list[dict[str, str]]], bytes] | None


def _place(
    api: Api, request: Request, tenant: Tenant, chat: ChatTurn, turn_id: str | None
) -> ChatPlace:
    """X-Hermes-Session-Id names the conversation (its runtime holds its
    history, as Hermes's state.db does); else the request's history is the
    conversation, continued where exactly it was left, or new. A retry
    (`turn_id`) goes where its first try went (retries.py)."""
    named = api.header_ref(request, tenant)  # the key header's session, else the id header's
    id_header = request.headers.get(SESSION_ID_HEADER, "").strip()
    if id_header:
        assert named is not None
        return ChatPlace(named, check_id(id_header, "session ID", SESSION_ID_HEADER), None)
    session = named.key if named is not None else ""

    def noted(said: list[dict[str, str]]) -> bytes:
        return digest(tenant.prefix, session, chat.system, said)

    if turn_id is not None:
        before = api.retries.recall(turn_id)
        if isinstance(before, ChatPlace):
            return before
    found = api.continuations.take(tenant.prefix, noted(chat.history)) if chat.history else None
    if found is not None:
        ref, going_on = found
        place = ChatPlace(ref, going_on or new_conversation_id(), noted)
        if turn_id is not None:
            # Taken from memory: its retries could not find it again.
            api.retries.remember(turn_id, place)
        return place
    conversation = new_conversation_id() if turn_id is None else conversation_id(turn_id)
    ref = named if named is not None else api.ref(tenant, conversation)
    return ChatPlace(ref, conversation, noted)


def approval_denier(opened: OpenTurn) -> Callable[[Event], Awaitable[None]]:
    """An `on_event` for a turn whose client cannot answer approvals (chat
    completions, responses): each request is denied at once, as Hermes's
    API server leaves such a command unapproved."""

    async def deny(event: Event) -> None:
        if isinstance(event, ApprovalRequest):
            key = opened.key
            log.info(kv("http_approval_denied", session=key, command=event.command[:200]))
            try:
                await opened.client.approve(key, "deny", approval=event.id)
            except ClientError as exc:
                log.warning(kv("http_approval_deny_failed", session=key, error=exc))

    return deny


async def collect(
    api: Api,
    request: Request,
    opened: OpenTurn,
    on_event: Callable[[Event], Awaitable[None]] | None,
) -> list[Any] | None:
    """Every event of a turn but its tokens (the reply holds the text),
    ending with its Reply or error; None if the client hung up first (the
    turn is cancelled then)."""
    items: list[Any] = []

    async def keep(item: Any) -> bool:
        if not isinstance(item, Token):
            items.append(item)
        return True

    # Read inline: a list never blocks, so no pump task is needed here.
    if not await unless_hung_up(request.receive, read_turn(opened, keep, on_event)):
        return None
    return items


def reply_of(items: list[Any]) -> Reply:
    """The turn's successful Reply from `collect`'s items; an OpenAI-style
    error for a failure."""
    end = items[-1] if items else None
    if isinstance(end, ClientError):
        raise from_client_error(end)
    if not isinstance(end, Reply):
        raise ApiError(502, "the turn ended without a reply", "agent_incomplete", "server_error")
    if not end.ok:
        raise ApiError(502, end.text or "the agent failed", "agent_error", "server_error")
    return end


async def _complete(
    api: Api,
    request: Request,
    opened: OpenTurn,
    on_event: Callable[[Event], Awaitable[None]],
    completion_id: str,
    created: int,
    model: str,
    headers: dict[str, str],
    answered: Callable[[str], None],
) -> Response:
    """The non-streaming answer; a client that hangs up cancels the turn."""
    items = await collect(api, request, opened, on_event)
    if items is None:
        return Response(status_code=HUNG_UP)  # nobody reads it
    end = reply_of(items)
    # A retry that joined its turn late has only some of its output lines:
    # its answer is the reply, as one that read the recorded answer gets.
    text = ("" if opened.resumed else outputs_of(items)) + end.text
    answered(text)
    return JSONResponse(
        {
            "id": completion_id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }
            ],
            "usage": usage_of(end),
        },
        headers=headers,
    )


def incomplete(dropped: int) -> dict[str, Any]:
    """The `error` and `hermes` fields of a last chunk whose stream lost
    `dropped` events: the turn completed, what was streamed is partial."""
    message = (
        f"{dropped} streamed event(s) of this reply were dropped: this endpoint read too "
        "slowly from the supervisor (slow_consumer); the streamed text is incomplete, "
        "the turn itself completed"
    )
    return {
        "error": {"message": message, "type": "output_incomplete"},
        "hermes": {
            "completed": True,
            "partial": True,
            "failed": False,
            "error": message,
            "error_code": "output_incomplete",
        },
    }


def failure_of(item: Any) -> tuple[str, str]:
    """The message and code of what ended a stream without a reply: the
    turn's error, or END (the reader fell behind and the turn was cancelled)."""
    if item is END:
        return "the stream fell behind and its turn was cancelled", "stalled"
    if isinstance(item, SupervisorError):
        return item.message, item.code or "error"
    return str(item), type(item).__name__


async def _chunks(
    api: Api,
    pump: Pump,
    sink: QueueSink,
    completion_id: str,
    created: int,
    model: str,
    answered: Callable[[str], None],
    resumed: bool = False,
) -> AsyncIterator[bytes]:
    """The SSE body. Ends the turn (through its pump) if the client leaves.
    Whatever has arrived by the time it is written goes out as one write.
    `resumed`: a retry of a turn that had started; its text is the reply,
    whole, at the end (see the module docstring)."""

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }

    tools = ToolProgress()
    streamed: list[str] = []  # the reply's tokens
    outputs = Outputs()
    sent: list[str] = []  # all the content sent, while it may still leave a note
    sent_size = 0
    dropped = 0  # events of this stream the supervisor dropped (we lagged)
    finished = False

    def content(text: str) -> bytes:
        nonlocal sent_size
        sent_size += len(text)
        if sent_size <= NOTE_LIMIT:
            sent.append(text)
        return sse_data(chunk({"content": text}))

    def render(item: Any) -> bytes:
        """The SSE lines for one item (none for most events); sets
        `finished` at the stream's end."""
        nonlocal dropped, finished
        if isinstance(item, Token):
            if item.text and not resumed:
                streamed.append(item.text)
                return content(item.text)
        elif isinstance(item, Output):
            piece = outputs.add(item) if not resumed else None
            if piece is not None:
                return content(piece)
        elif isinstance(item, (ToolStart, ToolComplete)):
            progress = tools.payload(item)
            if progress is not None:
                return f"event: hermes.tool.progress\ndata: {json.dumps(progress)}\n\n".encode()
        elif isinstance(item, Dropped):
            dropped += item.count
            log.warning(kv("http_stream_dropped", stream=sink.what, count=item.count))
        elif isinstance(item, Reply):
            said = "".join(streamed)
            rest = rest_of_reply(said, item)
            # With events dropped, the client has the reply only if what
            # it was sent adds up to it (the gap was at the end).
            partial = bool(dropped) and said + rest != item.text
            last = chunk({}, "stop" if item.ok and not partial else "error")
            last["usage"] = usage_of(item)
            if not item.ok:
                last["error"] = {"message": item.text, "type": "agent_error"}
            elif partial:
                last.update(incomplete(dropped))
            head = b"".join(content(text) for text in (outputs.end(), rest) if text)
            if item.ok and not partial and sent_size <= NOTE_LIMIT:
                answered("".join(sent))
            finished = True
            return head + sse_data(last) + b"data: [DONE]\n\n"
        elif isinstance(item, ClientError) or item is END:
            message, code = failure_of(item)
            last = chunk({}, "error")
            last["usage"] = usage_of(None)
            last["error"] = {"message": message, "type": code}
            finished = True
            return sse_data(last) + b"data: [DONE]\n\n"
        return b""

    queue = sink.queue
    try:
        yield sse_data(chunk({"role": "assistant"}))
        while not finished:
            item = await next_item(queue, api.settings.chat_keepalive)
            if item is IDLE:
                yield b": keepalive\n\n"
                continue
            out = [render(item)]
            while not finished and not queue.empty():
                out.append(render(queue.get_nowait()))
            data = b"".join(out)
            if data:
                yield data
    finally:
        if not finished:
            pump.abandon()  # the client went away mid-stream: cancel its turn
