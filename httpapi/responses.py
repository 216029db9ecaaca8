"""The Responses API, as Hermes's API server serves it:

    POST   /v1/responses        {input, instructions?, previous_response_id? | conversation?,
                                 conversation_history?, store?, stream?, model?}
    GET    /v1/responses/{id}   a stored response
    DELETE /v1/responses/{id}

A conversation is one session, as everywhere here. Which one:
`previous_response_id` names a stored response, so the session it ran in
(404 if it is not stored); else `conversation` names the session itself;
else the session headers (sessions.py); else the response starts a new
conversation whose session is named by the response's own id. Hermes
chains by replaying the stored history into a fresh agent; here the
session's worker keeps its conversation (Hermes's state.db), so a chain
just reaches the same worker. `instructions` are carried forward from the
previous response when a request has none, as Hermes does.

`store` (default true) keeps the response object in memory, for GET and as
a `previous_response_id`: at most `max_responses` of each key's, the least
used dropped first, and none survive a restart of the endpoint. With `store:
false` the conversation still goes on in its session; only the object is
not kept. Tool call arguments and outputs are shortened in what is kept
(as Hermes shortens them in `response.completed`).

Streaming follows Hermes's events: `response.created`, the assistant
message as `response.output_item.added` then `response.output_text.delta`
pieces, each tool call as a `function_call` item (added, then done with its
`function_call_output`), `response.output_text.done` and the message's
`response.output_item.done`, then `response.completed` or
`response.failed`; every event carries a `sequence_number`. Besides
Hermes's, the message's text part is announced (`response.content_part.added`
before the first delta, `response.content_part.done` after the text), as
OpenAI sends it: the openai SDK's `responses.stream()` adds deltas only to a
part it was told of. A turn's output lines (a command's) are part of the
message's text, each with its newline, before the reply's. A client that
disconnects cancels the turn; the response is kept as `incomplete`. The
events are written by writers.ResponsesEvents.

If the endpoint fell behind the supervisor and some of the stream's
events were dropped, a `hermes.stream.gap` event {count, reason, message}
says so where they went missing; the done events carry the whole text, and
the response says `"hermes": {"dropped": n}` (said.py, the gap rule).

As on chat completions, an approval cannot be answered here: the command
is denied at once (use the runs API to approve). Client-side `tools` and
`truncation` are not honoured. Not streaming, a repeat with the same
`Idempotency-Key` gets the first response again instead of a second turn
(idempotency.py). Streamed or not, a retry with an `Idempotency-Key` is
the same turn, also on an endpoint restarted since, answered as on chat
completions (chat.py, retries.py), with the first try's response id.
"""

from __future__ import annotations

import re
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from hermes_sup.client import ToolComplete, ToolStart

from .api import Api
from .errors import ApiError
from .idempotency import HUNG_UP, RESPONSES_FIELDS
from .keys import Tenant
from .response_items import ToolItems, message_item, shortened, usage_in_responses
from .retries import turn_id_of
from .said import Said, outputs_of, reply_of
from .sessions import (
    SESSION_KEY_HEADER,
    SessionRef,
    check_id,
    history_of,
    tenant_of,
    text_of,
    turn_context,
)
from .stream import SSE_HEADERS, stream
from .turns import EventStream, OpenTurn, Pump, QueueSink, approval_denier, collect
from .writers import ResponsesEvents

TRUE_STRINGS = ("1", "true", "yes", "on")
FALSE_STRINGS = ("0", "false", "no", "off")
_HEADER_SAFE = re.compile(r"[\x20-\x7e]{1,256}")


def request_bool(value: Any, default: bool) -> bool:
    """A boolean flag as Hermes reads it: "false" is false, junk the default."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        word = value.strip().lower()
        return True if word in TRUE_STRINGS else False if word in FALSE_STRINGS else default
    if isinstance(value, (int, float)):
        return bool(value)
    return default


@dataclass
class Stored:
    """A kept response: its object, and where its conversation goes on."""

    response: dict[str, Any]
    ref: SessionRef
    conversation: str  # the id the session's runtime records the conversation under
    instructions: str | None
    owner: str  # the namespace of the key that made it (keys.py `Tenant.prefix`)


class ResponseStore:
    """Stored responses by id, in memory: at most `limit` of each key's,
    its least used first out, so that one key's many never push out
    another's."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._owners: dict[str, str] = {}  # response id -> owner
        self._items: dict[str, OrderedDict[str, Stored]] = {}  # owner -> its responses

    def get(self, response_id: str) -> Stored | None:
        owner = self._owners.get(response_id)
        if owner is None:
            return None
        items = self._items[owner]
        items.move_to_end(response_id)
        return items[response_id]

    def put(self, response_id: str, stored: Stored) -> None:
        items = self._items.setdefault(stored.owner, OrderedDict())
        items[response_id] = stored
        items.move_to_end(response_id)
        self._owners[response_id] = stored.owner
        while len(items) > self.limit:
            dropped, _ = items.popitem(last=False)
            del self._owners[dropped]

    def delete(self, response_id: str) -> bool:
        owner = self._owners.pop(response_id, None)
        if owner is None:
            return False
        items = self._items[owner]
        del items[response_id]
        if not items:
            del self._items[owner]
        return True

    def __len__(self) -> int:
        return len(self._owners)


@dataclass(frozen=True)
class ResponseRequest:
    """A POST /v1/responses body, checked."""

    text: str
    history: list[dict[str, str]]
    instructions: str | None
    previous: str | None
    conversation: str | None
    store: bool
    stream: bool


def _conversation(raw: Any) -> str | None:
    """`conversation`: a name, or the OpenAI SDK's {"id": name}."""
    if isinstance(raw, dict):
        raw = raw.get("id")
    if raw is None or raw == "":
        return None
    if not isinstance(raw, str):
        raise ApiError(400, "'conversation' must be a string", "invalid_conversation")
    return check_id(raw, "conversation", "'conversation'")


def parse_request(body: dict[str, Any]) -> ResponseRequest:
    """Read a request as Hermes's API server does; 400 for what it refuses."""
    raw_input = body.get("input")
    if raw_input is None:
        raise ApiError(400, "Missing 'input' field", "missing_input")
    messages: list[dict[str, str]] = []
    if isinstance(raw_input, str):
        messages.append({"role": "user", "content": raw_input})
    elif isinstance(raw_input, list):
        for i, item in enumerate(raw_input):
            if isinstance(item, str):
                messages.append({"role": "user", "content": item})
            elif isinstance(item, dict):
                role = item.get("role", "user")
                text = text_of(item.get("content", ""), f"input[{i}].content")
                messages.append({"role": str(role), "content": text})
    else:
        raise ApiError(400, "'input' must be a string or array", "invalid_input")
    if not messages or not messages[-1]["content"].strip():
        raise ApiError(400, "No user message found in input", "missing_input")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ApiError(400, "'instructions' must be a string", "invalid_instructions")
    previous = body.get("previous_response_id") or None
    if previous is not None and not isinstance(previous, str):
        raise ApiError(400, "'previous_response_id' must be a string", "invalid_previous_response")
    conversation = _conversation(body.get("conversation"))
    if conversation and previous:
        raise ApiError(
            400,
            "Cannot use both 'conversation' and 'previous_response_id'",
            "conflicting_conversation",
        )
    # The front end's history: conversation_history, then the input's
    # messages before its last (the runtime uses it only for a conversation
    # it does not hold yet).
    history = history_of(body, None) + messages[:-1]
    return ResponseRequest(
        text=messages[-1]["content"],
        history=history,
        instructions=instructions,
        previous=previous,
        conversation=conversation,
        store=request_bool(body.get("store"), True),
        stream=request_bool(body.get("stream"), False),
    )


# ---------------------------------------------------------------- handlers


class Responses:
    """The Responses API routes and the responses they keep."""

    def __init__(self, api: Api) -> None:
        self.api = api
        self.store = ResponseStore(api.settings.max_responses)

    def find(self, tenant: Tenant, response_id: str) -> Stored | None:
        """A stored response, if `tenant` may see it: its own, or any for
        an admin. Another key's is as if it did not exist."""
        stored = self.store.get(response_id)
        if stored is None or not (tenant.admin or stored.owner == tenant.prefix):
            return None
        return stored

    def _get(self, request: Request) -> Stored:
        response_id = request.path_params["response_id"]
        stored = self.find(tenant_of(request), response_id)
        if stored is None:
            raise ApiError(404, f"Response not found: {response_id}", "response_not_found")
        return stored

    async def get(self, request: Request) -> Response:
        return JSONResponse(self._get(request).response)

    async def delete(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        self._get(request)
        self.store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def create(self, request: Request) -> Response:
        api = self.api
        body = await api.read_json(request)
        asked = parse_request(body)
        # With an Idempotency-Key, a retry is the same turn (retries.py).
        first = turn_id_of(request, "responses", body, RESPONSES_FIELDS)
        turn_id = api.retries.attempt(first)
        if asked.stream:
            return await self._start(request, body, asked, turn_id)

        return await api.whole_answer(
            request,
            body,
            RESPONSES_FIELDS,
            first,
            partial(self._start, request, body, asked, turn_id),
        )

    async def _start(
        self, request: Request, body: dict[str, Any], asked: ResponseRequest, turn_id: str | None
    ) -> Response:
        api = self.api
        tenant = tenant_of(request)
        # A retry's response has its first try's id, so its session (named
        # after it when nothing else names one) is the same too.
        response_id = f"resp_{(turn_id or uuid.uuid4().hex)[:28]}"
        instructions = asked.instructions
        previous = None
        if asked.previous:
            previous = self.find(tenant, asked.previous)
            if previous is None:
                raise ApiError(
                    404, f"Previous response not found: {asked.previous}", "response_not_found"
                )
            if instructions is None:
                instructions = previous.instructions
        ref: SessionRef
        if previous is not None:
            ref, conversation = previous.ref, previous.conversation
        else:
            if asked.conversation:
                ref = api.ref(tenant, asked.conversation)
            else:
                ref = api.header_ref(request, tenant) or api.ref(tenant, response_id)
            conversation = ref.original
        context = turn_context(instructions, asked.history, conversation)
        opened = await api.open_turn(ref, asked.text, context, turn_id)
        model = api.model_of(body)
        created_at = int(time.time())
        headers = {}
        if _HEADER_SAFE.fullmatch(conversation):  # a header cannot carry just any name
            headers["X-Hermes-Session-Id"] = conversation
        key_header = request.headers.get(SESSION_KEY_HEADER, "").strip()
        if key_header:
            headers[SESSION_KEY_HEADER] = key_header
        response = {
            "id": response_id,
            "object": "response",
            "status": "in_progress",
            "created_at": created_at,
            "model": model,
            "output": [],
        }
        kept = Stored(response, ref, conversation, instructions, tenant.prefix)

        def keep() -> None:
            if asked.store:
                self.store.put(response_id, kept)

        keep()
        if asked.stream:
            return self._stream(opened, kept, keep, headers)
        return await self._complete(request, opened, kept, keep, headers)

    def _stream(
        self,
        opened: OpenTurn,
        kept: Stored,
        keep: Callable[[], None],
        headers: dict[str, str],
    ) -> Response:
        """The streamed answer (the Responses events, writers.py). The
        response is kept as it ended; as `incomplete` if its reader left
        first, which cancels the turn. A retry of a turn that had started
        (`opened.resumed`) streams the reply, whole, at the end."""
        settings = self.api.settings
        sink = QueueSink(settings.stream_queue, settings.stall_timeout, f"responses {opened.key}")
        pump = Pump(opened, sink, self.api.tasks, on_event=approval_denier(opened))
        said = Said(resumed=opened.resumed)
        writer = ResponsesEvents(said, kept.response, f"msg_{uuid.uuid4().hex[:24]}")

        def ended() -> None:
            assert writer.final is not None
            kept.response = writer.final
            keep()

        def abandoned() -> None:
            kept.response = writer.incomplete()
            keep()

        events = stream(pump, sink, writer, settings.keepalive, ended, abandoned)
        return EventStream(
            events, media_type="text/event-stream", headers={**SSE_HEADERS, **headers}
        )

    async def _complete(
        self,
        request: Request,
        opened: OpenTurn,
        kept: Stored,
        keep: Callable[[], None],
        headers: dict[str, str],
    ) -> Response:
        """The non-streaming answer: the whole response object."""
        items = await collect(request.receive, opened, approval_denier(opened))
        response = kept.response
        if items is None:  # the client hung up: the turn was cancelled
            response["status"] = "incomplete"
            keep()
            return Response(status_code=HUNG_UP)
        tools = ToolItems()
        for item in items:
            if isinstance(item, ToolStart):
                tools.start(item)
            elif isinstance(item, ToolComplete):
                tools.complete(item)
        try:
            reply = reply_of(items)
        except ApiError as exc:
            response.update(status="failed", error={"message": exc.message, "type": "server_error"})
            keep()
            raise
        # A retry that joined its turn late has only some of its output
        # lines: its text is the reply, as one that read the recorded one.
        said = ("" if opened.resumed else outputs_of(items)) + reply.text
        output = [{k: v for k, v in item.items() if k != "status"} for item in tools.items] + [
            message_item(said, f"msg_{uuid.uuid4().hex[:24]}", "completed")
        ]
        response.update(status="completed", output=output, usage=usage_in_responses(reply))
        kept.response = {**response, "output": shortened(output)}
        keep()
        return JSONResponse(response, headers=headers)
