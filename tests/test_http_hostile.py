"""The HTTP endpoint against hostile clients: what each one sends is
refused (OpenAI-shaped, with the status that says why) or made harmless,
never a 500, a traceback, a turn whose answer cannot be sent or a forged
log line; and `/health` answers for everyone else meanwhile. A real
supervisor (probe runtime) and endpoint over real HTTP on 127.0.0.1."""

from __future__ import annotations

import json

import httpx

from tests import test_http

# test_http's fixtures: a supervisor (probe runtime) serving the endpoint too.
endpoint = test_http.endpoint
endpoint_factory = test_http.endpoint_factory


def assert_error(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["message"] and error["type"], error
    assert "Traceback" not in response.text
    return error


def forged(log: str, event: str) -> list[str]:
    """Lines of the log that begin with `event`: written by a client."""
    return [line for line in log.splitlines() if line.startswith(event)]


def sessions_of(endpoint) -> list[dict]:
    with endpoint.sup.client() as client:
        return client.sessions()


def test_deep_or_broken_json_is_a_400(endpoint) -> None:
    chat = endpoint.url + "/v1/chat/completions"
    auth = endpoint.headers(**{"Content-Type": "application/json"})
    deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    error = assert_error(httpx.post(chat, content=deep, headers=auth), 400, "invalid_json")
    assert "nested too deeply" in error["message"]
    # Deep enough to pass the parser, too deep for what comes after it.
    nested = {
        "messages": [{"role": "user", "content": "hi"}],
        "x": json.loads("[" * 200 + "]" * 200),
    }
    assert_error(httpx.post(chat, json=nested, headers=auth), 400, "invalid_json")
    for lone in (b'"\\ud800"', b'"x\\udfff"'):
        body = b'{"messages": [{"role": "user", "content": ' + lone + b"}]}"
        error = assert_error(httpx.post(chat, content=body, headers=auth), 400, "invalid_json")
        assert "surrogate" in error["message"]
    run_id = b'{"input": "pid", "session_id": "\\udc00"}'
    assert_error(httpx.post(endpoint.url + "/v1/runs", content=run_id, headers=auth), 400,
                 "invalid_json")  # fmt: skip
    assert_error(httpx.post(chat, content=b'{"a": "\xed\xa0\x80"}', headers=auth), 400,
                 "invalid_json")  # fmt: skip
    # A pair of surrogates is one character, and fine.
    pair = b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}'
    ok = httpx.post(chat, content=pair, headers=auth)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "\U0001f600"
    assert "Traceback" not in endpoint.log() and "bug" not in endpoint.log().split()
