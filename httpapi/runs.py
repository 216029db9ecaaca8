"""The runs API: a turn started now and followed by id, as Hermes's API
server serves it (hermes-webui uses it for approvals and stop).

    POST /v1/runs                    202 {run_id, status: "started", replayed}
    GET  /v1/runs/{id}               {object: "hermes.run", run_id, status, ...}
    GET  /v1/runs/{id}/events        SSE: `data: {"event": ..., "run_id", "timestamp", ...}`
    POST /v1/runs/{id}/approval      {choice, request_id?} -> {object: "hermes.run.approval_response", ...}
    POST /v1/runs/{id}/stop          {run_id, status: "stopping"}

Upstream Hermes's newer runs API also has `POST /v1/runs/{id}/steer`; it is
not served here (the supervisor's protocol has no way yet to hand a running
turn new input), and /v1/capabilities says so (`run_steer: false`).

A run's turn goes on whether or not anyone follows its events. Its events
are kept (up to `run_events` of them, consecutive text deltas merged) so
a subscriber that comes late, or a second one, sees the run from its start; each subscriber has a bounded
queue, and one that falls behind by more than that is cut off (its stream
ends with a comment saying so) rather than let memory grow. Status:
queued, running, waiting_for_approval, stopping, then completed, failed,
cancelled or interrupted (the supervisor running its turn stopped before
it ended: `run.interrupted` {error}). Ended runs are kept for `run_ttl` seconds, at most `max_runs` of
each key's.
A turn's output lines (a command's) are part of the answer's text: each a
`message.delta` with its newline, and the start of `run.completed`'s `output`.

If the endpoint fell behind the supervisor and some of the turn's events
were dropped (PROTOCOL.md, "Slow consumers"), the run publishes
`events.dropped` {count, reason, message} where they went missing: the
text deltas have a gap there; `run.completed`'s `output` is still the
whole answer, and it says how many went missing as `dropped` (said.py,
the gap rule of every API). The events themselves are written by
writers.RunEvents; a run records them.

A run's turn id is derived from its run id and the bearer key (retries.py),
and the run id names its session, so `GET /v1/runs/{id}` still answers
after the endpoint restarted and forgot the run: its status (queued,
running, completed with its `output`, failed, cancelled), read back from the
supervisor's turn journal, with `recovered: true`; its events are gone.
With an `Idempotency-Key`, `POST /v1/runs` sent again gets the same run id
and starts nothing new, before or after a restart: it is answered 202
{run_id, status (the run's now), replayed: true} with `Idempotency-Replayed:
true`, as upstream answers a replay.

An approval answer may name the request it answers (`approval.request`'s
`request_id`, also given as `approval_id`): as upstream's `request_id`, or
as hermes-webui's `approval_id`, where `""` means none (webui sends that
when the server does not advertise `approval_identity_v1`; Hermes 0.19
reads no id at all). A named answer reaches that request or none (409).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from hermes_sup.client import (
    ApprovalRequest,
    ApprovalTimeout,
    BadRequest,
    ClientError,
    Dropped,
    Duplicate,
    Event,
    Queued,
    Reply,
    Running,
)
from hermes_sup.protocol.chat_identity import ChatIdentityError, check_chat_identity

from .api import Api
from .errors import ApiError
from .idempotency import scope_of
from .keys import Tenant
from .logsafe import kv
from .responses import Stored
from .retries import derive, turn_id_of
from .run_media import MediaFile, media_response, record_media
from .sessions import (
    SESSION_KEY_HEADER,
    SessionRef,
    agent_model_of,
    check_id,
    decode_id,
    encode_id,
    history_of,
    tenant_of,
    text_of,
    turn_context,
)
from .stream import SSE_HEADERS
from .turns import IDLE, EventStream, Pump, next_item
from .writers import RunEvents

log = logging.getLogger("hermes_sup.httpapi")

ENDED = ("completed", "failed", "cancelled", "interrupted")
ENDS = tuple(f"run.{status}" for status in ENDED[1:])  # a run's last event, but completed
MEDIA = "media"  # a file made for the user (worker/media.py)
CHOICE_ALIASES = {"approve": "once", "approved": "once", "allow": "once"}
CHOICES = ("once", "session", "always", "deny")
MAX_REQUEST_ID = 256  # characters of an approval request's id, as upstream bounds it
REPLAYED_HEADER = "Idempotency-Replayed"
_CLOSE = object()  # a subscriber's stream ends after what it already has
_DROPPED = object()  # a subscriber fell too far behind


@dataclass
class Run:
    """One run: its status, its events so far, and who follows them."""

    id: str
    ref: SessionRef
    model: str
    max_events: int
    owner: str  # the namespace of the key that started it (keys.py `Tenant.prefix`)
    created_at: float = field(default_factory=time.time)
    status: str = "queued"
    turn: str | None = None
    approvals: list[str | None] = field(default_factory=list)  # waiting, oldest first
    writer: RunEvents = field(default_factory=RunEvents)  # its turn's events, as the run's
    media: list[MediaFile] = field(default_factory=list)  # files made for the user
    fields: dict[str, Any] = field(default_factory=dict)
    events: deque[dict[str, Any]] = field(init=False)
    subscribers: set[asyncio.Queue[Any]] = field(default_factory=set)
    updated_at: float = 0.0

    def __post_init__(self) -> None:
        self.events = deque(maxlen=self.max_events)
        self.updated_at = self.created_at

    @property
    def ended(self) -> bool:
        return self.status in ENDED

    @property
    def stopping(self) -> bool:
        """Asked to stop: its turn's end is a cancellation, however it ends."""
        return self.writer.stopping

    @stopping.setter
    def stopping(self, value: bool) -> None:
        self.writer.stopping = value

    def describe(self) -> dict[str, Any]:
        """GET /v1/runs/{id}."""
        return {
            "object": "hermes.run",
            "run_id": self.id,
            "status": self.status,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "session_id": self.ref.original,
            "model": self.model,
            **self.fields,
        }

    def set_status(self, status: str, **fields: Any) -> None:
        self.status = status
        self.updated_at = time.time()
        self.fields.update(fields)

    def record(self, event: dict[str, Any]) -> None:
        """One of its turn's events (writers.RunEvents): the run's status
        follows its end, then the event is published."""
        name = event["event"]
        if name == "run.completed" or name in ENDS:
            self.approvals.clear()
        if name == "run.completed":
            self.set_status("completed", output=event["output"], usage=event["usage"])
        elif name in ("run.failed", "run.interrupted"):
            self.set_status(name.removeprefix("run."), error=event["error"])
        elif name == "run.cancelled":
            self.set_status("cancelled")
        self.publish(name, **{k: v for k, v in event.items() if k != "event"})

    def publish(self, event: str, **data: Any) -> None:
        """Record an event and hand it to every subscriber."""
        record = {"event": event, "run_id": self.id, "timestamp": time.time(), **data}
        last = self.events[-1] if self.events else None
        if event == "message.delta" and last is not None and last["event"] == event:
            # Kept for late subscribers as one delta per stretch of text, so a
            # long reply costs the log one entry, not one per token.
            self.events[-1] = {**record, "delta": last["delta"] + record["delta"]}
        else:
            self.events.append(record)
        self.fields["last_event"] = event
        self.updated_at = record["timestamp"]
        for queue in list(self.subscribers):
            self._offer(queue, record)
        if self.ended:
            for queue in list(self.subscribers):
                self._offer(queue, _CLOSE)

    def _offer(self, queue: asyncio.Queue[Any], item: Any) -> None:
        try:
            queue.put_nowait(item)
        except asyncio.QueueFull:
            # Cut this subscriber off: what it has not read is dropped, so
            # memory stays bounded, and it is told when it reads again.
            self.subscribers.discard(queue)
            while not queue.empty():
                queue.get_nowait()
            queue.put_nowait(_DROPPED)

    def subscribe(self, size: int) -> asyncio.Queue[Any]:
        """A queue with every event so far, then each new one."""
        queue: asyncio.Queue[Any] = asyncio.Queue(max(size, len(self.events) + 1))
        for record in self.events:
            queue.put_nowait(record)
        if self.ended:
            queue.put_nowait(_CLOSE)
        else:
            self.subscribers.add(queue)
        return queue


# The body fields that make two POST /v1/runs the same run (with an Idempotency-Key).
RUN_FIELDS = (
    "input",
    "instructions",
    "conversation_history",
    "session_id",
    "previous_response_id",
    "session_env",
    "agent_model",
    "model",
)
# run_<32 hex>, and `.` and its session's id (base64url) when the run named one.
_RUN_ID = re.compile(r"run_([0-9a-f]{32})(?:\.([A-Za-z0-9_-]+))?")


def accepted(
    request: Request, ref: SessionRef, run_id: str, status: str, *, replayed: bool
) -> Response:
    """202 for POST /v1/runs: a new run (`started`), or, `replayed`, the
    run an Idempotency-Key named already, with its status now."""
    # The session's own key, as /v1/notices names it.
    headers = {"X-Hermes-Sup-Session": ref.key}
    if replayed:
        headers[REPLAYED_HEADER] = "true"
    key_header = request.headers.get(SESSION_KEY_HEADER, "").strip()
    if key_header:
        headers[SESSION_KEY_HEADER] = key_header
    body = {"run_id": run_id, "status": status, "replayed": replayed}
    return JSONResponse(body, 202, headers=headers)


def status_of(first: Event) -> str:
    """A replayed run's status from the first answer its turn gave again
    (the run's own events then say the rest)."""
    if isinstance(first, Queued):
        return "queued"
    if isinstance(first, Reply):
        data = first.data if isinstance(first.data, dict) else {}
        if data.get("cancelled") or data.get("interrupted"):
            return "cancelled"
        return "completed" if first.ok else "failed"
    return "running"


def named_request(body: dict[str, Any]) -> str | None:
    """The approval request an answer names, if any: upstream's
    `request_id`, or hermes-webui's `approval_id`, whose `""` names none."""
    request_id = body.get("request_id")
    approval_id = body.get("approval_id")
    if approval_id == "" or (isinstance(approval_id, str) and not approval_id.strip()):
        approval_id = None
    for value in (request_id, approval_id):
        if value is None:
            continue
        if not isinstance(value, str) or not value.strip() or len(value) > MAX_REQUEST_ID:
            raise ApiError(
                400,
                f"Approval request_id is invalid: expected the request's id "
                f"(a string of 1 to {MAX_REQUEST_ID} characters)",
                "invalid_approval_request",
            )
    if request_id is not None and approval_id is not None and request_id != approval_id:
        raise ApiError(
            400,
            "request_id and approval_id name two different approval requests",
            "invalid_approval_request",
        )
    named = request_id if request_id is not None else approval_id
    return named.strip() if isinstance(named, str) else None


def run_turn_id(request: Request, run_id: str) -> str:
    """The turn id of a run: derived from its id and the bearer key."""
    return derive(scope_of(request), "run", run_id)


class Runs:
    """Every run this endpoint knows, by id."""

    def __init__(self, api: Api, find_response: Callable[[Tenant, str], Stored | None]) -> None:
        self.api = api
        self.find_response = find_response  # a stored response a run may continue
        self.by_id: dict[str, Run] = {}

    def get(self, request: Request) -> Run:
        """The run a request names, if its key may reach it (its own, or
        any for an admin); else 404, as if it did not exist."""
        run_id = request.path_params["run_id"]
        run = self.by_id.get(run_id)
        tenant = tenant_of(request)
        if run is None or not (tenant.admin or run.owner == tenant.prefix):
            raise ApiError(404, f"Run not found: {run_id}", "run_not_found")
        return run

    def _sweep(self, owner: str) -> None:
        """Forget ended runs past their time to live, and `owner`'s oldest
        ended ones beyond its limit (one key's many never push out
        another's runs); a run still going is never forgotten."""
        s = self.api.settings
        now = time.time()
        for run in [r for r in self.by_id.values() if r.ended and now - r.updated_at > s.run_ttl]:
            del self.by_id[run.id]
        theirs = [r for r in self.by_id.values() if r.owner == owner]
        extra = len(theirs) - s.max_runs
        if extra > 0:
            ended = sorted((r for r in theirs if r.ended), key=lambda r: r.updated_at)
            for run in ended[:extra]:
                del self.by_id[run.id]

    # ------------------------------------------------------------ handlers

    async def create(self, request: Request) -> Response:
        api = self.api
        tenant = tenant_of(request)
        body = await api.read_json(request)
        raw_input = body.get("input")
        if not raw_input:
            raise ApiError(400, "Missing 'input' field", "missing_input")
        if isinstance(raw_input, list):
            last = raw_input[-1]
            content = last.get("content") if isinstance(last, dict) else last
            text = text_of(content, "input[-1].content")
        else:
            text = text_of(raw_input, "input")
        if not text.strip():
            raise ApiError(400, "No user message found in input", "missing_input")
        history = history_of(body, raw_input)
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise ApiError(400, "'instructions' must be a string", "invalid_instructions")
        session_id = body.get("session_id")
        if session_id is not None and not isinstance(session_id, str):
            raise ApiError(400, "'session_id' must be a string", "invalid_session_id")
        if session_id:
            check_id(session_id, "session ID", "'session_id'")
        # Who the turn is for (a gateway's chat): the worker's HERMES_SESSION_*.
        try:
            identity = check_chat_identity(body.get("session_env"), "'session_env'")
        except ChatIdentityError as exc:
            raise ApiError(400, str(exc), "invalid_session_env") from None
        agent_model = agent_model_of(body)  # the model the session's agent is to use
        # A stored response (POST /v1/responses) named as previous_response_id
        # continues its conversation, as in Hermes: same session, and its
        # instructions when the run gives none.
        previous = body.get("previous_response_id")
        stored = self.find_response(tenant, previous) if isinstance(previous, str) else None
        if stored is not None and instructions is None:
            instructions = stored.instructions
        named = api.header_ref(request, tenant)
        # With an Idempotency-Key, a retry is the same run (the same id, so
        # the same turn id) and starts nothing new.
        made = turn_id_of(request, "runs", body, RUN_FIELDS) or uuid.uuid4().hex
        run_id = f"run_{made}"
        if named is None and not session_id and stored is not None:
            ref, conversation = stored.ref, stored.conversation
        else:
            ref = named or api.ref(tenant, session_id or run_id)
            conversation = session_id or ref.original
        if ref.original != run_id:
            run_id = f"{run_id}.{encode_id(ref.original)}"  # its session, found again from it
        known = self.by_id.get(run_id)
        if known is not None and known.owner == tenant.prefix:
            return accepted(request, known.ref, run_id, known.status, replayed=True)
        model = api.model_of(body)
        self._sweep(tenant.prefix)
        context = turn_context(instructions, history, conversation)
        if identity:
            context["session_env"] = identity
        if agent_model:
            context["model"] = agent_model
        opened = await api.open_turn(ref, text, context, run_turn_id(request, run_id))
        run = Run(run_id, ref, model, api.settings.run_events, tenant.prefix)
        run.turn = opened.id
        self.by_id[run_id] = run
        log.info(kv("http_run", run=run_id, session=ref.key, turn=opened.id))

        async def record(item: Any) -> bool:
            self._record(run, item)
            return True

        Pump(opened, record, api.tasks)
        if opened.resumed:  # the run an endpoint restarted since had started
            return accepted(request, ref, run_id, status_of(opened.first), replayed=True)
        return accepted(request, ref, run_id, "started", replayed=False)

    def _record(self, run: Run, item: Event | ClientError) -> None:
        """A turn's event, as the run's status and events (writers.RunEvents)."""
        events = run.writer(item)
        if isinstance(item, Queued):
            run.set_status("queued")
        elif isinstance(item, (Running, Duplicate)):  # Duplicate: a retry joined it
            if not run.stopping:
                run.set_status("running")
        elif isinstance(item, Dropped):
            log.warning(kv("http_run_dropped", run=run.id, count=item.count))
        elif isinstance(item, ApprovalRequest):
            run.approvals.append(item.id)
            run.set_status("waiting_for_approval")
        elif isinstance(item, ApprovalTimeout):
            if item.id in run.approvals:
                run.approvals.remove(item.id)
            elif run.approvals:
                run.approvals.pop(0)
            if not run.stopping and not run.approvals:
                run.set_status("running")
        for event in events:
            run.record(event)
        if isinstance(item, Event) and item.type == MEDIA:
            media = record_media(self.by_id.values(), run, item.data)
            if media is not None:
                run.record(media)

    async def status(self, request: Request) -> Response:
        try:
            return JSONResponse(self.get(request).describe())
        except ApiError:
            recalled = await self._recall(request)
            if recalled is None:
                raise
            return JSONResponse(recalled)

    async def _recall(self, request: Request) -> dict[str, Any] | None:
        """The status of a run this endpoint no longer knows (restarted, or
        the run forgotten), from what the supervisor says of its turn; None
        if it knows nothing of it either. The run's id names its session
        and, with the bearer key, its turn: another key finds nothing."""
        run_id = request.path_params["run_id"]
        found = _RUN_ID.fullmatch(run_id)
        if found is None:
            return None
        original = run_id if found.group(2) is None else decode_id(found.group(2))
        if original is None:
            return None
        try:
            ref = self.api.ref(tenant_of(request), original)
        except ApiError:
            return None
        try:
            state = await self.api.client().turn_status(ref.key, run_turn_id(request, run_id))
        except BadRequest:
            return None  # not a session key the supervisor takes: no such run
        described: dict[str, Any] = {
            "object": "hermes.run",
            "run_id": run_id,
            "created_at": state.get("started"),
            "updated_at": state.get("ended") or state.get("started"),
            "session_id": ref.original,
            "model": self.api.settings.model,
            # Read back from the supervisor: the run's events are not kept.
            "recovered": True,
        }
        kind = state.get("state")
        if kind in ("queued", "running"):
            return {**described, "status": kind}
        if kind == "interrupted":
            # Cut by a restart before it ended: upstream's `interrupted`.
            error = "the run was interrupted: the supervisor running it stopped before it ended"
            return {
                **described,
                "status": "interrupted",
                "error": error,
                "last_event": "run.interrupted",
            }
        if kind != "ended":
            return None  # unknown: never started, or forgotten
        outcome = state.get("outcome") or {}
        answer = outcome.get("body")
        if not isinstance(answer, dict):
            # Too large to keep: it ended, how is no longer known.
            return {**described, "status": "completed", "output": None}
        if outcome.get("kind") == "error":
            return {**described, "status": "failed", "error": str(answer.get("message", ""))}
        raw = answer.get("data")
        data: dict[str, Any] = raw if isinstance(raw, dict) else {}
        text = str(answer.get("text", ""))
        if data.get("cancelled") or data.get("interrupted"):
            return {**described, "status": "cancelled"}
        if not answer.get("ok"):
            return {**described, "status": "failed", "error": text}
        return {**described, "status": "completed", "output": text}

    async def events(self, request: Request) -> Response:
        run = self.get(request)
        queue = run.subscribe(self.api.settings.stream_queue)
        return EventStream(
            self._stream(run, queue), media_type="text/event-stream", headers=SSE_HEADERS
        )

    async def _stream(self, run: Run, queue: asyncio.Queue[Any]) -> AsyncIterator[bytes]:
        try:
            while True:
                item = await next_item(queue, self.api.settings.keepalive)
                if item is IDLE:
                    yield b": keepalive\n\n"
                    continue
                if item is _CLOSE:
                    yield b": stream closed\n\n"
                    return
                if item is _DROPPED:
                    yield b": this stream fell too far behind and was closed; events were dropped\n\n"
                    return
                yield f"data: {json.dumps(item)}\n\n".encode()
        finally:
            run.subscribers.discard(queue)

    async def approval(self, request: Request) -> Response:
        run = self.get(request)
        body = await self.api.read_json(request)
        raw = str(body.get("choice", "")).strip().lower()
        choice = CHOICE_ALIASES.get(raw, raw)
        if choice not in CHOICES:
            raise ApiError(
                400,
                "Invalid approval choice; expected one of: once, session, always, deny",
                "invalid_approval_choice",
            )
        if run.ended or not run.approvals:
            raise ApiError(409, f"Run has no pending approval: {run.id}", "approval_not_pending")
        every = body.get("all") in (True, "true", 1) or body.get("resolve_all") in (True, "true", 1)
        # An answer may name its request (approval.request's request_id):
        # then it reaches that one or none, never a later command.
        named = named_request(body)
        targets: list[str | None]
        if named is not None:
            if named not in run.approvals:
                raise ApiError(
                    409,
                    f"Run has no pending approval {named[:80]!r}: {run.id}",
                    "approval_not_pending",
                )
            targets = [named]
        else:
            targets = list(run.approvals) if every else run.approvals[:1]
        resolved = 0
        # Oldest first, as Hermes resolves them; each answer names its request,
        # so it never reaches a command it was not meant for.
        for approval in targets:
            await self.api.client().approve(run.ref.key, choice, approval=approval)
            if approval in run.approvals:
                run.approvals.remove(approval)
            resolved += 1
        if not run.approvals:
            run.set_status("stopping" if run.stopping else "running")
        # The request it named, when it named one, as upstream says it.
        which = {} if named is None else {"request_id": named}
        run.publish("approval.responded", choice=choice, **which, resolved=resolved)
        return JSONResponse(
            {
                "object": "hermes.run.approval_response",
                "run_id": run.id,
                "choice": choice,
                **which,
                "resolved": resolved,
            }
        )

    async def media(self, request: Request) -> Response:
        """GET /v1/runs/{run_id}/media/{media_id}: a file its agent made."""
        run = self.get(request)  # 404 for a run the key may not reach
        return media_response(run.id, run.media, request.path_params["media_id"])

    async def stop(self, request: Request) -> Response:
        run = self.get(request)
        if run.ended:
            return JSONResponse({"run_id": run.id, "status": run.status})
        run.stopping = True
        run.set_status("stopping", last_event="run.stopping")
        try:
            await self.api.client().cancel(run.ref.key, run.turn)
        except ClientError as exc:
            log.warning(kv("http_run_stop_failed", run=run.id, error=exc))
        return JSONResponse({"run_id": run.id, "status": "stopping"})
