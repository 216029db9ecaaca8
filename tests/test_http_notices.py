"""The endpoint keeps each key's notices until the key acknowledges them:
a notice that came while no stream was open is handed to the next one,
after the cursor it names; acknowledged ones are gone; a key sees only its
own; a flooding session pushes out only its own; a restarted endpoint still
has them. A real supervisor (probe runtime) and endpoint over HTTP."""

from __future__ import annotations

import json
import os
import re
import signal

import httpx

from hermes_sup.httpapi.keys import KeyStore
from tests import test_http
from tests.test_gateway import _output
from tests.waiting import wait_for

# test_http's fixtures: a supervisor (probe runtime) serving the endpoint too.
endpoint = test_http.endpoint
endpoint_factory = test_http.endpoint_factory


def read_notices(ep, count: int, key: str | None = None, **params: str) -> list[dict]:
    """The first `count` notices a new stream hands over."""
    headers = {"Authorization": f"Bearer {key or ep.key}"}
    got: list[dict] = []
    url = ep.url + "/v1/notices"
    with httpx.stream("GET", url, headers=headers, params=params, timeout=30) as stream:
        assert stream.status_code == 200, stream.read()
        cursor = None
        for line in stream.iter_lines():
            if line.startswith("id: "):
                cursor = int(line[4:])
            if line.startswith("data: "):
                got.append(json.loads(line[6:]))
                assert got[-1]["cursor"] == cursor
            if len(got) >= count:
                break
    return got


def has_none(ep, key: str | None = None, **params: str) -> bool:
    """Whether a new stream hands over nothing before its first keepalive."""
    headers = {"Authorization": f"Bearer {key or ep.key}"}
    with httpx.stream(
        "GET", ep.url + "/v1/notices", headers=headers, params=params, timeout=30
    ) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: "):
                return False
            if line == ": keepalive":
                return True
    return True


def ack(ep, cursor: object) -> httpx.Response:
    return httpx.post(ep.url + "/v1/notices/ack", json={"cursor": cursor}, headers=ep.headers())


def test_notices_are_kept_until_acknowledged_and_survive_an_endpoint_restart(endpoint) -> None:
    for text in ("one", "two", "three"):
        _output(endpoint, "n1", f'notice {{"kind": "message", "text": "{text}"}}')
    first = read_notices(endpoint, 3)  # no stream was open when they came
    assert [n["notice"]["text"] for n in first] == ["one", "two", "three"]
    assert [n["cursor"] for n in first] == [1, 2, 3]
    assert {n["client_key"] for n in first} == {"n1"}
    assert all(n["session_key"] == endpoint.prefix + "n1" for n in first)
    assert len({n["id"] for n in first}) == 3
    # Another key's stream has none of them.
    other = KeyStore(endpoint.sup.data_dir).generate("other")
    assert has_none(endpoint, other)

    assert ack(endpoint, 2).json() == {"acked": 2, "kept": 1}
    (left,) = read_notices(endpoint, 1)
    assert left["id"] == first[2]["id"]
    assert read_notices(endpoint, 1, after="2")[0]["cursor"] == 3
    assert has_none(endpoint, after="3")

    # The endpoint dies and its keeper starts another: the kept notice is there.
    ready = re.compile(r"http_ready url=\S+ pid=(\d+)")
    os.kill(int(ready.findall(endpoint.log())[-1]), signal.SIGKILL)
    wait_for(lambda: len(ready.findall(endpoint.log())) >= 2, 60, what="the endpoint back")
    wait_for(lambda: test_http.wait_ready(endpoint.sup.log_path, None), 30)
    assert read_notices(endpoint, 1)[0]["id"] == first[2]["id"]
    _output(endpoint, "n1", 'notice {"kind": "message", "text": "four"}')
    (fourth,) = read_notices(endpoint, 1, after="3")
    assert fourth["cursor"] == 4 and fourth["notice"]["text"] == "four"
    assert ack(endpoint, 99).json() == {"acked": 4, "kept": 0}  # at most the last given
    assert has_none(endpoint)


def test_a_flooding_session_pushes_out_only_its_own_notices(endpoint) -> None:
    _output(endpoint, "quiet", 'notice {"kind": "message", "text": "quiet"}')
    _output(endpoint, "loud", 'notice 130 {"kind": "message", "text": "loud"}')
    kept = read_notices(endpoint, 101)
    assert sum(n["client_key"] == "loud" for n in kept) == 100
    assert [n["notice"]["text"] for n in kept if n["client_key"] == "quiet"] == ["quiet"]
    assert endpoint.log().count("http_notice_dropped") == 30
    # One too large for the supervisor (64 KiB) never comes; the next one does.
    big = "x" * 100_000
    _output(endpoint, "quiet", f'notice {{"kind": "message", "text": "{big}"}}')
    _output(endpoint, "quiet", 'notice {"kind": "message", "text": "small"}')
    (last,) = read_notices(endpoint, 1, after=str(kept[-1]["cursor"]))
    assert last["notice"]["text"] == "small" and last["cursor"] == kept[-1]["cursor"] + 1


def test_bad_cursors_are_refused_with_what_is_wrong(endpoint) -> None:
    for bad in ("x", -1, True, None):
        refused = ack(endpoint, bad)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_cursor"
    for bad in ("x", "-1"):
        got = httpx.get(
            endpoint.url + "/v1/notices", params={"after": bad}, headers=endpoint.headers()
        )
        assert got.status_code == 400 and "after must be" in got.json()["error"]["message"]
