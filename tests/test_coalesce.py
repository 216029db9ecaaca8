"""Coalescing at the source (worker/coalesce.py): a turn's stream deltas made
within a window go out as fewer events, in order, losing nothing.

Three tiers: the coalescer alone, with the clock handed to it; one real
worker process (worker/loop.py) driven by this test as its supervisor over a
real socket, told its window in the spawn request as the supervisor tells
it; and a real supervisor and client, with the window it gives workers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from hermes_sup.protocol import Kind, Message, decode, encode
from hermes_sup.worker.coalesce import Coalescer

# ------------------------------------------------------- the coalescer alone


def token(text: str, turn: str = "t1") -> Message:
    return Message(Kind.EVENT, {"type": "token", "data": text}, session="s", re=turn)


def output(line: str, turn: str = "t1") -> Message:
    return Message(Kind.EVENT, {"type": "output", "data": line}, session="s", re=turn)


def tool(turn: str = "t1") -> Message:
    return Message(Kind.EVENT, {"type": "tool_start", "data": {"id": "c1"}}, session="s", re=turn)


def reply(turn: str = "t1") -> Message:
    return Message(Kind.REPLY, {"text": "done", "ok": True}, session="s", re=turn)


def sent_by(window_ms: float) -> tuple[Coalescer, list[Message]]:
    out: list[Message] = []
    return Coalescer(out.append, window_ms), out


def shapes(msgs: list[Message]) -> list[tuple[str, Any]]:
    return [(m.body.get("type", m.kind.value), m.body.get("data")) for m in msgs]


def test_the_first_delta_goes_at_once_and_the_rest_of_the_window_is_merged() -> None:
    c, out = sent_by(10)
    c.offer(token("a"), now=100.0)
    assert shapes(out) == [("token", "a")]  # not held: no window was open
    for i, piece in enumerate(["b", "c", "d"]):
        c.offer(token(piece), now=100.001 + i / 1000)
    assert len(out) == 1 and c.holding and c.deadline == pytest.approx(100.010)
    c.tick(now=100.009)
    assert len(out) == 1  # the window is still open
    c.tick(now=100.010)
    assert shapes(out) == [("token", "a"), ("token", "bcd")]
    assert not c.holding and c.merged == 2


def test_merged_events_keep_the_first_deltas_envelope() -> None:
    c, out = sent_by(10)
    c.offer(token("a"), now=1.0)
    first = token("b")
    c.offer(first, now=1.001)
    c.offer(token("c"), now=1.002)
    c.flush()
    merged = out[-1]
    assert (merged.id, merged.ts, merged.session, merged.re) == (
        first.id,
        first.ts,
        "s",
        "t1",
    )


def test_output_lines_are_joined_so_that_printing_each_event_prints_the_same_bytes() -> None:
    c, out = sent_by(10)
    lines = ["one", "", "three", "  four  "]
    for i, line in enumerate(lines):
        c.offer(output(line), now=5.0 + i / 10_000)
    c.flush()
    printed = "".join(m.body["data"] + "\n" for m in out)
    assert printed == "".join(line + "\n" for line in lines)
    assert len(out) == 2


def test_a_barrier_sends_what_is_held_first_and_is_never_held() -> None:
    c, out = sent_by(10)
    c.offer(token("a"), now=1.0)
    c.offer(token("b"), now=1.001)
    c.offer(tool(), now=1.002)
    assert shapes(out) == [("token", "a"), ("token", "b"), ("tool_start", {"id": "c1"})]
    c.offer(token("c"), now=1.003)  # the window is still open: held
    c.offer(reply(), now=1.004)
    assert shapes(out)[-2:] == [("token", "c"), ("reply", None)]
    # The next turn's first delta is not held, though the window was open.
    c.offer(token("x", turn="t2"), now=1.005)
    assert shapes(out)[-1] == ("token", "x") and not c.holding


def test_a_delta_of_another_type_sends_the_held_one_first() -> None:
    c, out = sent_by(10)
    c.offer(token("a"), now=1.0)
    c.offer(token("b"), now=1.001)
    c.offer(output("line"), now=1.002)
    c.offer(token("c"), now=1.003)
    c.flush()
    assert shapes(out) == [("token", "a"), ("token", "b"), ("output", "line"), ("token", "c")]


def test_a_merged_event_stays_under_its_size_bound() -> None:
    out: list[Message] = []
    c = Coalescer(out.append, 10, max_bytes=10)
    c.offer(token("a"), now=1.0)
    for _ in range(7):
        c.offer(token("xyz"), now=1.001)
    c.flush()
    assert [len(m.body["data"]) for m in out] == [1, 9, 9, 3]
    assert "".join(m.body["data"] for m in out) == "a" + "xyz" * 7


def test_a_window_of_zero_is_off() -> None:
    c, out = sent_by(0)
    for piece in "abc":
        c.offer(token(piece), now=1.0)
    assert shapes(out) == [("token", "a"), ("token", "b"), ("token", "c")]
    assert not c.holding


def test_data_that_is_not_text_is_not_merged() -> None:
    c, out = sent_by(10)
    odd = Message(Kind.EVENT, {"type": "token", "data": {"text": "a"}}, session="s", re="t1")
    c.offer(token("a"), now=1.0)
    c.offer(token("b"), now=1.001)
    c.offer(odd, now=1.002)
    assert shapes(out) == [("token", "a"), ("token", "b"), ("token", {"text": "a"})]


# ------------------------------------------------- one real worker, driven here

# A runtime written into the test's directory: `tokens N` streams N tokens
# as fast as it can; `wait` streams one, then waits for a file named `go`
# in its directory before streaming another.
STREAMER = textwrap.dedent(
    """
    import os, time

    class Streamer:
        def __init__(self, session):
            pass

        def run_turn(self, text, emit):
            command, _, arg = text.partition(" ")
            if command == "tokens":
                for i in range(int(arg)):
                    emit("token", f"{i} ")
                return "done"
            if command == "mixed":
                for i in range(int(arg)):
                    emit("token", f"a{i} ")
                emit("tool_start", {"id": "c1", "name": "t", "args": {}})
                for i in range(int(arg)):
                    emit("output", f"b{i}")
                emit("approval", {"id": "p1", "command": "x", "choices": ["once", "deny"]})
                for i in range(int(arg)):
                    emit("token", f"c{i} ")
                return "done"
            if command == "wait":
                emit("token", "first")
                deadline = time.monotonic() + 60
                while not os.path.exists(arg) and time.monotonic() < deadline:
                    time.sleep(0.005)
                emit("token", "second")
                return "done"
            return text

    def make(session):
        return Streamer(session)
    """
)

WORKER = textwrap.dedent(
    """
    import sys, msgpack
    req = msgpack.unpackb(sys.stdin.buffer.read())
    sys.path.insert(0, req.pop("runtimes"))
    import hs_streamer
    from hermes_sup.worker.loop import WorkerLoop
    sys.exit(WorkerLoop(req, hs_streamer.make(None)).run())
    """
)


class DrivenWorker:
    """A real worker loop in its own process, with this test as its supervisor."""

    def __init__(self, root: Path, ctx: zmq.Context[zmq.Socket[bytes]], window: float | None):
        self.root = root
        (root / "hs_streamer.py").write_text(STREAMER)
        self.token = os.urandom(32)
        self.worker_id = b"w-1"
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        endpoint = f"ipc://{root}/w.sock"
        self.sock.bind(endpoint)
        req: dict[str, Any] = {
            "key": "s",
            "token": self.token,
            "worker_id": self.worker_id,
            "endpoint": endpoint,
            "supervisor_pid": os.getpid(),
            "heartbeat": 5.0,
            "runtimes": str(root),
        }
        if window is not None:
            req["coalesce_ms"] = window
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER], stdin=subprocess.PIPE, cwd=root
        )
        assert self.proc.stdin is not None
        self.proc.stdin.write(msgpack.packb(req))
        self.proc.stdin.close()
        assert self.recv().kind is Kind.HELLO

    def recv(self, timeout: float = 30.0) -> Message:
        """The worker's next message other than a heartbeat."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sock.poll(100):
                frames = self.sock.recv_multipart()
                assert frames[0] == self.worker_id
                msg = decode(frames[1:], self.token)
                if msg.kind is not Kind.HEARTBEAT:
                    return msg
            assert self.proc.poll() is None, "the worker exited"
        raise AssertionError("the worker said nothing in time")

    def send(self, msg: Message) -> None:
        self.sock.send_multipart([self.worker_id, *encode(msg, self.token)])

    def turn(self, text: str) -> Iterator[Message]:
        """Start a turn; yield its events, then its final answer."""
        turn = Message(Kind.TURN, {"text": text}, session="s")
        self.send(turn)
        while True:
            msg = self.recv()
            assert msg.re == turn.id
            yield msg
            if msg.kind is not Kind.EVENT:
                return

    def close(self) -> None:
        try:
            self.send(Message(Kind.STOP, {}, session="s"))
            self.proc.wait(10)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.sock.close(0)


@pytest.fixture
def driven(workdir: Path, zmq_context: zmq.Context[zmq.Socket[bytes]]) -> Iterator[Any]:
    made: list[DrivenWorker] = []

    def make(window: float | None) -> DrivenWorker:
        worker = DrivenWorker(workdir, zmq_context, window)
        made.append(worker)
        return worker

    yield make
    for worker in made:
        worker.close()


def text_of(events: list[Message], kind: str = "token") -> str:
    return "".join(m.body["data"] for m in events if m.body.get("type") == kind)


N = 5000
ALL_TOKENS = "".join(f"{i} " for i in range(N))


def test_a_worker_merges_a_fast_stream_and_loses_nothing(driven) -> None:
    worker = driven(20)
    events = list(worker.turn(f"tokens {N}"))
    assert events[-1].kind is Kind.REPLY
    assert text_of(events) == ALL_TOKENS  # byte for byte
    assert len(events) - 1 < N / 4  # far fewer events than deltas
    assert events[0].body["data"] == "0 "  # the first on its own


def test_a_window_of_zero_sends_every_delta(driven) -> None:
    worker = driven(0)
    events = list(worker.turn(f"tokens {N}"))
    assert text_of(events) == ALL_TOKENS
    assert len(events) - 1 == N


def test_a_worker_not_told_a_window_does_not_merge(driven) -> None:
    """The supervisor's `stream_coalesce_ms` turns it on; a request that
    says nothing (an older supervisor's) keeps one event per delta."""
    worker = driven(None)
    events = list(worker.turn(f"tokens {N}"))
    assert text_of(events) == ALL_TOKENS and len(events) - 1 == N


def test_a_turns_first_delta_is_not_held(driven, workdir: Path) -> None:
    """Held deltas leave at a barrier or when their window closes; with a
    window far longer than the test, the first delta arriving while its
    turn still waits shows it was sent at once. Twice: the second turn's
    first delta is not held behind the first turn's window."""
    worker = driven(600_000)
    for n in (1, 2):
        go = workdir / f"go{n}"
        events = worker.turn(f"wait {go}")
        first = next(events)
        assert first.body == {"type": "token", "data": "first"}
        go.touch()  # only now may the turn go on
        rest = list(events)
        assert [m.body.get("data") for m in rest[:-1]] == ["second"]
        assert rest[-1].kind is Kind.REPLY


def test_tools_and_approvals_come_after_every_delta_before_them(driven) -> None:
    worker = driven(600_000)  # held deltas can only leave at a barrier
    n = 300
    events = list(worker.turn(f"mixed {n}"))
    types = [m.body.get("type", m.kind.value) for m in events]
    tool_at, approval_at = types.index("tool_start"), types.index("approval")
    before = events[:tool_at]
    between = events[tool_at + 1 : approval_at]
    after = events[approval_at + 1 : -1]
    assert text_of(before) == "".join(f"a{i} " for i in range(n))
    assert text_of(between, "output") == "\n".join(f"b{i}" for i in range(n))
    assert text_of(after) == "".join(f"c{i} " for i in range(n))
    assert types[-1] == "reply"


# ------------------------------------------ a real supervisor and its client

SEQ = 20_000


def test_through_the_supervisor_a_fast_command_comes_whole_and_in_order(supervisor) -> None:
    with supervisor.client(timeout=60) as client:
        done = client.run("seq", f"sh seq 1 {SEQ}")
        assert done.text == "exit 0"
        lines = [e.data for e in done.events if e.type == "output"]
        printed = "".join(line + "\n" for line in lines)
        assert printed == "".join(f"{i}\n" for i in range(1, SEQ + 1))
        assert lines[0] == "1"


def test_through_the_supervisor_tools_and_approvals_keep_their_place(
    supervisor_factory, workdir: Path
) -> None:
    runtimes = workdir / "rt"
    runtimes.mkdir()
    (runtimes / "hs_streamer.py").write_text(STREAMER)
    sup = supervisor_factory(
        "--agent", "hs_streamer:make", env=dict(os.environ, PYTHONPATH=str(runtimes))
    )
    n = 2000
    with sup.client(timeout=60) as client:
        done = client.run("mixed", f"mixed {n}")
        assert done.text == "done"
        events = [e for e in done.events if e.type != "status"]
        types = [e.type for e in events]
        tool_at, approval_at = types.index("tool_start"), types.index("approval")
        assert "".join(e.data for e in events[:tool_at]) == "".join(f"a{i} " for i in range(n))
        assert "\n".join(e.data for e in events[tool_at + 1 : approval_at]) == "\n".join(
            f"b{i}" for i in range(n)
        )
        assert "".join(e.data for e in events[approval_at + 1 :]) == "".join(
            f"c{i} " for i in range(n)
        )
