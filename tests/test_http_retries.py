"""Retries with an Idempotency-Key are the same turn (httpapi/retries.py):
a client whose stream was cut, or whose endpoint was killed and restarted
by its keeper, sends its request again and joins the running turn or reads
its answer; the turn never runs twice, and another key's retry never
reaches it. A real supervisor (probe runtime), its endpoint under its
keeper, over real HTTP on 127.0.0.1; the probe's `sh` appends to a file in
the session's workspace, so a test counts how often a turn ran."""

from __future__ import annotations

import json
import os
import re
import signal

import httpx
import pytest

from hermes_sup.httpapi.serve import RETRY_GRACE_ENV
from tests import test_http
from tests.test_http_tenancy import generate
from tests.waiting import wait_for

endpoint = test_http.endpoint
endpoint_factory = test_http.endpoint_factory

READY = re.compile(r"http_ready url=\S+ pid=(\d+)")
# A turn that says it ran (one line in ran.txt), then streams slowly for a while.
SLOW = "sh echo ran >> ran.txt; for i in 1 2 3 4 5 6 7 8 9 10; do echo line $i; sleep 0.3; done"


def endpoint_pids(endpoint) -> list[int]:
    return [int(pid) for pid in READY.findall(endpoint.log())]


def kill_endpoint(endpoint) -> None:
    """SIGKILL the endpoint process; return once its keeper started another."""
    pids = endpoint_pids(endpoint)
    os.kill(pids[-1], signal.SIGKILL)
    wait_for(lambda: len(endpoint_pids(endpoint)) > len(pids), 60, what="the endpoint's restart")

    def answers() -> bool:
        try:
            return httpx.get(endpoint.url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(answers, 60, what="the restarted endpoint")


def chat(text: str, stream: bool) -> dict:
    return {"model": "hermes-agent", "messages": [{"role": "user", "content": text}],
            "stream": stream}  # fmt: skip


def runs_of(endpoint, session: str) -> int:
    """How many times a turn of `session` ran (lines in its ran.txt)."""
    answer = httpx.post(
        endpoint.url + "/v1/chat/completions",
        json=chat("sh cat ran.txt", False),
        headers=endpoint.headers(**{"X-Hermes-Session-Id": session}),
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["message"]["content"].count("ran\n")


def read_stream(response: httpx.Response) -> tuple[list[dict], bool]:
    """The chunks of a chat completions stream, and whether it ended with [DONE]."""
    chunks = []
    for line in response.iter_lines():
        if line == "data: [DONE]":
            return chunks, True
        if line.startswith("data: "):
            chunks.append(json.loads(line[6:]))
    return chunks, False


def text_of(chunks: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def test_a_stream_cut_by_an_endpoint_restart_is_joined_by_its_retry_not_run_again(
    endpoint,
) -> None:
    headers = endpoint.headers(**{"Idempotency-Key": "cut-1", "X-Hermes-Session-Id": "cut"})
    url = endpoint.url + "/v1/chat/completions"
    with httpx.stream("POST", url, json=chat(SLOW, True), headers=headers, timeout=60) as first:
        assert first.status_code == 200
        lines = first.iter_lines()
        assert any("line 2" in line for line in lines), "the stream never got going"
        kill_endpoint(endpoint)  # mid-stream: the keeper starts another
        with pytest.raises(httpx.HTTPError):  # cut: no [DONE], no error
            rest = list(lines)
            assert "data: [DONE]" not in rest
            raise httpx.ReadError("ended without [DONE]")
    with httpx.stream("POST", url, json=chat(SLOW, True), headers=headers, timeout=60) as retry:
        assert retry.status_code == 200, retry.read()
        chunks, done = read_stream(retry)
    assert done, chunks
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop", chunks[-1]
    # It joined the turn running: its text is the reply, whole, at the end.
    assert text_of(chunks) == "exit 0"
    assert runs_of(endpoint, "cut") == 1


def test_a_stream_whose_client_hung_up_is_left_for_its_retry(endpoint) -> None:
    """Same endpoint, same supervisor connection: the turn is not cancelled
    when its client goes, and the retry takes it over."""
    headers = endpoint.headers(**{"Idempotency-Key": "hang-1", "X-Hermes-Session-Id": "hang"})
    url = endpoint.url + "/v1/chat/completions"
    with httpx.stream("POST", url, json=chat(SLOW, True), headers=headers, timeout=60) as first:
        for line in first.iter_lines():
            if "line 1" in line:
                break  # and hang up
    with httpx.stream("POST", url, json=chat(SLOW, True), headers=headers, timeout=60) as retry:
        assert retry.status_code == 200, retry.read()
        chunks, done = read_stream(retry)
    assert done and chunks[-1]["choices"][0]["finish_reason"] == "stop", chunks
    assert text_of(chunks) == "exit 0"
    assert runs_of(endpoint, "hang") == 1
    # Ended: a third try reads the recorded answer as a short stream.
    with httpx.stream("POST", url, json=chat(SLOW, True), headers=headers, timeout=60) as again:
        chunks, done = read_stream(again)
    assert done and text_of(chunks) == "exit 0"
    assert runs_of(endpoint, "hang") == 1


def test_a_whole_answer_repeated_after_an_endpoint_restart_is_the_same(endpoint) -> None:
    url = endpoint.url + "/v1/chat/completions"
    body = chat("sh echo ran >> ran.txt", False)
    headers = endpoint.headers(**{"Idempotency-Key": "whole-1"})  # no session named
    first = httpx.post(url, json=body, headers=headers, timeout=60)
    assert first.status_code == 200, first.text
    kill_endpoint(endpoint)
    again = httpx.post(url, json=body, headers=headers, timeout=60)
    assert again.status_code == 200, again.text
    assert again.json()["id"] == first.json()["id"]
    assert again.json()["choices"] == first.json()["choices"]
    # The conversation it made up is the same one, where it ran once.
    session = first.headers["X-Hermes-Session-Id"]
    assert again.headers["X-Hermes-Session-Id"] == session
    assert runs_of(endpoint, session) == 1


def test_another_key_with_the_same_idempotency_key_runs_its_own_turn(endpoint) -> None:
    bob = generate(endpoint, "bob")
    url = endpoint.url + "/v1/chat/completions"
    body = chat("context", False)  # says its conversation: which session it ran in
    alice = httpx.post(url, json=body, headers=endpoint.headers(**{"Idempotency-Key": "k"}),
                       timeout=60)  # fmt: skip
    theirs = httpx.post(url, json=body, headers=bob.headers(**{"Idempotency-Key": "k"}),
                        timeout=60)  # fmt: skip
    assert alice.status_code == theirs.status_code == 200, (alice.text, theirs.text)
    # Bob's turn ran in his own session: never alice's answer, nor her id.
    assert alice.json()["id"] != theirs.json()["id"]
    said = alice.json()["choices"][0]["message"]["content"]
    assert theirs.json()["choices"][0]["message"]["content"] != said
    # Nor after a restart, when only the supervisor remembers the turns.
    kill_endpoint(endpoint)
    later = httpx.post(url, json=body, headers=bob.headers(**{"Idempotency-Key": "k"}), timeout=60)
    assert later.json()["choices"] == theirs.json()["choices"]
    # The turn ids differ by key, whatever Idempotency-Key is guessed.
    from hermes_sup.httpapi.retries import derive

    assert derive("a" * 64, "chat", "k", "f") != derive("b" * 64, "chat", "k", "f")
    assert len(derive("a" * 64, "chat", "k", "f")) == 32


def test_a_run_is_found_after_an_endpoint_restart_and_not_started_twice(endpoint) -> None:
    bob = generate(endpoint, "bob")
    body = {"input": "sh echo ran >> ran.txt; sleep 1; echo done", "session_id": "runs-1"}
    headers = endpoint.headers(**{"Idempotency-Key": "run-1"})
    made = httpx.post(endpoint.url + "/v1/runs", json=body, headers=headers, timeout=60)
    assert made.status_code == 202, made.text
    run_id = made.json()["run_id"]
    kill_endpoint(endpoint)
    status = endpoint.url + f"/v1/runs/{run_id}"

    def ended() -> dict | None:
        answer = httpx.get(status, headers=endpoint.headers(), timeout=30)
        assert answer.status_code == 200, answer.text
        found = answer.json()
        return found if found["status"] == "completed" else None

    found = wait_for(ended, 60, what="the run to complete")
    assert found["output"] == "exit 0" and found["recovered"] is True
    assert found["session_id"] == "runs-1"
    # Sent again, the same run: nothing new starts.
    again = httpx.post(endpoint.url + "/v1/runs", json=body, headers=headers, timeout=60)
    assert again.status_code == 202 and again.json()["run_id"] == run_id
    assert runs_of(endpoint, "runs-1") == 1
    # Another key finds nothing of it.
    assert httpx.get(status, headers=bob.headers(), timeout=30).status_code == 404


def test_a_turn_whose_endpoint_died_and_no_retry_came_is_cancelled(endpoint_factory) -> None:
    """The endpoint is SIGKILLed mid-stream and nobody retries: the supervisor
    cancels the turn once the endpoint has been gone its retry grace (the
    send's orphan_grace), so no turn runs on unseen."""
    os.environ[RETRY_GRACE_ENV] = "1"
    try:
        endpoint = endpoint_factory()
    finally:
        del os.environ[RETRY_GRACE_ENV]
    headers = endpoint.headers(**{"X-Hermes-Session-Id": "gone"})
    url = endpoint.url + "/v1/chat/completions"
    body = chat("sh echo ran >> ran.txt; echo started; sleep 60", True)
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as first:
        # Held, not dropped: a dropped line iterator closes the stream, and a
        # client that hangs up has its turn cancelled by the endpoint itself.
        lines = first.iter_lines()
        assert any("started" in line for line in lines), "the turn never started"
        kill_endpoint(endpoint)

    def idle() -> bool:
        with endpoint.sup.client() as c:
            return [row["state"] for row in c.sessions()] == ["idle"]

    wait_for(idle, 60, what="the orphaned turn cancelled")
    log = endpoint.sup.log()
    assert "turn_orphaned" in log, log[-4000:]
    assert runs_of(endpoint, "gone") == 1


def test_a_reused_turn_id_the_supervisor_refuses_is_the_clients_error_not_ours() -> None:
    """`replayed` (an Idempotency-Key's turn id already used for a send the
    supervisor saw differently, as a fuzzed body that changes only what the
    fingerprint leaves out): 422, never a 500."""
    from hermes_sup.client import SupervisorError
    from hermes_sup.httpapi.errors import from_client_error

    err = from_client_error(SupervisorError("replayed", "a resend must repeat the send"))
    assert (err.status, err.code) == (422, "replayed")
