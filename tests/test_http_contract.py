"""Two parts of Hermes's API-server contract: browser origins (CORS) and
`Idempotency-Key`. The cache's rules with a fake clock; then a real
supervisor (probe runtime) and endpoint over real HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
from click.testing import CliRunner
from starlette.responses import JSONResponse, Response

from hermes_sup.httpapi import serve
from hermes_sup.httpapi.errors import ApiError
from hermes_sup.httpapi.idempotency import CHAT_FIELDS, IdempotencyCache, fingerprint
from hermes_sup.httpapi.keys import KeyStore
from hermes_sup.httpapi.origins import origins_from_env
from hermes_sup.httpapi.sessions import key_for
from tests import test_http

# test_http's fixtures: a supervisor (probe runtime) serving the endpoint too.
endpoint = test_http.endpoint
endpoint_factory = test_http.endpoint_factory

APP = "https://app.example.com"  # the origin the CORS tests allow
ELSEWHERE = "https://evil.example.net"


# ------------------------------------------------------------------ the cache


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Turns:
    """A `compute` that counts its calls and answers with the count."""

    def __init__(self) -> None:
        self.count = 0

    async def __call__(self) -> Response:
        self.count += 1
        return JSONResponse({"turn": self.count})


def turn_of(response: Response) -> int:
    return json.loads(bytes(response.body))["turn"]


def test_a_kept_answer_is_given_again_until_it_expires() -> None:
    clock = Clock()
    cache = IdempotencyCache(ttl=300, limit=10, clock=clock)
    turns = Turns()

    async def ask(key: str, digest: str = "fp", scope: str = "a") -> int:
        return turn_of(await cache.answer(scope, key, digest, turns))

    async def main() -> None:
        assert await ask("k") == 1
        clock.now += 299
        assert await ask("k") == 1  # the first answer, no second turn
        assert await ask("k", scope="b") == 2  # another bearer key's is its own
        # Another body under the same key runs (as in Hermes) and replaces it.
        assert await ask("k", "other") == 3
        assert await ask("k", "other") == 3
        assert await ask("k") == 4
        clock.now += 301
        assert await ask("k") == 5  # expired

    asyncio.run(main())


def test_the_cache_keeps_at_most_its_limit_oldest_first_out() -> None:
    clock = Clock()
    cache = IdempotencyCache(ttl=300, limit=3, clock=clock)
    turns = Turns()

    async def ask(key: str) -> int:
        return turn_of(await cache.answer("s", key, "fp", turns))

    async def main() -> None:
        for key in "abcd":
            await ask(key)
            clock.now += 1
        assert len(cache) == 3
        assert [await ask(k) for k in "bcd"] == [2, 3, 4]  # kept
        assert await ask("a") == 5  # the oldest went

    asyncio.run(main())


def test_a_repeat_while_the_first_runs_shares_its_answer_error_or_not() -> None:
    cache = IdempotencyCache(clock=Clock())

    async def main() -> None:
        release = asyncio.Event()
        calls = 0

        async def slow(result: Response | Exception) -> Response:
            nonlocal calls
            calls += 1
            await release.wait()
            if isinstance(result, Exception):
                raise result
            return result

        def both(result: Response | Exception) -> asyncio.Future[list[object]]:
            first = asyncio.ensure_future(cache.answer("s", "k", "fp", lambda: slow(result)))
            second = asyncio.ensure_future(cache.answer("s", "k", "fp", lambda: slow(result)))
            return asyncio.gather(first, second, return_exceptions=True)

        # An error: both requests get it from one call, and it is not kept.
        release.clear()
        failing = both(ApiError(502, "the agent failed", "agent_error"))
        await asyncio.sleep(0)
        release.set()
        errors = await failing
        assert calls == 1 and all(isinstance(e, ApiError) and e.status == 502 for e in errors)
        assert len(cache) == 0

        # A client that hung up answered nobody: the waiter runs its own.
        release.clear()
        hung = both(Response(status_code=499))
        await asyncio.sleep(0)
        release.set()
        statuses = [r.status_code for r in await hung]  # type: ignore[attr-defined]
        assert calls == 3 and statuses == [499, 499] and len(cache) == 0

        # A success: one call, the same bytes for both, kept for the next.
        release.clear()
        ok = both(JSONResponse({"id": "chatcmpl-1"}, headers={"X-Hermes-Session-Id": "c"}))
        await asyncio.sleep(0)
        release.set()
        answers = await ok
        assert calls == 4 and len(cache) == 1
        assert {bytes(r.body) for r in answers} == {b'{"id":"chatcmpl-1"}'}  # type: ignore[attr-defined]
        again = await cache.answer("s", "k", "fp", lambda: slow(Response(status_code=500)))
        assert calls == 4 and again.headers["X-Hermes-Session-Id"] == "c"

    asyncio.run(main())


def test_the_fingerprint_is_of_hermes_fields_in_any_key_order() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "user": "x"}
    reordered = {"messages": [{"content": "hi", "role": "user"}], "model": "m"}
    assert fingerprint(body, CHAT_FIELDS) == fingerprint(reordered, CHAT_FIELDS)
    assert fingerprint(body, CHAT_FIELDS) != fingerprint({**body, "model": "n"}, CHAT_FIELDS)


# ------------------------------------------------------------------ settings


def test_allowed_origins_come_from_flags_else_ours_else_hermes_env(tmp_path, monkeypatch) -> None:
    assert origins_from_env({}) == ()
    hermes = {"API_SERVER_CORS_ORIGINS": " https://a.example , https://b.example/,"}
    assert origins_from_env(hermes) == ("https://a.example", "https://b.example")
    ours = {**hermes, "HERMES_SUP_HTTP_CORS_ORIGINS": "*"}
    assert origins_from_env(ours) == ("*",)

    # `hermes-sup http --cors-origin` reaches the endpoint's settings; the
    # environment is the default of the endpoint's own process.
    from hermes_sup.cli.main import cli

    KeyStore(tmp_path).generate("t")
    seen = []
    monkeypatch.setattr(
        serve, "run", lambda sock, keys, connect, settings, *a: seen.append(settings)
    )
    monkeypatch.setattr(serve, "bind", lambda host, port: None)
    monkeypatch.setenv("HERMES_SUP_HTTP_CORS_ORIGINS", "https://env.example")
    args = ["--state-dir", str(tmp_path / "s"), "http", "--data-dir", str(tmp_path)]
    flags = ["--cors-origin", APP, "--cors-origin", "https://two.example"]
    for extra in (flags, []):
        result = CliRunner().invoke(cli, [*args, *extra])
        assert result.exit_code == 0, result.output
    assert [s.cors_origins for s in seen] == [
        (APP, "https://two.example"),
        ("https://env.example",),
    ]


# ------------------------------------------------------------------ CORS


def test_without_cors_only_no_origin_or_our_own_is_served(endpoint) -> None:
    chat = endpoint.url + "/v1/chat/completions"
    turn = {"messages": [{"role": "user", "content": "hello"}]}
    assert httpx.post(chat, json=turn, headers=endpoint.headers()).status_code == 200
    # The page served with --web fetches with its (our) origin.
    same = httpx.post(chat, json=turn, headers=endpoint.headers(Origin=endpoint.url))
    assert same.status_code == 200 and same.json()["choices"][0]["message"]["content"] == "hello"
    assert "access-control-allow-origin" not in same.headers

    refused = httpx.post(chat, json=turn, headers=endpoint.headers(Origin=ELSEWHERE))
    assert refused.status_code == 403
    error = refused.json()["error"]
    assert error["code"] == "origin_not_allowed" and ELSEWHERE in error["message"]
    assert "--cors-origin" in error["message"]
    preflight = httpx.options(
        chat, headers={"Origin": ELSEWHERE, "Access-Control-Request-Method": "POST"}
    )
    assert preflight.status_code == 403 and "access-control-allow-origin" not in preflight.headers
    caps = httpx.get(endpoint.url + "/v1/capabilities", headers=endpoint.headers()).json()
    assert caps["features"]["cors"] is False


def test_serve_http_takes_allowed_origins_from_the_environment(
    endpoint_factory, monkeypatch
) -> None:
    """The endpoint `serve --http` starts reads HERMES_SUP_HTTP_CORS_ORIGINS
    from serve's environment; CORS headers go on answers and streams."""
    monkeypatch.setenv("HERMES_SUP_HTTP_CORS_ORIGINS", f"{APP},https://other.example")
    endpoint = endpoint_factory()
    chat = endpoint.url + "/v1/chat/completions"

    preflight = httpx.options(  # no key: a browser sends none with a preflight
        chat,
        headers={
            "Origin": APP,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type, idempotency-key",
        },
    )
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == APP
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "Idempotency-Key" in preflight.headers["access-control-allow-headers"]
    assert preflight.headers["access-control-max-age"] == "600"

    turn = {"messages": [{"role": "user", "content": "hello"}]}
    headers = endpoint.headers(Origin=APP, **{"X-Hermes-Session-Id": "browser"})
    answer = httpx.post(chat, json=turn, headers=headers)
    assert answer.status_code == 200
    assert answer.headers["access-control-allow-origin"] == APP
    assert "X-Hermes-Session-Id" in answer.headers["access-control-expose-headers"]

    streamed = {**turn, "stream": True}
    with httpx.stream("POST", chat, json=streamed, headers=headers, timeout=30) as stream:
        assert stream.headers["access-control-allow-origin"] == APP
        assert stream.headers["content-type"].startswith("text/event-stream")
        assert [line for line in stream.iter_lines() if line][-1] == "data: [DONE]"

    refused = httpx.post(chat, json=turn, headers=endpoint.headers(Origin=ELSEWHERE))
    assert refused.status_code == 403 and ELSEWHERE in refused.json()["error"]["message"]
    caps = httpx.get(endpoint.url + "/v1/capabilities", headers=endpoint.headers()).json()
    assert caps["features"]["cors"] is True


# ------------------------------------------------------------------ Idempotency-Key


def turns_of(endpoint, conversation: str, prefix: str | None = None) -> int:
    """How many turns the supervisor ran for a conversation's session (of
    the endpoint's key, or of the key whose namespace is `prefix`)."""
    key = (endpoint.prefix if prefix is None else prefix) + key_for(conversation)
    with endpoint.sup.client() as hs:
        found = [s for s in hs.sessions(prefix=key) if s["key"] == key]
    return found[0]["turns"] if found else 0


def test_a_repeated_idempotency_key_gets_the_first_answer_without_a_turn(endpoint) -> None:
    chat = endpoint.url + "/v1/chat/completions"
    turn = {"model": "m", "messages": [{"role": "user", "content": "pid"}]}
    headers = endpoint.headers(**{"Idempotency-Key": "k-1", "X-Hermes-Session-Id": "idem"})
    with httpx.Client(timeout=30) as http:
        first = http.post(chat, json=turn, headers=headers)
        again = http.post(chat, json=turn, headers=headers)
        assert first.status_code == again.status_code == 200
        assert again.json() == first.json()  # the same id, created, content
        assert turns_of(endpoint, "idem") == 1

        # Another body under the same key is a new request, as in Hermes.
        other = {**turn, "messages": [{"role": "user", "content": "cwd"}]}
        changed = http.post(chat, json=other, headers=headers)
        assert changed.json()["id"] != first.json()["id"] and turns_of(endpoint, "idem") == 2

        # Another bearer key never gets this key's answer (nor its session).
        keys = KeyStore(endpoint.sup.data_dir)
        theirs = keys.generate("other")
        stranger = {**headers, "Authorization": f"Bearer {theirs}"}
        own = http.post(chat, json=other, headers=stranger)
        assert own.status_code == 200 and own.json()["id"] != changed.json()["id"]
        assert turns_of(endpoint, "idem") == 2
        assert turns_of(endpoint, "idem", keys.tenant("other").prefix) == 1

        # The Responses API, not streaming, too.
        responses = endpoint.url + "/v1/responses"
        asked = {"input": "pid", "conversation": "idem-r"}
        keyed = endpoint.headers(**{"Idempotency-Key": "r-1"})
        made = http.post(responses, json=asked, headers=keyed)
        assert made.status_code == 200
        assert http.post(responses, json=asked, headers=keyed).json() == made.json()
        assert turns_of(endpoint, "idem-r") == 1


def test_concurrent_repeats_run_one_turn_and_errors_are_not_kept(endpoint) -> None:
    chat = endpoint.url + "/v1/chat/completions"
    slow = {"messages": [{"role": "user", "content": "sleep 0.5"}]}
    headers = endpoint.headers(**{"Idempotency-Key": "k-2", "X-Hermes-Session-Id": "twice"})
    with ThreadPoolExecutor(2) as pool:
        both = list(
            pool.map(lambda _: httpx.post(chat, json=slow, headers=headers, timeout=30), range(2))
        )
    assert [r.status_code for r in both] == [200, 200]
    assert both[0].json() == both[1].json()
    assert turns_of(endpoint, "twice") == 1  # without the key the session would run two

    # A failed turn is not kept: the repeat runs (and succeeds), then that is kept.
    where = {"X-Hermes-Session-Id": "fails"}
    keyed = endpoint.headers(**{**where, "Idempotency-Key": "k-3"})
    write = {"messages": [{"role": "user", "content": "write d x"}]}
    with httpx.Client(timeout=30) as http:

        def say(text: str) -> httpx.Response:
            body = {"messages": [{"role": "user", "content": text}]}
            return http.post(chat, json=body, headers=endpoint.headers(**where))

        assert say("write d/f x").status_code == 200  # d is a directory now
        failed = http.post(chat, json=write, headers=keyed)
        assert failed.status_code == 502, failed.text
        assert say("sh rm -r d").status_code == 200
        done = http.post(chat, json=write, headers=keyed)
        assert done.status_code == 200, done.text
        turns = turns_of(endpoint, "fails")
        assert http.post(chat, json=write, headers=keyed).json() == done.json()
        assert turns_of(endpoint, "fails") == turns
