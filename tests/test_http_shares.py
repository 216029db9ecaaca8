"""Each bearer key's fair share of the endpoint: one key flooding it with
slow bodies holds its share and no more, while other keys and `/health`
keep answering; a body slower than the minimum rate is cut. A real
supervisor (probe runtime) and endpoint over real sockets on 127.0.0.1;
every check counts answers, none times them."""

from __future__ import annotations

import json
import re
import select
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from hermes_sup.httpapi.keys import KeyStore
from tests import test_http
from tests.test_http_hostile import closed_by_peer
from tests.waiting import wait_for

CAP = 64  # connections; a quarter of them kept for keys with nothing open
KEY_REQUESTS = 40


@contextmanager
def endpoint_with(supervisor, workdir: Path, *flags: str) -> Iterator[str]:
    """The endpoint on its own, fronting `supervisor`, with `flags`."""
    log_path = workdir / "endpoint.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hermes_sup.httpapi", "--state-dir", str(supervisor.state_dir),
             "--data-dir", str(supervisor.data_dir), "--listen", "127.0.0.1:0", *flags],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        yield test_http.wait_ready(log_path, proc)
    finally:
        proc.terminate()
        proc.wait(15)


def slow_post(base: str, key: str) -> socket.socket:
    """A request whose head has come and whose body has not (one byte of 100)."""
    url = httpx.URL(base)
    sock = socket.create_connection((url.host, url.port), timeout=30)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        + f"Authorization: Bearer {key}\r\n".encode()
        + b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
    )
    return sock


def read_answer(sock: socket.socket) -> bytes:
    """One whole answer (its head, and its body by its Content-Length)."""
    answer = b""
    while b"\r\n\r\n" not in answer and (piece := sock.recv(65536)):
        answer += piece
    head, _, body = answer.partition(b"\r\n\r\n")
    length = re.search(rb"(?i)content-length: *(\d+)", head)
    while length and len(body) < int(length.group(1)) and (piece := sock.recv(65536)):
        body += piece
    return head + b"\r\n\r\n" + body


def answered(socks: list[socket.socket]) -> dict[socket.socket, bytes]:
    """What each of `socks` that has an answer waiting says (the rest have none)."""
    ready, _, _ = select.select(socks, [], [], 0)
    return {sock: read_answer(sock) for sock in ready}


def collect_answers(socks: list[socket.socket], count: int) -> dict[socket.socket, bytes]:
    """Wait until `count` of `socks` have answered; those answers."""
    got: dict[socket.socket, bytes] = {}

    def enough() -> bool:
        got.update(answered([s for s in socks if s not in got]))
        return len(got) >= count

    wait_for(enough, 60, what=f"{count} answers")
    return got


def test_one_key_flooding_slow_bodies_leaves_other_keys_and_health_their_share(
    supervisor, workdir
) -> None:
    keys = KeyStore(supervisor.data_dir)
    flooder, other, fresh = keys.generate("flooder"), keys.generate("other"), keys.generate("fresh")
    held: list[socket.socket] = []
    with endpoint_with(
        supervisor, workdir, "--max-connections", str(CAP), "--key-requests", str(KEY_REQUESTS),
        "--body-timeout", "600", "--min-body-rate", "0",
    ) as base:  # fmt: skip
        try:
            flood = [slow_post(base, flooder) for _ in range(200)]
            held += flood
            # Its share is held; every request past it is answered 429 at once.
            refused = collect_answers(flood, 200 - KEY_REQUESTS)
            for answer in refused.values():
                head, _, body = answer.partition(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 429"), answer
                assert b"retry-after: 1" in head.lower() and b"connection: close" in head.lower()
                assert json.loads(body)["error"]["code"] == "key_share_full"
            assert answered([s for s in flood if s not in refused]) == {}  # still held

            # Another key, with nothing open, gets in; with requests open it
            # may fill the shared slots but not the reserve.
            shared_left = CAP - CAP // 4 - KEY_REQUESTS
            second = [slow_post(base, other) for _ in range(shared_left + 1)]
            held += second
            extra = collect_answers(second, 1)
            assert len(extra) == 1 and b"kept for keys with no request open" in next(
                iter(extra.values())
            )
            assert answered([s for s in second if s not in extra]) == {}

            with httpx.Client(timeout=30) as http:
                for _ in range(20):
                    health = http.get(base + "/health", headers={"Connection": "close"})
                    assert health.status_code == 200, health.text
                    models = http.get(
                        base + "/v1/models",
                        headers={"Authorization": f"Bearer {fresh}", "Connection": "close"},
                    )
                    assert models.status_code == 200, models.text
                again = http.get(
                    base + "/v1/models", headers={"Authorization": f"Bearer {flooder}"}
                )
                assert again.status_code == 429 and again.headers["Retry-After"] == "1"

                # Its requests end (the client gives up): its share is free again.
                for sock in flood:
                    sock.close()
                wait_for(
                    lambda: http.get(
                        base + "/v1/models", headers={"Authorization": f"Bearer {flooder}"}
                    ).status_code == 200,
                    30, what="the flooding key's share to free",
                )  # fmt: skip
        finally:
            for sock in held:
                sock.close()


def test_a_body_slower_than_the_minimum_rate_is_cut(supervisor, workdir) -> None:
    key = KeyStore(supervisor.data_dir).generate("test")
    with endpoint_with(
        supervisor, workdir, "--body-timeout", "600", "--min-body-rate", "100"
    ) as base:
        sock = slow_post(base, key)
        try:
            answer = b""

            def cut() -> bool:
                nonlocal answer
                ready, _, _ = select.select([sock], [], [], 0.5)
                if ready:
                    answer = read_answer(sock)
                    return True
                sock.sendall(b" ")  # one byte every half second: 2 bytes/s
                return False

            wait_for(cut, 120, what="the slow body to be cut")
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408"), answer
            error = json.loads(body)["error"]
            assert error["code"] == "body_too_slow"
            assert "under the minimum of 100 bytes/s" in error["message"]
        finally:
            sock.close()
        # A body sent at once is never too slow.
        with httpx.Client(timeout=30) as http:
            turn = {"messages": [{"role": "user", "content": "hi"}]}
            done = http.post(
                base + "/v1/chat/completions", json=turn,
                headers={"Authorization": f"Bearer {key}"},
            )  # fmt: skip
            assert done.status_code == 200, done.text


def test_a_key_at_its_connection_cap_makes_room_from_its_own_idle_ones(supervisor, workdir) -> None:
    """Four connections a key: three busy and one idle, a fifth gets in (the
    idle one is closed); four busy, a fifth is answered 429."""
    key = KeyStore(supervisor.data_dir).generate("test")
    models = f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\r\n"
    with endpoint_with(
        supervisor, workdir, "--key-connections", "4", "--body-timeout", "600",
        "--min-body-rate", "0",
    ) as base:  # fmt: skip
        url = httpx.URL(base)
        busy = [slow_post(base, key) for _ in range(3)]
        try:
            idle = socket.create_connection((url.host, url.port), timeout=30)
            busy.append(idle)
            idle.sendall(models.encode())
            assert read_answer(idle).startswith(b"HTTP/1.1 200")  # kept alive, idle now
            busy.append(slow_post(base, key))
            wait_for(lambda: closed_by_peer(idle), 30, what="the idle one closed")
            refused = slow_post(base, key)
            busy.append(refused)
            (answer,) = collect_answers([refused], 1).values()
            assert answer.startswith(b"HTTP/1.1 429") and b"holds 4 connections" in answer
            assert answered([s for s in busy if s not in (idle, refused)]) == {}
        finally:
            for sock in busy:
                sock.close()
