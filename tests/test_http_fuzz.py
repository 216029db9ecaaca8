"""Fuzzing the HTTP endpoint: hypothesis makes the requests (bodies shaped
like the API's and not, headers, session ids and conversation names, paths,
raw request heads) and sends them to a real endpoint in front of a real
supervisor (probe runtime). Whatever comes in: never a 500, never a
traceback in an answer, every error OpenAI-shaped JSON, and the endpoint's
log holds no bug.

Every text that can become a turn starts with `fuzz`, which the probe
echoes: a generated `sh ...` or `sleep ...` is never run."""

from __future__ import annotations

import collections
import json
import os
import socket
from collections import Counter
from typing import Any
from urllib.parse import quote

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import test_http

STATS = collections.Counter()
endpoint = test_http.endpoint
endpoint_factory = test_http.endpoint_factory


# Requests through the API, and as many raw request heads; more for a long
# hunt with HSUP_FUZZ_EXAMPLES=5000.
EXAMPLES = int(os.environ.get("HSUP_FUZZ_EXAMPLES", "500"))
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)

# Strings that broke an endpoint once, or might: controls, padding, a lone
# surrogate, a long one, path tricks, what looks like another key's session.
NASTY = [
    "",
    " ",
    " padded ",
    "\t",
    "a\nforged k=1",
    "\x00",
    "\x1b]0;t\x07",
    "\ud800",
    "x" * 300,
    "../../etc/passwd",
    "a/b",
    "..",
    "webui:1",
    "test+000000000000+x",
    "telegram:-100",
    "api-0123456789abcdef",
    "résumé ☃",
    "run_nope",
    "resp_nope",
]
strings = st.one_of(st.sampled_from(NASTY), st.text(max_size=40))
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), strings)
json_any = st.recursive(
    json_leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(strings, inner, max_size=4)
    ),
    max_leaves=12,
)
# A turn's text: what the probe echoes.
turn_text = st.text(max_size=30).map(lambda t: "fuzz " + t)
content = st.one_of(
    turn_text,
    st.lists(
        st.one_of(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["text", "input_text"]), "text": turn_text}
            ),  # fmt: skip
            json_any,
        ),
        min_size=1,
        max_size=3,
    ).map(lambda parts: [{"type": "text", "text": "fuzz"}, *parts]),
    json_any,
)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]),
        "content": content,
    },  # fmt: skip
    optional={"name": strings},
)
# The last message a user's, so that most requests reach a turn.
messages = st.tuples(st.lists(message, max_size=4), turn_text).map(
    lambda pair: [*pair[0], {"role": "user", "content": pair[1]}]
)
maybe = st.one_of(json_any, strings)


def shaped(required: dict[str, Any], optional: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Bodies with the fields a turn needs (mostly), others maybe, or none."""
    return st.one_of(
        st.fixed_dictionaries(required, optional=optional),
        st.fixed_dictionaries(required, optional=optional),
        st.fixed_dictionaries({}, optional={**required, **optional}),
    )


bodies = {
    "/v1/chat/completions": shaped(
        {"messages": st.one_of(messages, messages, json_any)},
        {
            "stream": st.one_of(st.booleans(), maybe),
            "model": maybe,
        },
    ),
    "/v1/responses": shaped(
        {"input": st.one_of(turn_text, messages, json_any)},
        {
            "instructions": maybe,
            "conversation": st.one_of(strings, st.fixed_dictionaries({"id": strings}), maybe),
            "previous_response_id": maybe,
            "conversation_history": st.one_of(st.lists(message, max_size=3), json_any),
            "store": maybe,
            "stream": st.one_of(st.booleans(), maybe),
        },
    ),
    "/v1/runs": shaped(
        {"input": st.one_of(turn_text, messages, json_any)},
        {
            "session_id": maybe,
            "instructions": maybe,
            "previous_response_id": maybe,
            "conversation_history": st.one_of(st.lists(message, max_size=3), json_any),
        },
    ),
}


def segment(text: str) -> str:
    """`text` as a path segment, percent-encoded byte by byte (a lone
    surrogate as the bytes it would be)."""
    return quote(text.encode("utf-8", "surrogatepass"), safe="")


ids = st.one_of(st.sampled_from(NASTY), st.text(max_size=20))
api_posts = st.sampled_from(list(bodies)).map(lambda p: ("POST", p))
paths = st.one_of(
    api_posts,
    api_posts,
    st.tuples(
        st.sampled_from(["GET", "POST", "DELETE", "PUT", "OPTIONS"]),
        st.one_of(
            ids.map(lambda i: "/v1/runs/" + segment(i)),
            ids.map(lambda i: f"/v1/runs/{segment(i)}/events"),
            ids.map(lambda i: f"/v1/runs/{segment(i)}/stop"),
            ids.map(lambda i: f"/v1/runs/{segment(i)}/approval"),
            ids.map(lambda i: "/v1/responses/" + segment(i)),
            st.sampled_from(
                [
                    "/health",
                    "/v1/models",
                    "/v1/capabilities",
                    "/",
                    "/.env",
                    "/%2e%2e/%2e%2e/etc/passwd",
                    "/v1/",
                    "/v1/chat/completions",
                ]
            ),
            st.text(max_size=30).map(lambda t: "/" + segment(t)),
        ),
    ),
)
# Header values an HTTP client sends: no CR, LF or NUL, no space at either
# end (httpx refuses those; the raw request heads below have them), any
# other byte, as latin-1.
header_values = st.one_of(
    st.sampled_from([n for n in NASTY if n.isascii() and n == n.strip() and n.isprintable()]),
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF), max_size=40),
).map(lambda v: v.strip(" \t").encode("latin-1"))
extra_headers = st.dictionaries(
    st.sampled_from(
        [
            "X-Hermes-Session-Id",
            "X-Hermes-Session-Key",
            "Idempotency-Key",
            "Origin",
            "Content-Type",
            "Accept",
        ]
    ),  # fmt: skip
    header_values,
    max_size=3,
)


def assert_answer_fine(response: httpx.Response, what: Any) -> None:
    """No 500, no traceback; an error is OpenAI-shaped JSON."""
    text = response.text
    assert response.status_code < 500 or response.status_code in (502, 503, 504), (what, text)
    assert "Traceback" not in text, (what, text)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"], (what, text)
        assert isinstance(error["type"], str) and error["type"], (what, text)
        assert "code" in error and "param" in error, (what, text)


def test_fuzzed_requests_get_no_500_and_openai_shaped_errors(endpoint) -> None:
    http = httpx.Client(base_url=endpoint.url, timeout=60)
    auths = [endpoint.headers()] * 6 + [{"Authorization": "Bearer hsk-nope"}, {}]
    statuses: Counter[int] = Counter()
    own = endpoint.url  # the origin of the endpoint's own page

    @FUZZ_SETTINGS
    @given(
        route=paths,
        data=st.data(),
        auth=st.sampled_from(auths),
        headers=extra_headers,
        origin=st.integers(0, 4).flatmap(
            lambda n: header_values if n == 4 else st.just(own.encode()) if n == 3 else st.none()
        ),
        raw=st.integers(0, 4).flatmap(lambda n: st.binary(max_size=64) if n == 4 else st.none()),
    )
    def one(route, data, auth, headers, origin, raw) -> None:  # noqa: ANN001
        method, path = route
        body = data.draw(bodies.get(path, json_any)) if method == "POST" else None
        sent = {**headers, **auth, **({"Origin": origin} if origin is not None else {})}
        if raw is not None and method == "POST":
            content = raw
        elif body is not None:
            content = json.dumps(body).encode()  # lone surrogates escaped, as clients send them
        else:
            content = None
        request = http.build_request(method, path, content=content, headers=sent)
        response = http.send(request, stream=True)
        try:
            response.read()  # a stream is read to its end
        finally:
            response.close()
        assert_answer_fine(response, (method, path, sent, body, raw))
        statuses[response.status_code] += 1

    try:
        one()
    finally:
        http.close()
    # Most requests reach a turn (the fuzzing is of what comes after the
    # checks too), and the rest are refused for what they are.
    assert statuses[200] + statuses[202] > EXAMPLES // 20, statuses
    log = endpoint.log()
    assert "Traceback" not in log and " bug " not in log, log[-5000:]
    assert httpx.get(endpoint.url + "/health").json()["status"] == "ok"


request_heads = st.one_of(
    st.binary(max_size=200),
    st.tuples(
        st.sampled_from([b"GET", b"POST", b"DELETE", b"G\x00T", b"", b"HEAD"]),
        st.binary(max_size=40).map(lambda b: b"/" + b),
        st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2", b"HTTP/9.9", b""]),
        st.lists(st.binary(max_size=40), max_size=4),
    ).map(lambda p: b" ".join(p[:3]) + b"\r\n" + b"".join(h + b"\r\n" for h in p[3]) + b"\r\n"),
)


def test_fuzzed_request_heads_are_answered_as_json_or_closed(endpoint) -> None:
    address = (httpx.URL(endpoint.url).host, httpx.URL(endpoint.url).port)

    @FUZZ_SETTINGS
    @given(head=request_heads)
    def one(head: bytes) -> None:
        with socket.create_connection(address, timeout=30) as raw:
            raw.sendall(head)
            raw.shutdown(socket.SHUT_WR)
            answer = b""
            while piece := raw.recv(65536):
                answer += piece
        assert b"Traceback" not in answer and b" 500 " not in answer.partition(b"\r\n")[0]
        if answer:
            status_line, _, rest = answer.partition(b"\r\n")
            headers, _, body = rest.partition(b"\r\n\r\n")
            status = int(status_line.split()[1])
            if status >= 400 and body:
                assert b"application/json" in headers.lower(), answer
                error = json.loads(body.split(b"\r\n\r\n")[0])["error"]
                assert error["message"] and error["type"], answer

    one()
    log = endpoint.log()
    assert "Traceback" not in log and " bug " not in log, log[-5000:]
    assert httpx.get(endpoint.url + "/health").json()["status"] == "ok"
