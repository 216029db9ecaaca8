"""The HTTP endpoint against hostile clients: what each one sends is
refused (OpenAI-shaped, with the status that says why) or made harmless,
never a 500, a traceback, a turn whose answer cannot be sent or a forged
log line; and `/health` answers for everyone else meanwhile. A real
supervisor (probe runtime) and endpoint over real HTTP on 127.0.0.1."""

from __future__ import annotations

import json
import resource
import socket
import subprocess
import sys

import httpx

from hermes_sup.httpapi.keys import KeyStore
from tests import test_http
from tests.waiting import wait_for

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


def test_a_padded_conversation_is_refused_before_its_turn(endpoint) -> None:
    """Its name would be echoed in X-Hermes-Session-Id, which an answer's
    header cannot carry: refused, and no turn ran for it."""
    responses = endpoint.url + "/v1/responses"
    for name in (" padded", "padded ", "\tpadded"):
        body = {"input": "sh touch ran.txt", "conversation": name}
        error = assert_error(httpx.post(responses, json=body, headers=endpoint.headers()), 400,
                             "invalid_session_id")  # fmt: skip
        assert "conversation" in error["message"]
        streamed = httpx.post(responses, json={**body, "stream": True}, headers=endpoint.headers())
        assert_error(streamed, 400, "invalid_session_id")
    assert sessions_of(endpoint) == []  # no session was even started
    fine = httpx.post(responses, json={"input": "pid", "conversation": "in ner"},
                      headers=endpoint.headers())  # fmt: skip
    assert fine.status_code == 200 and fine.json()["status"] == "completed"


def test_client_strings_never_forge_a_log_line(endpoint) -> None:
    url = endpoint.url
    # A path is percent-decoded before it is logged (an unknown key here).
    httpx.get(url + "/v1/runs/x%0Aforged_path%20k=1", headers={"Authorization": "Bearer no"})
    # An id with a newline is refused, and never logged as it came.
    body = {"input": "pid", "session_id": "s\nforged_run k=1"}
    assert_error(httpx.post(url + "/v1/runs", json=body, headers=endpoint.headers()), 400,
                 "invalid_session_id")  # fmt: skip
    conversation = {"input": "pid", "conversation": "c\nforged_conversation k=1"}
    assert_error(httpx.post(url + "/v1/responses", json=conversation, headers=endpoint.headers()),
                 400, "invalid_session_id")  # fmt: skip
    # A terminal escape is shown escaped.
    httpx.get(url + "/v1/runs/x%1B]0;owned%07", headers={"Authorization": "Bearer no"})
    # A session is hostile too: the command it asks approval for is logged.
    chat = {"messages": [{"role": "user", "content": "ask true\nforged_command k=1"}]}
    denied = httpx.post(url + "/v1/chat/completions", json=chat, headers=endpoint.headers())
    assert denied.json()["choices"][0]["message"]["content"].startswith("denied")
    log = endpoint.log()
    for event in ("forged_path", "forged_run", "forged_conversation", "forged_command"):
        assert forged(log, event) == [], log
    assert "\x1b" not in log and "\\x1b]0;owned\\x07" in log
    assert "true\\nforged_command" in log


def test_the_web_dir_serves_no_dotfile_and_nothing_outside_it(endpoint_factory, workdir) -> None:
    web = workdir / "web"
    (web / ".git").mkdir(parents=True)
    (web / "index.html").write_text("<html>page</html>")
    (web / "app.js").write_text("// app")
    (web / ".env").write_text("OPENAI_API_KEY=sk-secret-web")
    (web / ".git" / "config").write_text("[secret]")
    (workdir / "outside.txt").write_text("secret-outside")
    (web / "env.txt").symlink_to(web / ".env")  # a name without a dot, leading to one
    (web / "out.txt").symlink_to(workdir / "outside.txt")
    endpoint = endpoint_factory("--http-web", str(web))
    assert httpx.get(endpoint.url + "/").text == "<html>page</html>"
    assert httpx.get(endpoint.url + "/app.js").status_code == 200
    for path in ("/.env", "/%2eenv", "/.git/config", "/.git/", "/env.txt", "/out.txt",
                 "/..%2foutside.txt", "/x/..%2f..%2foutside.txt"):  # fmt: skip
        answer = httpx.get(endpoint.url + path)
        assert answer.status_code == 404, (path, answer.text)
        assert "secret" not in answer.text and answer.json()["error"]["code"] == "not_found"


def test_the_own_origin_counts_only_when_the_host_is_an_address(endpoint) -> None:
    """A DNS-rebinding page sends its own name as Origin and Host alike."""
    chat = endpoint.url + "/v1/chat/completions"
    turn = {"messages": [{"role": "user", "content": "hello"}]}
    port = httpx.URL(endpoint.url).port
    for host in (f"127.0.0.1:{port}", f"localhost:{port}"):
        own = {"Host": host, "Origin": f"http://{host}"}
        assert httpx.post(chat, json=turn, headers=endpoint.headers(**own)).status_code == 200
    rebound = {"Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}"}
    assert_error(httpx.post(chat, json=turn, headers=endpoint.headers(**rebound)), 403,
                 "origin_not_allowed")  # fmt: skip
    # Without an Origin it is no browser's request: the Host is not what is checked.
    plain = endpoint.headers(Host=f"evil.example:{port}")
    assert httpx.post(chat, json=turn, headers=plain).status_code == 200


def few_files() -> None:
    """In the endpoint's process: 256 descriptors, as a small container has."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(4096, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True  # reset


def test_half_open_connections_are_closed_and_health_answers_meanwhile(supervisor, workdir) -> None:
    """Slowloris: more silent or slow connections than the endpoint has
    descriptors. Health checks still get answers while they are open (one
    more connection closes the longest idle one), and each is closed once
    its request's head is late; a body that trickles is given up on too."""
    key = KeyStore(supervisor.data_dir).generate("test")
    log_path = workdir / "endpoint.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hermes_sup.httpapi", "--state-dir", str(supervisor.state_dir),
             "--data-dir", str(supervisor.data_dir), "--listen", "127.0.0.1:0",
             "--header-timeout", "2", "--body-timeout", "2"],
            stdout=log, stderr=subprocess.STDOUT, preexec_fn=few_files,
        )  # fmt: skip
    attackers: list[socket.socket] = []
    try:
        base = test_http.wait_ready(log_path, proc)
        url = httpx.URL(base)
        address = (url.host, url.port)
        for i in range(400):
            sock = socket.create_connection(address, timeout=10)
            if i % 2:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and never the rest
            attackers.append(sock)
        with httpx.Client(timeout=10) as http:
            for _ in range(10):
                health = http.get(base + "/health", headers={"Connection": "close"})
                assert health.status_code == 200 and health.json()["status"] == "ok"
        wait_for(lambda: all(closed_by_peer(s) for s in attackers), 60,
                 what="the server to close every half-open connection")  # fmt: skip

        def answer_to(data: bytes) -> bytes:
            with socket.create_connection(address, timeout=30) as raw:
                raw.sendall(data)
                answer = b""
                while piece := raw.recv(65536):
                    answer += piece
                return answer

        slow_body = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            + f"Authorization: Bearer {key}\r\n".encode()
            + b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
        )
        answer = answer_to(slow_body)
        assert answer.startswith(b"HTTP/1.1 408") and b'"body_timeout"' in answer, answer
        garbage = answer_to(b"NOT HTTP AT ALL\r\n\r\n")
        head, _, body = garbage.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head, garbage
        assert json.loads(body)["error"]["code"] == "invalid_http_request"
    finally:
        for sock in attackers:
            sock.close()
        proc.terminate()
        proc.wait(15)
