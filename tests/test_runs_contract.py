"""The runs API's contract, field by field, against Hermes's own servers.

Each test names the source its fields come from:
- Hermes 0.19, the hermes-agent the project pins:
  gateway/platforms/api_server.py (`_handle_runs`, `_handle_run_approval`,
  `_SECURITY_HEADERS`, `_handle_capabilities`);
- upstream's newer runs API, read from NousResearch/hermes-agent at commit
  005b4b7607e918cd4a301970144878167d1841d7,
  gateway/platforms/api_server_runs.py (`_accepted_response`,
  `_handle_run_approval`, `_durable_run_status`, `_make_run_event_callback`,
  `_SUBAGENT_EVENT_KEYS`, `_http_routes`);
- hermes-webui (nesquena/hermes-webui, api/runner_client.py
  `respond_approval`, api/_cfg/gateway.py `approval_identity_v1`): the body
  its approval relay sends.

Writers are fed events by hand; the app is driven in process with a fake
supervisor client where no turn runs; the approvals and replays run a real
supervisor (probe runtime) behind the endpoint over HTTP.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from hermes_sup.client import ApprovalRequest, Event, Reply, SupervisorError, Token, ToolStart
from hermes_sup.httpapi.app import create_app
from hermes_sup.httpapi.errors import ApiError
from hermes_sup.httpapi.info import RUNS_IDEMPOTENCY
from hermes_sup.httpapi.keys import KeyStore
from hermes_sup.httpapi.runs import Run, named_request
from hermes_sup.httpapi.said import GAP_EVENT, Said
from hermes_sup.httpapi.security_headers import SECURITY_HEADERS
from hermes_sup.httpapi.sessions import SessionRef
from hermes_sup.httpapi.settings import ApiSettings
from hermes_sup.httpapi.writers import (
    SUBAGENT_TEXT_LIMIT,
    ChatChunks,
    RunEvents,
    wants_custom_events,
)
from tests import test_http

endpoint = test_http.endpoint
endpoint_factory = test_http.endpoint_factory

UPSTREAM = "NousResearch/hermes-agent@005b4b7607e918cd4a301970144878167d1841d7"


def runs(items: list[Any]) -> list[dict[str, Any]]:
    writer = RunEvents()
    return [event for item in items for event in writer(item)]


def progress(event: str, **fields: Any) -> Event:
    """A tool-progress event as worker/hermes.py's `_on_tool_progress` sends it."""
    return Event("tool_progress", {"event": event, "tool": None, "args": None, **fields})


# ------------------------------------------------------------ run events


def test_an_approval_request_names_its_request_both_ways() -> None:
    """Upstream's approval.request carries the request's `request_id`;
    hermes-webui reads `approval_id` (api/route_approvals.py)."""
    request = ApprovalRequest("approval", {}, command="rm x", choices=("once", "deny"), id="h-1")
    (event,) = runs([request])
    assert event["event"] == "approval.request"
    assert event["request_id"] == event["approval_id"] == "h-1"


def test_subagent_lifecycle_events_carry_upstreams_fields() -> None:
    """UPSTREAM api_server_runs.py `_make_run_event_callback`: subagent.start
    and subagent.complete are published with `_SUBAGENT_EVENT_KEYS`; the
    child's text, thinking and tool calls are not. The fields are the ones
    0.19's tools/delegate_tool.py gives the parent's progress callback."""
    start = progress(
        "subagent.start",
        preview="find the bug",
        goal="find the bug",
        subagent_id="sa-1",
        task_index=0,
        task_count=2,
        depth=1,
        unknown_field="kept off the wire",
    )
    complete = progress(
        "subagent.complete",
        preview="found it",
        status="completed",
        summary="x" * (SUBAGENT_TEXT_LIMIT + 100),
        duration_seconds=1.5,
        input_tokens=10,
        output_tokens=3,
        api_calls=2,
        files_read=["a.py"],
        subagent_id="sa-1",
    )
    chatter = [progress("subagent.text", preview="hi"), progress("subagent.tool", preview="ls")]
    events = runs([start, *chatter, complete, Reply("reply", None, text="ok")])
    assert [e["event"] for e in events] == ["subagent.start", "subagent.complete", "run.completed"]
    started, completed = events[0], events[1]
    assert started == {
        "event": "subagent.start",
        "preview": "find the bug",
        "goal": "find the bug",
        "task_count": 2,
        "task_index": 0,
        "subagent_id": "sa-1",
        "depth": 1,
    }
    assert completed["status"] == "completed" and completed["files_read"] == ["a.py"]
    assert (completed["input_tokens"], completed["output_tokens"], completed["api_calls"]) == (
        10,
        3,
        2,
    )
    assert len(completed["summary"]) == SUBAGENT_TEXT_LIMIT  # a session's text, bounded


def test_a_subagents_secret_is_redacted_where_hermes_can_tell() -> None:
    """UPSTREAM: free text (goal, summary, output_tail) is secret-redacted."""
    pytest.importorskip("agent.redact")
    secret = "sk-ant-api03-" + "A" * 40
    (event,) = runs([progress("subagent.complete", summary=f"the key is {secret}")])
    assert secret not in json.dumps(event)


def test_a_turn_its_supervisors_restart_cut_ends_interrupted() -> None:
    """UPSTREAM `_durable_run_status`: a run cut by a restart reads
    `interrupted`, `last_event: run.interrupted`, with an error."""
    cut = SupervisorError("interrupted", "the supervisor stopped before the turn ended")
    (event,) = runs([Token("token", text="partial"), cut])[1:]
    assert event["event"] == "run.interrupted" and "supervisor stopped" in event["error"]
    run = Run("run_1", SessionRef("k", "run_1"), "m", 10, "owner")
    run.record(event)
    described = run.describe()
    assert described["status"] == "interrupted" and run.ended
    assert described["last_event"] == "run.interrupted" and described["error"]
    other = runs([SupervisorError("turn_failed", "boom")])
    assert other[-1]["event"] == "run.failed"


# ------------------------------------------------------------ approval ids


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"choice": "once"}, None),
        ({"choice": "once", "approval_id": ""}, None),  # webui without identity_v1
        ({"choice": "once", "approval_id": "  "}, None),
        ({"choice": "once", "approval_id": "h-1"}, "h-1"),  # webui with identity_v1
        ({"choice": "once", "request_id": "h-2"}, "h-2"),  # upstream
        ({"choice": "once", "request_id": " h-2 ", "approval_id": ""}, "h-2"),
    ],
)
def test_an_answer_names_its_request_by_either_field(body: dict[str, Any], named: Any) -> None:
    assert named_request(body) == named


@pytest.mark.parametrize(
    "body",
    [
        {"request_id": ""},  # UPSTREAM: an empty request_id is invalid (400)
        {"request_id": "x" * 257},
        {"request_id": 7},
        {"approval_id": ["h-1"]},
        {"request_id": "h-1", "approval_id": "h-2"},
    ],
)
def test_a_malformed_request_id_is_refused_with_its_name(body: dict[str, Any]) -> None:
    with pytest.raises(ApiError) as refused:
        named_request(body)
    assert refused.value.status == 400 and refused.value.code == "invalid_approval_request"
    assert "request" in refused.value.message


# ------------------------------------------------------------ custom SSE frames

TOOL = ToolStart("tool_start", {"emoji": "💻", "label": "ls"}, id="c1", name="terminal", args={})


def chat_events(custom: bool) -> list[Any]:
    from hermes_sup.client import Dropped

    writer = ChatChunks(Said(), "chatcmpl-1", 7, "m", custom)
    items = [
        TOOL,
        Dropped("dropped", count=1, reason="slow_consumer"),
        Reply("reply", None, text="ok"),
    ]
    return writer.start() + [e for item in items for e in writer(item)]


def test_a_plain_openai_client_never_gets_a_frame_without_choices() -> None:
    """The `llm` CLI fails on a frame without `choices`: only a client that
    asks gets Hermes's `hermes.tool.progress` and gap frames."""
    plain = chat_events(custom=False)
    assert all(e.data == "[DONE]" or "choices" in e.data for e in plain)
    assert plain[-2].data["hermes"]["dropped"] == 1  # the gap still stated, in a chunk
    asked = [e.event for e in chat_events(custom=True)]
    assert "hermes.tool.progress" in asked and GAP_EVENT in asked


@pytest.mark.parametrize(
    ("headers", "query", "wanted"),
    [
        ({}, {}, False),  # the openai SDK, litellm, langchain, llm
        ({"X-Hermes-Session-Id": "w1"}, {}, True),  # hermes-webui's chat backend
        ({"X-Hermes-Events": "1"}, {}, True),
        ({"X-Hermes-Events": "no"}, {}, False),
        ({}, {"hermes_events": "true"}, True),
        ({"X-Hermes-Session-Id": " "}, {}, False),
    ],
)
def test_who_asks_for_custom_frames(headers: dict, query: dict, wanted: bool) -> None:
    assert wants_custom_events(httpx.Headers(headers), query) is wanted


# ------------------------------------------------------------ the app, in process


class FakeClient:
    """The supervisor client as far as these routes use it."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str]] = []

    async def turn_status(self, session: str, turn: str, timeout: float | None = None) -> dict:
        self.asked.append((session, turn))
        return {"state": "interrupted", "started": 1.0, "ended": None}

    async def ping(self, timeout: float | None = None) -> Any:
        raise SupervisorError("internal", "no supervisor here")

    async def close(self) -> None:
        pass


@pytest.fixture
def app(tmp_path: Path) -> tuple[TestClient, dict[str, str], FakeClient]:
    keys = KeyStore(tmp_path)
    key = keys.generate("test")
    fake = FakeClient()
    client = TestClient(create_app(ApiSettings(), keys, lambda: fake))  # type: ignore[arg-type,return-value]
    return client, {"Authorization": f"Bearer {key}"}, fake


def test_a_run_its_supervisors_restart_cut_reads_interrupted(app) -> None:
    """UPSTREAM `_durable_run_status`: status `interrupted`, `last_event:
    run.interrupted` and an error, for a run read back after a restart."""
    client, auth, fake = app
    run_id = "run_" + "a" * 32
    status = client.get(f"/v1/runs/{run_id}", headers=auth)
    assert status.status_code == 200, status.text
    body = status.json()
    assert fake.asked and body["recovered"] is True
    assert (body["status"], body["last_event"]) == ("interrupted", "run.interrupted")
    assert "stopped before it ended" in body["error"]


def test_every_answer_carries_hermes_security_headers(app) -> None:
    """0.19 api_server.py `_SECURITY_HEADERS`, on every response including
    errors: 401, 404, 405, a refused body, and the routes that answer."""
    client, auth, _ = app
    answers = [
        client.get("/v1/models"),  # 401
        client.get("/v1/models", headers=auth),
        client.get("/nowhere", headers=auth),
        client.get("/v1/runs", headers=auth),  # 405
        client.post("/v1/runs", headers=auth, content=b"{not json"),
        client.get("/health"),  # 503: no supervisor
    ]
    for answer in answers:
        for name, value in SECURITY_HEADERS:
            assert answer.headers.get(name.decode()) == value.decode(), (answer.url, name)
    assert answers[0].headers["x-frame-options"] == "DENY"
    assert answers[0].headers["x-content-type-options"] == "nosniff"


def test_capabilities_say_exactly_what_is_served(app) -> None:
    """0.19 `_handle_capabilities`, and UPSTREAM's features `run_steer`,
    `runs_idempotency` and webui's `approval_identity_v1`: every endpoint
    named answers here, and what is not served is not named."""
    client, auth, _ = app
    caps = client.get("/v1/capabilities", headers=auth).json()
    features, endpoints = caps["features"], caps["endpoints"]
    assert features["approval_identity_v1"] is True
    assert features["run_steer"] is False and "run_steer" not in endpoints
    assert features["runs_idempotency"] == RUNS_IDEMPOTENCY
    assert features["runs_idempotency"]["supported"] and features["runs_idempotency"]["durable"]
    routes = {
        (method, route.path)
        for route in client.app.routes  # type: ignore[attr-defined]
        for method in getattr(route, "methods", None) or ()
    }
    for name, where in endpoints.items():
        assert (where["method"], where["path"]) in routes, name
    assert not any(path.endswith("/steer") for _, path in routes)


def test_the_journal_keeps_as_many_turns_as_capabilities_say() -> None:
    from hermes_sup.supervisor.journal import JOURNAL_TURNS

    assert RUNS_IDEMPOTENCY["retention_turns"] == JOURNAL_TURNS


# ------------------------------------------------------------ a real supervisor


def start_run(endpoint, text: str, **headers: str) -> httpx.Response:
    return httpx.post(
        endpoint.url + "/v1/runs",
        json={"input": text, "session_id": "contract"},
        headers=endpoint.headers(**headers),
        timeout=30,
    )


def answer(endpoint, run_id: str, body: dict[str, Any]) -> httpx.Response:
    url = f"{endpoint.url}/v1/runs/{run_id}/approval"
    return httpx.post(url, json=body, headers=endpoint.headers(), timeout=30)


def test_webui_approves_with_an_empty_approval_id_and_with_its_id(endpoint) -> None:
    """hermes-webui's relay sends {choice, approval_id}: "" without
    approval_identity_v1 (0.19 reads no id and answers 200), the
    approval.request's id with it; UPSTREAM names it `request_id`, echoed in
    the answer and in approval.responded."""
    run_events = test_http.run_events
    first = start_run(endpoint, "ask touch first.txt").json()["run_id"]
    run_events(endpoint, first, "approval.request")
    empty = answer(endpoint, first, {"choice": "once", "approval_id": ""})
    assert empty.status_code == 200, empty.text
    assert empty.json() == {
        "object": "hermes.run.approval_response",
        "run_id": first,
        "choice": "once",
        "resolved": 1,
    }
    assert run_events(endpoint, first, "run.completed")[-1]["output"] == "exit 0"

    second = start_run(endpoint, "ask touch second.txt").json()["run_id"]
    request = run_events(endpoint, second, "approval.request")[-1]
    wrong = answer(endpoint, second, {"choice": "once", "approval_id": "not-this-one"})
    assert wrong.status_code == 409 and wrong.json()["error"]["code"] == "approval_not_pending"
    bad = answer(endpoint, second, {"choice": "once", "request_id": ""})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_approval_request"
    named = answer(endpoint, second, {"choice": "deny", "request_id": request["request_id"]})
    assert named.status_code == 200, named.text
    assert named.json()["request_id"] == request["request_id"] == request["approval_id"]
    events = run_events(endpoint, second, "run.completed")
    responded = [e for e in events if e["event"] == "approval.responded"]
    assert responded[-1]["request_id"] == request["request_id"]
    assert events[-1]["output"] == "denied: touch second.txt"


def test_an_idempotent_resubmit_is_answered_replayed(endpoint) -> None:
    """UPSTREAM `_accepted_response`: 202 {run_id, status, replayed} and,
    for a replay, `Idempotency-Replayed: true`; the run is not started twice."""
    first = start_run(endpoint, "echo once", **{"Idempotency-Key": "k-1"})
    assert first.status_code == 202
    assert first.json()["replayed"] is False and first.json()["status"] == "started"
    assert "idempotency-replayed" not in first.headers
    run_id = first.json()["run_id"]
    test_http.run_events(endpoint, run_id, "run.completed")
    again = start_run(endpoint, "echo once", **{"Idempotency-Key": "k-1"})
    assert again.status_code == 202
    assert again.headers["Idempotency-Replayed"] == "true"
    assert again.json() == {"run_id": run_id, "status": "completed", "replayed": True}
    for name, value in SECURITY_HEADERS:
        assert again.headers[name.decode()] == value.decode()
