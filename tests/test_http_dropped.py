"""Nothing lost silently when a front end reads too slowly (PROTOCOL.md,
"Slow consumers"): the supervisor drops some of a stream's events and says
so with a `dropped` notice. The clients then ask for the turn's final
answer again, so a turn whose reply was dropped still ends; the HTTP
endpoint tells its own clients that what they were streamed is incomplete.

The endpoint tests run a real supervisor with a small client queue and the
endpoint as its own process, stopped (SIGSTOP) while a flood goes through
it, so that it lags for real. The client tests play the supervisor on a
real ipc socket, to drop a reply on purpose, which the real supervisor
does only beyond 256 owed answers.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq

from hermes_sup.client import (
    AsyncClient,
    Client,
    Connection,
    Dropped,
    Reply,
    SupervisorError,
)
from hermes_sup.httpapi.keys import KeyStore
from hermes_sup.httpapi.sessions import key_for
from hermes_sup.protocol import Kind, Limits, Message, decode, encode
from tests.test_http import wait_ready
from tests.waiting import wait_for

WORDS = 600  # the probe streams one every 20 ms: 12 s, to outlast the flood
FLOOD = (
    'sh awk \'BEGIN { s = sprintf("%992s", ""); '
    'for (i = 1; i <= 4000; i++) printf "%08d%s\\n", i, s }\''
)


def idle(client: Client, session: str) -> bool:
    """Whether the endpoint's session for this id (its key's namespace is
    `t`'s, the only key) has run a turn and is idle."""
    rows = [r for r in client.sessions() if r["key"].endswith("+" + key_for(session))]
    return bool(rows) and rows[0]["turns"] >= 1 and rows[0]["state"] == "idle"


def sse_events(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


@pytest.fixture
def lagging(supervisor_factory, workdir: Path):  # noqa: ANN201
    """A supervisor that queues 50 messages for a client, and the endpoint
    as its own process (pid known, to stop it)."""
    config = workdir / "hs.toml"
    config.write_text("client_queue = 50\nstream_coalesce_ms = 0\n")
    sup = supervisor_factory("--config", str(config))
    key = KeyStore(sup.data_dir).generate("t")
    log_path = workdir / "endpoint.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hermes_sup.httpapi", "--state-dir", str(sup.state_dir),
             "--data-dir", str(sup.data_dir), "--listen", "127.0.0.1:0"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        url = wait_ready(log_path, proc)
        yield sup, url, {"Authorization": f"Bearer {key}"}, proc, log_path
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def test_a_stream_that_lost_tokens_states_the_gap_and_ends_whole_as_the_run_does(lagging) -> None:
    sup, url, auth, proc, log_path = lagging
    words = " ".join(f"w{i}" for i in range(WORDS))
    body = {
        "model": "m",
        "stream": True,
        "messages": [{"role": "user", "content": "stream " + words}],
    }
    with httpx.Client(base_url=url, headers=auth, timeout=120) as http:
        with http.stream("POST", "/v1/chat/completions", json=body,
                         headers={"X-Hermes-Session-Id": "a"}) as chat:  # fmt: skip
            lines = chat.iter_lines()
            assert next(lines).startswith("data: ")  # its turn runs: the role chunk
            # Another session floods the same endpoint (one connection to the
            # supervisor) while the endpoint reads nothing: it lags.
            run = http.post("/v1/runs", json={"input": FLOOD, "session_id": "b"})
            assert run.status_code == 202, run.text
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                with sup.client(timeout=60) as watcher:
                    wait_for(lambda: "slow_consumer " in sup.log(), 120, what="the endpoint to lag")
                    wait_for(lambda: idle(watcher, "b"), 120, what="the flood to end")
                    # The chat's turn must still stream when the endpoint reads
                    # again, so that the tokens it missed are a gap, not the end.
                    assert not idle(watcher, "a"), "the machine was too slow for this test"
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        chunks = [c for c in sse_events(rest) if "choices" in c]  # the gaps' data has none
        last = chunks[-1]
        said = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert said != words  # tokens went missing: a gap
        # Stated where it was, and the turn's end as it was, with the whole text.
        gaps = [json.loads(rest[i + 1][6:]) for i, line in enumerate(rest)
                if line == "event: hermes.stream.gap"]  # fmt: skip
        assert gaps and all(g["count"] > 0 and g["reason"] == "slow_consumer" for g in gaps)
        assert last["choices"][0]["finish_reason"] == "stop", last
        assert "error" not in last
        assert last["hermes"]["completed"] is True and last["hermes"]["partial"] is True
        assert last["hermes"]["dropped"] == sum(g["count"] for g in gaps)
        assert last["hermes"]["text"] == words

        # The flood's run: an events.dropped where its output went missing,
        # and the whole reply at the end.
        run_id = run.json()["run_id"]
        wait_for(
            lambda: http.get(f"/v1/runs/{run_id}").json()["status"] not in ("queued", "running"),
            120,
            what="the run to end",
        )
        with http.stream("GET", f"/v1/runs/{run_id}/events") as events:
            seen = sse_events([line for line in events.iter_lines() if line])
        dropped = [e for e in seen if e["event"] == "events.dropped"]
        assert dropped and all(e["count"] > 0 and e["reason"] == "slow_consumer" for e in dropped)
        assert seen[-1]["event"] == "run.completed" and seen[-1]["output"].endswith("\nexit 0")
        assert seen[-1]["dropped"] == sum(e["count"] for e in dropped)

        # Not streaming, the text is the reply itself: whole, after a lag too.
        done = http.post("/v1/chat/completions", headers={"X-Hermes-Session-Id": "a"},
                         json={**body, "stream": False})  # fmt: skip
        assert done.status_code == 200
        assert done.json()["choices"][0]["message"]["content"] == words
    assert "http_stream_dropped" in log_path.read_text()


# ------------------------------------------------------------ a reply dropped

KEY = b"k" * 32


class FakeSupervisor:
    """A ROUTER on an ipc socket that answers a `send` with `running` and a
    `dropped` notice but no reply (as the supervisor does when it dropped
    the reply it owed a lagging client), then answers the resend with
    `answer` (a reply or an error). Records every send it got."""

    def __init__(self, path: Path, answer: dict[str, Any] | None) -> None:
        self.endpoint = f"ipc://{path}"
        self.answer = answer
        self.sends: list[Message] = []
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.bind(self.endpoint)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def connection(self) -> Connection:
        return Connection(self.endpoint, KEY)

    def _send(self, peer: bytes, msg: Message) -> None:
        self.sock.send_multipart([peer, *encode(msg, KEY, Limits())])

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            peer, *frames = self.sock.recv_multipart()
            msg = decode(frames, KEY, Limits())
            if msg.kind is not Kind.SEND:
                continue
            self.sends.append(msg)
            if len(self.sends) == 1:
                self._send(
                    peer,
                    msg.reply(
                        Kind.EVENT, {"type": "status", "data": {"state": "running", "pid": 1}}
                    ),
                )
                self._send(
                    peer,
                    msg.reply(
                        Kind.EVENT,
                        {"type": "dropped", "data": {"count": 3, "reason": "slow_consumer"}},
                    ),
                )
            elif self.answer is not None:
                kind = Kind.ERROR if "code" in self.answer else Kind.REPLY
                self._send(peer, msg.reply(kind, self.answer))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def fake(tmp_path: Path):  # noqa: ANN201
    made: list[FakeSupervisor] = []

    def make(answer: dict[str, Any] | None) -> FakeSupervisor:
        made.append(FakeSupervisor(tmp_path / "control.sock", answer))
        return made[-1]

    yield make
    for f in made:
        f.close()


def test_a_turn_whose_reply_was_dropped_asks_again_and_ends(fake) -> None:
    sup = fake({"text": "whole", "ok": True})

    async def main() -> Reply:
        async with AsyncClient(connection=sup.connection(), timeout=10) as client:
            return await asyncio.wait_for(client.run("s", "hi"), 30)

    reply = asyncio.run(main())
    assert reply.text == "whole" and reply.ok
    assert any(isinstance(e, Dropped) and e.count == 3 for e in reply.events)
    # The very same send, once more: the supervisor never runs it twice.
    assert [m.id for m in sup.sends] == [sup.sends[0].id] * 2


def test_the_blocking_client_asks_again_too(fake) -> None:
    sup = fake({"text": "whole", "ok": True})
    with Client(connection=sup.connection(), timeout=10) as client:
        reply = client.run("s", "hi", turn_timeout=30)
    assert reply.text == "whole"
    assert [m.id for m in sup.sends] == [sup.sends[0].id] * 2


def test_a_reply_no_longer_kept_fails_the_turn_instead_of_hanging(fake) -> None:
    sup = fake({"code": "expired", "message": "no longer kept; it was not run again"})

    async def main() -> None:
        async with AsyncClient(connection=sup.connection(), timeout=10) as client:
            await asyncio.wait_for(client.run("s", "hi"), 30)

    with pytest.raises(SupervisorError) as failed:
        asyncio.run(main())
    assert failed.value.code == "expired"
