"""`POST /v1/chat/completions`, as Hermes's API server answers it.

Streaming: a `chat.completion.chunk` with the assistant role, one chunk per
piece of text the agent streams, tool activity as `event:
hermes.tool.progress` lines (`tool`, `emoji`, `label`, `toolCallId`,
`status` running, then `tool`, `toolCallId`, `status` completed) for a
client that asks for such frames (they carry no `choices`: an
`X-Hermes-Events: 1` header, `?hermes_events=1`, or X-Hermes-Session-Id
with an `Accept` that takes `text/event-stream`, as hermes-webui sends;
not the openai SDK's `application/json`; writers.wants_custom_events), a last
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
streamed text has a gap: an `event: hermes.stream.gap` line {count,
reason, message} says so where it is (to a client that asks for such
frames), the stream ends as its turn ended
(`stop` for a reply), and its last chunk carries Hermes's `hermes` object
with `partial: true`, `dropped` (how many events went missing) and `text`,
the whole answer (said.py, the gap rule of every API). Not streaming, the
text is the turn's reply, which is never dropped (the client asks the
supervisor for it again if need be), so it is whole.

Chat completions has no way to answer an approval. Hermes's API server
does not run a command that needs one there (no approval callback is
registered, so the command stays unapproved and the agent is told so); we
do the same by answering `deny` at once. Use the runs API to approve.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .api import Api
from .continuity import digest, new_conversation_id
from .idempotency import CHAT_FIELDS, HUNG_UP
from .keys import Tenant
from .retries import conversation_id, turn_id_of
from .said import Said, outputs_of, reply_of, usage_of
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
from .stream import SSE_HEADERS, stream
from .turns import EventStream, OpenTurn, Pump, QueueSink, approval_denier, collect
from .writers import ChatChunks, wants_custom_events

NOTE_LIMIT = 4 << 20  # a streamed answer longer than this leaves no note (continuity.py)


@dataclass(frozen=True)
class ChatPlace:
    """Where a chat turn goes (continuity.py); `noted` makes the digest of
    the conversation as its client will hold it, when its turn is to leave
    a note (no X-Hermes-Session-Id named its conversation)."""

    ref: SessionRef
    conversation: str
    noted: Callable[[list[dict[str, str]]], bytes] | None


@dataclass(frozen=True)
class ChatAnswer:
    """What a chat turn's answer is made with, streamed or not."""

    opened: OpenTurn
    completion_id: str
    created: int
    model: str
    headers: dict[str, str]
    answered: Callable[[str], None]  # the reply the client now holds: a note of it
    custom_events: bool = True  # frames without `choices` (writers.wants_custom_events)


class Chat:
    """`POST /v1/chat/completions` (see the module docstring)."""

    def __init__(self, api: Api) -> None:
        self.api = api

    async def create(self, request: Request) -> Response:
        api = self.api
        body = await api.read_json(request)
        streamed = body.get("stream") in (True, "true", "True", "1", 1)
        # With an Idempotency-Key, a retry is the same turn (retries.py).
        first = turn_id_of(request, "chat", body, CHAT_FIELDS)
        turn_id = api.retries.attempt(first)
        if streamed:
            return await self._answer(request, body, streamed, turn_id)

        return await api.whole_answer(
            request, body, CHAT_FIELDS, first, partial(self._answer, request, body, False, turn_id)
        )

    async def _answer(
        self, request: Request, body: dict[str, Any], streamed: bool, turn_id: str | None
    ) -> Response:
        api = self.api
        chat = parse_chat(body)
        tenant = tenant_of(request)
        place = self._place(request, tenant, chat, turn_id)
        ref = place.ref
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

        answer = ChatAnswer(
            opened,
            # A retry's answer has its first try's id.
            completion_id=f"chatcmpl-{(turn_id or uuid.uuid4().hex)[:29]}",
            created=int(time.time()),
            model=api.model_of(body),
            headers=headers,
            answered=answered,
            custom_events=wants_custom_events(request.headers, request.query_params),
        )
        if not streamed:
            return await self._complete(request, answer)
        return self._stream(answer)

    def _stream(self, answer: ChatAnswer) -> Response:
        """The streamed answer (chat.completion.chunk events, writers.py)."""
        settings = self.api.settings
        opened = answer.opened
        sink = QueueSink(settings.stream_queue, settings.stall_timeout, f"chat {opened.key}")
        pump = Pump(opened, sink, self.api.tasks, on_event=approval_denier(opened))
        said = Said(resumed=opened.resumed)
        writer = ChatChunks(
            said, answer.completion_id, answer.created, answer.model, answer.custom_events
        )

        def ended() -> None:
            if writer.noted is not None and len(writer.noted) <= NOTE_LIMIT:
                answer.answered(writer.noted)

        chunks = stream(pump, sink, writer, settings.chat_keepalive, on_end=ended)
        return EventStream(
            chunks, media_type="text/event-stream", headers={**SSE_HEADERS, **answer.headers}
        )

    def _place(
        self, request: Request, tenant: Tenant, chat: ChatTurn, turn_id: str | None
    ) -> ChatPlace:
        """X-Hermes-Session-Id names the conversation (its runtime holds its
        history, as Hermes's state.db does); else the request's history is the
        conversation, continued where exactly it was left, or new. A retry
        (`turn_id`) goes where its first try went (retries.py)."""
        api = self.api
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

    async def _complete(self, request: Request, answer: ChatAnswer) -> Response:
        """The non-streaming answer; a client that hangs up cancels the turn."""
        opened = answer.opened
        items = await collect(request.receive, opened, approval_denier(opened))
        if items is None:
            return Response(status_code=HUNG_UP)  # nobody reads it
        end = reply_of(items)
        # A retry that joined its turn late has only some of its output lines:
        # its answer is the reply, as one that read the recorded answer gets.
        text = ("" if opened.resumed else outputs_of(items)) + end.text
        answer.answered(text)
        return JSONResponse(
            {
                "id": answer.completion_id,
                "object": "chat.completion",
                "created": answer.created,
                "model": answer.model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": "stop",
                    }
                ],
                "usage": usage_of(end),
            },
            headers=answer.headers,
        )
