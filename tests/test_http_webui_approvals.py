"""hermes-webui's approvals on the runs backend
(`HERMES_WEBUI_GATEWAY_USE_RUNS_API=1`), against a real supervisor and
endpoint: the probe runtime, whose `ask COMMAND` waits for an approval,
and the real Hermes agent (the fake model server), whose `rm -rf` does.

Each request is the one hermes-webui sends (nesquena/hermes-webui):
`api/config.py`'s capability probe, `api/gateway_chat.py`'s run start and
its events stream (read to its end, the event named by the payload's
`event`), and `api/runner_client.py`'s answer, `{"choice", "approval_id"}`,
where `approval_id` is the id `approval.request` gave only when the server
advertises `approval_identity_v1`, else `""` (api/routes.py,
`_relay_gateway_run_approval`). webui shows any answer but a 2xx JSON
object as `502 gateway_approval_relay_failed`, and the command then waits
out its approval timeout, denied.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests import test_http

endpoint = test_http.endpoint
endpoint_factory = test_http.endpoint_factory

try:  # the Hermes test's fixture: without hermes-agent, that test alone is skipped
    from tests.test_http_hermes import hermes_http  # noqa: F401
except pytest.skip.Exception:

    @pytest.fixture
    def hermes_http() -> None:
        pytest.skip("hermes-agent is not installed")


ENDS = ("run.completed", "run.failed", "run.cancelled")


@dataclass
class WebuiRun:
    """What webui saw of one run: its events, and each approval it answered
    with the answer's status and body."""

    run_id: str
    events: list[dict[str, Any]] = field(default_factory=list)
    answers: list[tuple[int, Any]] = field(default_factory=list)
    sent: list[dict[str, Any]] = field(default_factory=list)


class Webui:
    """hermes-webui's gateway chat backend on the runs API, for one chat."""

    def __init__(self, url: str, key: str, session_id: str) -> None:
        self.url, self.key, self.session_id = url, key, session_id

    def identity_v1(self) -> bool:
        """api/config.py `get_gateway_caps`: the features it reads."""
        caps = httpx.get(
            self.url + "/v1/capabilities", headers={"Authorization": f"Bearer {self.key}"}
        )
        features = caps.json().get("features") or {}
        assert features.get("approval_events") and features.get("run_approval_response")
        return bool(features.get("approval_identity_v1"))

    def _chat_headers(self) -> dict[str, str]:
        return {
            "Content-Type": "application/json",
            "Accept": "application/json",
            "X-Hermes-Session-Id": self.session_id,
            "Authorization": f"Bearer {self.key}",
            "X-Hermes-Session-Key": f"webui:{self.session_id}",
        }

    def run(self, text: str, choice: str, identity_v1: bool) -> WebuiRun:
        """Send `text` as a run, answer its approval with `choice` the moment
        it shows, and read the events to the stream's end."""
        started = httpx.post(
            self.url + "/v1/runs",
            json={"model": "default", "input": text, "session_id": self.session_id},
            headers=self._chat_headers(),
        )
        assert started.is_success, started.text
        run_id = str(started.json().get("run_id") or started.json().get("id") or "")
        assert run_id
        seen = WebuiRun(run_id)
        headers = {**self._chat_headers(), "Accept": "text/event-stream"}
        # webui reads until the stream ends: one that stayed open past the
        # run's end would hang its chat until this read timeout.
        timeout = httpx.Timeout(30, read=60)
        with httpx.stream(
            "GET", f"{self.url}/v1/runs/{run_id}/events", headers=headers, timeout=timeout
        ) as response:
            assert response.status_code == 200
            named = "message"
            for raw in response.iter_lines():
                line = raw.strip()
                if not line:
                    named = "message"
                    continue
                if line.startswith("event:"):
                    named = line[6:].strip() or "message"
                    continue
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                payload = json.loads(data)
                seen.events.append(payload)
                kind = str(payload.get("event") or payload.get("type") or named)
                if kind == "approval.request":
                    raw_id = str(payload.get("approval_id") or payload.get("id") or "").strip()
                    sending = raw_id if identity_v1 and raw_id else ""
                    seen.answers.append(self.respond(run_id, sending, choice))
                    seen.sent.append({"choice": choice, "approval_id": sending})
        assert seen.events and seen.events[-1]["event"] in ENDS, seen.events
        return seen

    def respond(self, run_id: str, approval_id: str, choice: str) -> tuple[int, Any]:
        """api/runner_client.py `respond_approval`, with its headers."""
        answer = httpx.post(
            f"{self.url}/v1/runs/{run_id}/approval",
            content=json.dumps({"choice": choice, "approval_id": approval_id}).encode(),
            headers={
                "Accept": "application/json",
                "Content-Type": "application/json",
                "User-Agent": "Hermes-WebUI-RunnerClient",
                "Authorization": f"Bearer {self.key}",
            },
        )
        return answer.status_code, answer.json()


def test_webuis_approve_once_session_and_always_run_the_command(endpoint) -> None:
    """Each of webui's choices answers 200 and the command runs, whether
    webui names the request (it does when `approval_identity_v1` is
    advertised) or sends `approval_id: ""` (it did before; Hermes 0.19
    answers that 200, and we answered 409); deny answers 200 and runs
    nothing."""
    webui = Webui(endpoint.url, endpoint.key, "wa1")
    assert webui.identity_v1()  # so webui names the request it answers
    made = []
    for identity_v1 in (True, False):
        for choice in ("once", "session", "always", "deny"):
            name = f"{choice}-{'named' if identity_v1 else 'blank'}.txt"
            seen = webui.run(f"ask touch {name}", choice, identity_v1)
            request = next(e for e in seen.events if e["event"] == "approval.request")
            assert request["approval_id"] and request["command"] == f"touch {name}"
            assert seen.sent == [
                {"choice": choice, "approval_id": request["approval_id"] if identity_v1 else ""}
            ]
            assert len(seen.answers) == 1
            status, body = seen.answers[0]
            assert status == 200 and isinstance(body, dict), (choice, identity_v1, body)
            assert body["choice"] == choice and body["resolved"] == 1
            responded = [e for e in seen.events if e["event"] == "approval.responded"]
            assert [e["choice"] for e in responded] == [choice]
            ended = seen.events[-1]
            assert ended["event"] == "run.completed"
            if choice == "deny":
                assert ended["output"] == f"denied: touch {name}"
            else:
                assert ended["output"] == "exit 0"
                made.append(name)
    with endpoint.sup.client() as hs:
        shown = hs.run(endpoint.session("webui:wa1"), "sh ls").events
    printed = "\n".join(e.line for e in shown if isinstance(getattr(e, "line", None), str))
    assert sorted(printed.split()) == sorted(made)


def test_a_late_answer_from_a_second_webui_tab_is_refused(endpoint) -> None:
    """A second tab answers a request the first one already did: a clear
    409 webui can show, and the run ended as the first answer chose."""
    webui = Webui(endpoint.url, endpoint.key, "wa2")
    seen = webui.run("ask touch twice.txt", "once", identity_v1=True)
    assert seen.events[-1]["event"] == "run.completed" and seen.events[-1]["output"] == "exit 0"
    request = next(e for e in seen.events if e["event"] == "approval.request")
    for named in (request["approval_id"], ""):
        status, body = webui.respond(seen.run_id, named, "deny")
        assert status == 409 and body["error"]["code"] == "approval_not_pending"


def test_webuis_session_and_always_approvals_hold_in_hermes(hermes_http) -> None:  # noqa: F811
    """With the real Hermes agent (`rm -rf` needs approval): once asks again
    next time; session and always let the same kind of command run on in that
    session without asking, as Hermes's own approvals do."""
    url, key, _ = hermes_http

    def run(webui: Webui, command: str, choice: str = "deny", named: bool = True) -> WebuiRun:
        seen = webui.run(f"run: {command}", choice, identity_v1=named)
        assert all(status == 200 for status, _ in seen.answers), seen.answers
        assert seen.events[-1]["event"] == "run.completed", seen.events
        return seen

    for choice, named in (("session", True), ("always", False)):
        webui = Webui(url, key, f"wh-{choice}")
        run(webui, "mkdir -p a b c && echo made")
        once = run(webui, "rm -rf a", "once", named)
        assert len(once.answers) == 1  # asked, answered
        asked = run(webui, "rm -rf b", choice, named)
        assert len(asked.answers) == 1  # once held for one command only: asked again
        kept = run(webui, "rm -rf c")  # would be denied if asked
        assert kept.answers == [], kept.events
        listed = run(webui, "ls")
        output = listed.events[-1]["output"]
        assert '"output": ""' in output, output  # a, b and c all gone
