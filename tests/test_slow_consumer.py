"""A client that stops reading (door/fronts.py, "Slow consumers"):
the supervisor holds at most its queue for it, serves everyone else as
before, and once it reads again tells it how many events it missed and
gives it every answer. Real supervisor, real clients, real sockets."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import psutil

from hermes_sup.client import Client
from hermes_sup.protocol import Kind, Message

from . import waiting

LINES = 40_000
WIDTH = 1000  # bytes a line: LINES of them are 40 MB through the supervisor
FLOOD = (
    "sh awk 'BEGIN { s = sprintf(\"%" + str(WIDTH - 8) + 's", ""); '
    f'for (i = 1; i <= {LINES}; i++) printf "%08d%s\\n", i, s }}\''
)
# Far below what the flood would hold if the supervisor queued it all.
RSS_BOUND = 20 * 1024 * 1024


def config(root: Path, queue: int) -> Path:
    path = root / "hs.toml"
    # One event a line: the counts below are exact.
    path.write_text(f"client_queue = {queue}\nstream_coalesce_ms = 0\n")
    return path


def rss(pid: int) -> int:
    return int(psutil.Process(pid).memory_info().rss)


wait_for = partial(waiting.wait_for, timeout=120.0, every=0.05)


def turn_over(client: Client, key: str) -> bool:
    rows = [r for r in client.sessions() if r["key"] == key]
    return bool(rows) and rows[0]["turns"] >= 1 and rows[0]["state"] == "idle"


def accounted(events: list) -> int:  # noqa: ANN001
    """Lines a client got, plus those it was told it missed."""
    got = [e for e in events if e.type == "output"]
    missed = sum(e.data["count"] for e in events if e.type == "dropped")
    return len(got) + missed


def answers_to(client: Client, req: str) -> list[Message]:
    got = []
    while True:
        msg = client.next(timeout=60)
        if msg.re != req:
            continue
        got.append(msg)
        if msg.kind is not Kind.EVENT:
            return got


def test_a_client_that_stops_reading_costs_its_queue_and_learns_what_it_missed(
    supervisor_factory, workdir: Path
) -> None:
    sup = supervisor_factory("--config", str(config(workdir, 1000)))
    with sup.client(timeout=60) as fast, sup.client(timeout=60) as slow:
        # The same flood read as it comes first: what the supervisor allocates
        # for it (buffers, arenas) is then in the baseline.
        # A client that reads as fast as it can may fall behind a flood too:
        # then it is told, and nothing goes unaccounted.
        warm = fast.run("warm", FLOOD)
        assert warm.text == "exit 0" and accounted(warm.events) == LINES
        before = rss(sup.pid)

        req = slow.submit(Kind.SEND, {"text": FLOOD}, session="slow")  # and never read
        wait_for(lambda: "slow_consumer" in sup.log(), what="the slow client to lag")
        # Meanwhile another client's session is served whole.
        other = fast.run("other", "sh seq 1 3000")
        assert other.text == "exit 0" and accounted(other.events) == 3000
        wait_for(lambda: turn_over(fast, "slow"), what="the unread turn to end")
        held = rss(sup.pid) - before
        assert held < RSS_BOUND, f"the supervisor grew {held} bytes for a client that reads nothing"

        # It reads again: what it got, then how many it missed, then its reply.
        answers = answers_to(slow, req)
        assert answers[-1].kind is Kind.REPLY and answers[-1].body["text"] == "exit 0"
        events = [m.body for m in answers[:-1]]
        lines = [int(b["data"][:8]) for b in events if b["type"] == "output"]
        assert lines == sorted(lines) and len(set(lines)) == len(lines)
        dropped = [b["data"] for b in events if b["type"] == "dropped"]
        assert dropped and all(d["reason"] == "slow_consumer" for d in dropped)
        assert len(lines) + sum(d["count"] for d in dropped) == LINES  # every one accounted for
        assert all(m.session == "slow" for m in answers)
        # And it is served as before.
        assert slow.run("slow", "pid").ok
    assert "slow_consumer_caught_up" in sup.log()


def test_a_watcher_that_stops_reading_is_told_what_it_missed_and_keeps_watching(
    supervisor_factory, workdir: Path
) -> None:
    sup = supervisor_factory("--config", str(config(workdir, 200)))
    with sup.client(timeout=60) as client, sup.client(timeout=60) as watcher:
        client.run("w", "pid")
        watch = watcher.submit(Kind.WATCH, {"replay": 0}, session="w")
        assert watcher.next(timeout=30).body["type"] == "watching"
        # The watcher stops reading while the session streams 20,000 lines.
        done = client.run("w", "sh seq 1 20000")
        assert done.text == "exit 0" and accounted(done.events) == 20_000
        wait_for(lambda: "slow_consumer" in sup.log(), what="the watcher to lag")
        # A later turn, while it still lags: counted too, never lost.
        assert client.run("w", "env HERMES_SESSION_KEY").text == "w"
        # It reads again: what it got, then how many it missed (told once it
        # has caught up), and it still watches: a turn after that shows up.
        seen: list[dict] = []
        missed = 0
        marker = None
        while True:
            msg = watcher.next(timeout=60)
            assert msg.re == watch
            body = msg.body
            if body["type"] == "dropped":
                missed += body["data"]["count"]
                if marker is None:
                    marker = client.submit(Kind.SEND, {"text": "sh echo after"}, session="w")
                continue
            seen.append(body)
            if marker is not None and body["type"] == "reply" and body.get("turn") == marker:
                break
        outputs = [b["data"] for b in seen if b["type"] == "output"]
        assert missed > 0 and "after" in outputs
        lines = [int(x) for x in outputs if x.isdigit()]
        assert lines == sorted(lines)


def test_a_lagging_client_gets_an_answer_to_every_request(supervisor_factory, workdir) -> None:
    """A front end with many turns in flight (the HTTP endpoint has one per
    conversation) that falls behind must still get every turn's answer:
    none may be dropped to bound memory, or that turn waits forever. Its
    events may be dropped, counted."""
    sup = supervisor_factory("--config", str(config(workdir, 4)))
    sessions, per_session = 8, 250  # 2,000 answers: past what zmq and the kernel buffer
    with sup.client(timeout=120) as slow, sup.client(timeout=120) as watcher:
        asked = {
            slow.submit(Kind.SEND, {"text": "x" * 2000}, session=f"s{n}")
            for n in range(sessions)
            for _ in range(per_session)
        }
        # Not read until every turn is over, and everyone else is served meanwhile.
        wait_for(
            lambda: (
                sum(r["turns"] for r in watcher.sessions()) >= sessions * per_session
                and all(r["state"] == "idle" for r in watcher.sessions())
            ),
            timeout=300,
            what="every turn to end",
        )
        answered = {}
        while len(answered) < len(asked):
            msg = slow.next(timeout=60)
            if msg.kind is not Kind.EVENT:
                answered[msg.re] = msg
        assert set(answered) == asked
        kinds = {m.kind for m in answered.values()}
        assert kinds <= {Kind.REPLY, Kind.ERROR}, kinds
        errors = [m.body for m in answered.values() if m.kind is Kind.ERROR]
        assert all(e["code"] == "overloaded" for e in errors), errors[:3]
