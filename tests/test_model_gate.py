"""The supervisor's model endpoint (supervisor/model_gate.py): its `handle`
served by a real asyncio server on 127.0.0.1 (as the session proxy calls
it), in front of the fake model or a scripted upstream, driven by the
openai client, httpx and raw sockets as a hostile session would."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from hermes_sup.supervisor import configfile, model_gate, model_meter
from hermes_sup.supervisor.model_gate import Gate, Upstream, worker_agent_config

from .fake_model import FakeModel

OPERATOR_KEY = "sk-operator-secret-4f1d"
SESSION = "webui+0123456789ab+chat-1"


class Loop:
    """An asyncio loop in a thread of its own, for the gate's servers."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def close(self) -> None:
        async def settle() -> None:
            # Connections still held open (kept alive by a client) end here.
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)

        self.run(settle())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class GateServer:
    """A listener whose connections go to `gate.handle` as the session
    proxy hands them over: the first head read, the rest in the stream."""

    def __init__(self, loop: Loop, gate: Gate, session: str = SESSION) -> None:
        self.loop, self.gate, self.session = loop, gate, session

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                writer.close()
                return
            await gate.handle(self.session, reader, writer, head)

        self.server = loop.run(asyncio.start_server(serve, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/model/v1"

    def close(self) -> None:
        async def stop() -> None:
            self.server.close()
            await self.server.wait_closed()

        self.loop.run(stop())

    def raw(self, data: bytes) -> bytes:
        """Send `data` on a fresh connection; everything answered until close."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=30) as sock:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            out = b""
            while chunk := sock.recv(65536):
                out += chunk
        return out


class Scripted:
    """An upstream answering every request with `answer` (raw bytes), and
    recording each request head it got."""

    def __init__(self, loop: Loop, answer: bytes) -> None:
        self.heads: list[bytes] = []
        self.bodies: list[bytes] = []
        self.loop = loop

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            self.heads.append(head)
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            self.bodies.append(await reader.readexactly(length))
            writer.write(answer)
            await writer.drain()
            writer.close()

        self.server = loop.run(asyncio.start_server(serve, "127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1"

    def close(self) -> None:
        async def stop() -> None:
            self.server.close()
            await self.server.wait_closed()

        self.loop.run(stop())


@pytest.fixture
def loop() -> Iterator[Loop]:
    made = Loop()
    yield made
    made.close()


@pytest.fixture
def fake() -> Iterator[FakeModel]:
    model = FakeModel()
    yield model
    model.close()


Make = Callable[..., GateServer]


@pytest.fixture
def gate_for(loop: Loop) -> Iterator[Make]:
    """gate_for(base_url, budgets={}, session=SESSION, key=OPERATOR_KEY, header=None)."""
    made: list[GateServer] = []

    def make(
        base_url: str,
        budgets: dict[str, int] | None = None,
        session: str = SESSION,
        key: str | None = OPERATOR_KEY,
        header: str | None = None,
    ) -> GateServer:
        config: dict[str, Any] = {"base_url": base_url}
        if key:
            config["api_key"] = key
        if header:
            config["api_key_header"] = header
        upstream = Upstream.from_config(config)
        gate = Gate(lambda s: upstream, lambda: budgets or {})
        server = GateServer(loop, gate, session)
        made.append(server)
        return server

    yield make
    for server in made:
        server.close()


def _metered(gate: Gate, session: str, requests: int) -> model_meter.Meter:
    """The session's meter once `requests` calls are counted in it whole
    (the client may read a response's last byte before the gate counts it)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        meter = gate.meter(session)
        if meter is not None and meter.requests == requests and gate.idle():
            return meter
        time.sleep(0.01)
    raise AssertionError(f"{session} never had {requests} calls counted: {gate.meter(session)}")


def _openai(url: str, key: str = "sk-the-sessions-own") -> Any:
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=30)


# ------------------------------------------------------------------ the key


def test_the_operators_key_is_sent_upstream_and_the_sessions_own_is_not(
    gate_for: Make, fake: FakeModel
) -> None:
    server = gate_for(fake.url)
    reply = _openai(server.url).chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}]
    )
    assert reply.choices[0].message.content == "echo: hi (turn 1)"
    assert fake.auth == [f"Bearer {OPERATOR_KEY}"]


def test_every_credential_header_a_session_sends_is_dropped(loop: Loop, gate_for: Make) -> None:
    upstream = Scripted(loop, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    try:
        server = gate_for(upstream.url, header="x-api-key")
        answer = server.raw(
            b"POST /model/v1/messages HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer stolen\r\n"
            b"X-Api-Key: stolen\r\napi-key: stolen\r\nProxy-Authorization: Basic c3RvbGVu\r\n"
            b"Cookie: stolen=1\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
        )
    finally:
        upstream.close()
    assert answer.endswith(b"\r\n\r\nok")
    head = upstream.heads[0].decode()
    assert "stolen" not in head and "c3RvbGVu" not in head
    assert f"x-api-key: {OPERATOR_KEY}" in head
    assert "Authorization" not in head
    assert head.startswith("POST /v1/messages HTTP/1.1\r\n")
    assert f"Host: 127.0.0.1:{upstream.url.split(':')[2].split('/')[0]}" in head
    assert upstream.bodies == [b"{}"]


def test_a_worker_of_no_session_is_refused(gate_for: Make, fake: FakeModel) -> None:
    server = gate_for(fake.url, session="(spare)")
    answer = server.raw(b"GET /model/v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 403 ") and b"serves no session" in answer
    assert server.gate.meter("(spare)") is None


def test_no_configured_endpoint_answers_404_naming_it(loop: Loop) -> None:
    server = GateServer(loop, Gate(lambda s: None))
    try:
        answer = server.raw(b"GET /model/v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
    finally:
        server.close()
    assert answer.startswith(b"HTTP/1.1 404 ")
    assert b"no model endpoint configured" in answer


# ------------------------------------------------------------------ paths and heads


@pytest.mark.parametrize(
    "target",
    [
        "/model/v1/../admin",
        "/model/v1/%2e%2e/admin",
        "/model/v1/%2E%2e/%2e%2e/etc",
        "/model/v1/..%2fadmin",
        "/model/v1%2f..%2fadmin",
        "/model/v1/.%2e/x",
        "/model/v1/a\\..\\b",
        "/model/v2/chat/completions",
        "/model/v1x/chat/completions",
        "/model/../v1/models",
        "/modelx/v1/models",
        "http://169.254.169.254/model/v1/models",
        "//evil.example/model/v1",
    ],
)
def test_a_path_outside_the_endpoint_is_refused_and_never_forwarded(
    loop: Loop, gate_for: Make, target: str
) -> None:
    upstream = Scripted(loop, b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
    try:
        server = gate_for(upstream.url)
        answer = server.raw(f"GET {target} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    finally:
        upstream.close()
    assert answer.startswith((b"HTTP/1.1 403 ", b"HTTP/1.1 400 ")), answer
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["message"]
    assert upstream.heads == []


@pytest.mark.parametrize(
    ("head", "fault"),
    [
        (b"GARBAGE\r\n\r\n", b"request line is not METHOD TARGET HTTP/1.1"),
        (b"GET /model/v1/models HTTP/9.9\r\n\r\n", b"not HTTP/1.0 or HTTP/1.1"),
        (b"G(T /model/v1/models HTTP/1.1\r\n\r\n", b"method is not a token"),
        (b"GET /model/v1/models HTTP/1.1\r\nno colon here\r\n\r\n", b"malformed header line"),
        (b"GET /model/v1/models HTTP/1.1\r\n folded: x\r\n\r\n", b"malformed header line"),
        (
            b"POST /model/v1/x HTTP/1.1\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"both Content-Length and Transfer-Encoding",
        ),
        (b"POST /model/v1/x HTTP/1.1\r\nContent-Length: -1\r\n\r\n", b"is not a number"),
        (
            b"POST /model/v1/x HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
            b"content-length given twice",
        ),
        (b"POST /model/v1/x HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", b"only chunked"),
        (b"GET /model/v1/\xff HTTP/1.1\r\n\r\n", b"not ASCII"),
        (b"GET /model/v1/a%00b HTTP/1.1\r\n\r\n", b"control character"),
    ],
)
def test_a_malformed_head_gets_400_naming_the_fault(
    loop: Loop, gate_for: Make, head: bytes, fault: bytes
) -> None:
    upstream = Scripted(loop, b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
    try:
        server = gate_for(upstream.url)
        answer = server.raw(head)
    finally:
        upstream.close()
    assert answer.startswith(b"HTTP/1.1 400 "), answer
    assert fault in answer, answer
    assert upstream.heads == []


def test_a_huge_body_is_refused_before_any_byte_goes_upstream(loop: Loop, gate_for: Make) -> None:
    upstream = Scripted(loop, b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
    try:
        server = gate_for(upstream.url)
        length = model_gate.MAX_BODY + 1
        answer = server.raw(
            f"POST /model/v1/x HTTP/1.1\r\nContent-Length: {length}\r\n\r\n".encode()
        )
    finally:
        upstream.close()
    assert answer.startswith(b"HTTP/1.1 413 ")
    assert upstream.heads == []


# ------------------------------------------------------------------ metering


def test_usage_of_a_json_answer_is_metered_for_the_session_and_its_key(
    gate_for: Make, fake: FakeModel
) -> None:
    server = gate_for(fake.url)
    client = _openai(server.url)
    for text in ("one", "two"):
        client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": text}]
        )
    session = _metered(server.gate, SESSION, 2)
    assert (session.requests, session.input_tokens, session.output_tokens) == (2, 20, 20)
    assert session.bytes_in > 0 and session.bytes_out > 0
    assert server.gate.keys["webui"].tokens == 40
    assert server.gate.describe()["webui"]["tokens"] == 40


SSE_WITH_USAGE = (
    b'data: {"choices":[{"index":0,"delta":{"content":"hel"}}]}\n\n'
    b'data: {"choices":[{"index":0,"delta":{"content":"lo"}}]}\n\n'
    b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10}}\n\n'
    b"data: [DONE]\n\n"
)
ANTHROPIC_SSE = (
    b"event: message_start\n"
    b'data: {"type":"message_start","message":{"usage":{"input_tokens":25,"output_tokens":1}}}\n\n'
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","delta":{"text":"hi"}}\n\n'
    b"event: message_delta\n"
    b'data: {"type":"message_delta","usage":{"output_tokens":15}}\n\n'
)


def _chunked(body: bytes, size: int = 17) -> bytes:
    pieces = [body[i : i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


@pytest.mark.parametrize(
    ("framing", "body", "tokens"),
    [
        ("chunked", SSE_WITH_USAGE, (7, 3)),
        ("length", SSE_WITH_USAGE, (7, 3)),
        ("close", SSE_WITH_USAGE, (7, 3)),
        ("chunked", ANTHROPIC_SSE, (25, 15)),
    ],
)
def test_an_event_stream_passes_unchanged_and_its_usage_is_metered(
    loop: Loop, gate_for: Make, framing: str, body: bytes, tokens: tuple[int, int]
) -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
    if framing == "chunked":
        answer = head + b"Transfer-Encoding: chunked\r\n\r\n" + _chunked(body)
    elif framing == "length":
        answer = head + b"Content-Length: %d\r\n\r\n" % len(body) + body
    else:
        answer = head + b"Connection: close\r\n\r\n" + body
    upstream = Scripted(loop, answer)
    try:
        server = gate_for(upstream.url)
        with httpx.Client(timeout=30) as client:
            with client.stream(
                "POST", server.url + "/chat/completions", json={"stream": True}
            ) as response:
                got = b"".join(response.iter_bytes())
                assert response.headers["content-type"] == "text/event-stream"
    finally:
        upstream.close()
    assert got == body
    meter = _metered(server.gate, SESSION, 1)
    assert (meter.input_tokens, meter.output_tokens) == tokens


def test_a_streamed_openai_call_works_through_the_gate(gate_for: Make, fake: FakeModel) -> None:
    server = gate_for(fake.url)
    stream = _openai(server.url).chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "streamed"}], stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == "echo: streamed (turn 1)"
    assert fake.auth == [f"Bearer {OPERATOR_KEY}"]


def test_one_connection_carries_several_requests(gate_for: Make, fake: FakeModel) -> None:
    server = gate_for(fake.url)
    ports = set()
    with httpx.Client(timeout=30) as client:
        for _ in range(3):
            response = client.get(server.url + "/models", extensions={"trace": None})
            assert response.json()["data"][0]["id"] == "fake-model"
            stream = response.extensions.get("network_stream")
            if stream is not None:
                ports.add(stream.get_extra_info("client_addr"))
    assert _metered(server.gate, SESSION, 3).requests == 3
    assert len(ports) <= 1


# ------------------------------------------------------------------ budgets


def test_a_key_over_its_budget_is_refused_with_an_error_the_openai_client_shows(
    gate_for: Make, fake: FakeModel
) -> None:
    openai = pytest.importorskip("openai")
    server = gate_for(fake.url, budgets={"webui": 15})
    client = _openai(server.url)
    # The first call is allowed (15 left) and spends 20.
    client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "a"}])
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "b"}]
        )
    assert "budget of HTTP key 'webui' is spent" in str(refused.value)
    assert refused.value.code == "budget_exceeded"
    assert len(fake.requests) == 1
    assert _metered(server.gate, SESSION, 2).refused == 1


def test_the_star_budget_holds_every_key_not_named_and_sessions_of_no_key_are_free(
    gate_for: Make, fake: FakeModel
) -> None:
    openai = pytest.importorskip("openai")
    other = gate_for(fake.url, budgets={"*": 5, "big": 1000}, session="other+00000000000a+x")
    keyless = gate_for(fake.url, budgets={"*": 5}, session="telegram:42")
    for server in (other, keyless):
        _openai(server.url).chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "a"}]
        )
    with pytest.raises(openai.RateLimitError):
        _openai(other.url).chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "a"}]
        )
    _openai(keyless.url).chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "a"}]
    )
    assert _metered(keyless.gate, "telegram:42", 2).requests == 2


def test_budgets_are_checked_when_the_settings_are_read(tmp_path: Any) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[model_budgets]\nwebui = 1_000_000\n")
    assert configfile.load(path) == {"model_budgets": {"webui": "1000000"}}
    assert model_meter.parse_budgets({"webui": "1000000"}) == {"webui": 1000000}
    path.write_text('[model_budgets]\nwebui = "lots"\n')
    with pytest.raises(configfile.ConfigError, match="'lots' is not a positive number of tokens"):
        configfile.load(path)
    path.write_text("[model_budgets]\nwebui = 0\n")
    with pytest.raises(configfile.ConfigError, match="webui"):
        configfile.load(path)


# ------------------------------------------------------------------ what the worker is told


SEALED = {"mode": "root", "network": "egress"}


def test_a_worker_with_its_own_network_gets_the_proxy_and_a_placeholder_not_the_key() -> None:
    operator = {"base_url": "https://api.example.com/v1", "api_key": OPERATOR_KEY, "model": "m"}
    for network in ("egress", "none"):
        told = worker_agent_config(operator, {}, {**SEALED, "network": network})
        assert told["base_url"] == "http://127.0.0.1:3128/model/v1"
        assert told["api_key"] == model_gate.PLACEHOLDER_KEY
        assert OPERATOR_KEY not in json.dumps(told)
        assert told["model"] == "m"
    root = worker_agent_config({"base_url": "http://h:8000", "api_key": "k"}, {}, SEALED)
    assert root["base_url"] == "http://127.0.0.1:3128/model"


def test_a_worker_sharing_the_hosts_network_or_unsealed_keeps_todays_config() -> None:
    operator = {"base_url": "https://api.example.com/v1", "api_key": OPERATOR_KEY}
    assert worker_agent_config(operator, {}, None) == operator
    assert worker_agent_config(operator, {}, {**SEALED, "network": "host"}) == operator
    # No base_url: the supervisor has nowhere to forward to.
    assert worker_agent_config({"api_key": OPERATOR_KEY}, {}, SEALED)["api_key"] == OPERATOR_KEY


def test_a_session_naming_its_own_endpoint_gets_no_operator_key_sealed_or_not() -> None:
    operator = {"base_url": "https://api.example.com/v1", "api_key": OPERATOR_KEY}
    own = {"base_url": "https://collector.example.net/v1"}
    for seal in (None, SEALED):
        told = worker_agent_config(operator, own, seal)
        assert told == {"base_url": "https://collector.example.net/v1"}
    # The operator's own endpoint named again is no other endpoint.
    same = worker_agent_config(operator, {"base_url": operator["base_url"]}, SEALED)
    assert same["api_key"] == model_gate.PLACEHOLDER_KEY


def test_the_key_header_setting_is_the_gates_and_never_reaches_the_worker() -> None:
    operator = {"base_url": "https://a/v1", "api_key": "k", "api_key_header": "x-api-key"}
    assert "api_key_header" not in worker_agent_config(operator, {}, None)
    upstream = Upstream.from_config(operator)
    assert upstream is not None and upstream.credential() == ("x-api-key", "k")


def test_where_a_key_would_still_reach_every_worker_is_said(tmp_path: Any) -> None:
    (tmp_path / ".env").write_text("OPENROUTER_API_KEY=x\n")
    said = model_gate.exposure_warnings(
        {"api_key": OPERATOR_KEY}, ["OPENAI_API_KEY", "LANG_EXTRA"], str(tmp_path)
    )
    assert len(said) == 3
    assert "no base_url" in said[0]
    assert "OPENAI_API_KEY" in said[1]
    assert ".env" in said[2]
    configured = {"base_url": "https://a/v1", "api_key": OPERATOR_KEY}
    assert model_gate.exposure_warnings(configured, ["TZ"], None) == []


def test_model_calls_are_counted_in_metrics_by_key_and_shown_by_inspect() -> None:
    pytest.importorskip("prometheus_client")
    from hermes_sup.cli.show import model_line
    from hermes_sup.supervisor.metrics import Metrics

    metrics = Metrics(lambda: {})
    metrics.count_model_call("webui", "ok", (7, 3), 100, 200)
    metrics.count_model_call(None, "refused", (0, 0), 50, 0)
    value = metrics.registry.get_sample_value
    assert value("hermes_sup_model_requests_total", {"key": "webui", "outcome": "ok"}) == 1
    assert value("hermes_sup_model_tokens_total", {"key": "webui", "direction": "output"}) == 3
    assert value("hermes_sup_model_bytes_total", {"key": "", "direction": "in"}) == 50
    use = {**model_meter.Meter(2, 1, 10, 20, 7, 3).describe(), "http_key": "webui"}
    assert model_line(use) == (
        "2 call(s), 7 tokens in, 3 out, 10 bytes sent, 20 received, 1 refused (budget); "
        "HTTP key webui"
    )
    assert "no calls" in model_line(None)
