"""One client cannot take another's turn, exhaust what others share, or make
the supervisor hold what it sent for good; and what is on disk stays
visible after a restart. Real supervisors, real clients."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from hermes_sup.client import Client, SupervisorError, Timeout
from hermes_sup.protocol import Kind, Message, session_dir_name
from hermes_sup.supervisor.resends import DEDUP_BYTES, KEEP_ANSWER_LIMIT
from hermes_sup.supervisor.watchers import MAX_PER_CLIENT, MAX_WATCHERS

pytestmark = pytest.mark.e2e

RUNTIMES = str(Path(__file__).parent / "runtimes")


def turn_id_seen_by(watcher: Client, session: str) -> str:
    """Watch `session` (with its history) until a turn shows up; its id,
    as any client that watches sees it."""
    watcher.submit(Kind.WATCH, {"replay": 50}, session=session)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        msg = watcher.next()
        if msg.kind is Kind.EVENT and msg.body.get("type") == "turn":
            return str(msg.body["turn"])
    raise AssertionError(f"no turn of {session!r} was seen")


def read_until(client: Client, req: str, last: str, got: list[Message]) -> list[Message]:
    """Answers to `req` (others are dropped) into `got`, up to an event of
    type `last`, or up to the final answer if `last` is "final"."""
    while True:
        msg = client.next()
        if msg.re != req:
            continue
        got.append(msg)
        if msg.kind is not Kind.EVENT or msg.body.get("type") == last:
            return got


def until_final(client: Client, req: str, got: list[Message] | None = None) -> list[Message]:
    """Every answer to `req` up to its reply or error."""
    return read_until(client, req, "final", [] if got is None else got)


def statuses(messages: list[Message]) -> list[Any]:
    return [
        m.body["data"].get("state")
        for m in messages
        if m.kind is Kind.EVENT
        and m.body.get("type") == "status"
        and isinstance(m.body.get("data"), dict)
    ]


def refused_resend(client: Client, session: str, turn: str) -> SupervisorError:
    """Resend `turn` from `client`: the supervisor must refuse it."""
    client.submit(Kind.SEND, {"text": "pid"}, session=session, msg_id=turn)
    with pytest.raises(SupervisorError) as refused:
        client.answer(turn)
    return refused.value


# ------------------------------------------------------------ resends


def test_another_local_client_cannot_take_a_running_turn_or_its_reply(supervisor) -> None:
    with supervisor.client() as victim, supervisor.client() as thief:
        req = victim.submit(Kind.SEND, {"text": "ask echo mine"}, session="v")
        seen = read_until(victim, req, "approval", [])
        turn = turn_id_seen_by(thief, "v")
        assert turn == req
        error = refused_resend(thief, "v", turn)
        assert error.code == "replayed" and "still connected" in error.message
        assert victim.approve("v", "once") == "once"
        answers = until_final(victim, req, seen)
        assert answers[-1].kind is Kind.REPLY and answers[-1].body["text"] == "exit 0"
        assert "resend_refused" in statuses(answers)  # the victim is told someone tried
        output = [m.body["data"] for m in answers if m.body.get("type") == "output"]
        assert output == ["mine"]
        # Once it has ended, its kept reply is not handed out either.
        error = refused_resend(thief, "v", turn)
        assert error.code == "replayed"
        # A resend naming another session is refused whoever makes it.
        mine = victim.send("v", "pid")
        mine.collect()
        victim.submit(Kind.SEND, {"text": "pid"}, session="other", msg_id=mine.id)
        with pytest.raises(SupervisorError) as elsewhere:
            victim.answer(mine.id)
        assert elsewhere.value.code == "replayed" and "another session" in elsewhere.value.message
    assert "resend_refused" in supervisor.log()


def test_a_client_that_reconnected_gets_its_turn_back(supervisor) -> None:
    """A resend from a new connection is the turn's own client's once its
    old connection is gone: the turn moves, and still runs once."""
    with supervisor.client() as first:
        req = first.submit(Kind.SEND, {"text": "ask echo again"}, session="r")
        read_until(first, req, "approval", [])
    with supervisor.client() as second:  # a new socket, a new routing id
        second.submit(Kind.SEND, {"text": "ask echo again"}, session="r", msg_id=req)
        ack = second.next()
        assert ack.re == req and statuses([ack]) == ["duplicate"]
        assert second.approve("r", "once") == "once"
        answers = until_final(second, req)
        assert answers[-1].kind is Kind.REPLY and answers[-1].body["text"] == "exit 0"
        second.submit(Kind.SEND, {"text": "ask echo again"}, session="r", msg_id=req)
        assert second.next().body == answers[-1].body  # the kept reply, no second run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_remote_client_cannot_take_a_local_clients_turn(supervisor_factory, workdir) -> None:
    port = free_port()
    sup = supervisor_factory("--tcp", str(port))
    conn_file = workdir / "web.json"
    made = subprocess.run(
        [sys.executable, "-m", "hermes_sup.cli", "keys", "generate", "web",
         "--endpoint", f"127.0.0.1:{port}", "-o", str(conn_file)],
        capture_output=True, text=True, timeout=30,
        env={**os.environ, "HERMES_SUP_DATA_DIR": str(sup.data_dir)},
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    with sup.client() as victim, Client.from_connection_file(conn_file) as thief:
        req = victim.submit(Kind.SEND, {"text": "ask echo local"}, session="v")
        seen = read_until(victim, req, "approval", [])
        turn = turn_id_seen_by(thief, "v")
        error = refused_resend(thief, "v", turn)
        assert error.code == "replayed" and "another key" in error.message
        assert victim.approve("v", "once") == "once"
        answers = until_final(victim, req, seen)
        assert answers[-1].kind is Kind.REPLY and answers[-1].body["text"] == "exit 0"
        assert refused_resend(thief, "v", turn).code == "replayed"


# ------------------------------------------------------- resend cache


def rss(pid: int) -> int:
    return int(psutil.Process(pid).memory_info().rss)


def test_large_replies_are_not_kept_for_resends(supervisor) -> None:
    big = "x" * (1024 * 1024)  # the probe echoes it: a 1 MiB reply
    count = 50
    with supervisor.client() as client:
        for _ in range(5):  # the allocator's working set for one such turn
            assert len(client.run("big", big).text) == len(big)
        before = rss(supervisor.pid)
        ids = []
        for _ in range(count):
            turn = client.send("big", big)
            assert len(turn.collect().text) == len(big)
            ids.append(turn.id)
        grown = rss(supervisor.pid) - before
        print(f"supervisor RSS grew {grown} bytes over {count} replies of {len(big)} bytes")
        # Every reply kept was 1 MiB each for good; now none of them is.
        assert grown < count * len(big) // 4, f"supervisor RSS grew {grown} bytes"
        client.submit(Kind.SEND, {"text": big}, session="big", msg_id=ids[-1])
        with pytest.raises(SupervisorError) as not_kept:
            client.answer(ids[-1])
        assert not_kept.value.code == "too_large"
        assert "too large to keep" in not_kept.value.message
        assert "not run again" in not_kept.value.message


def test_kept_answers_give_way_to_newer_ones_beyond_the_byte_budget(supervisor) -> None:
    text = "y" * (KEEP_ANSWER_LIMIT - 1024)  # kept, and DEDUP_BYTES holds few of them
    count = DEDUP_BYTES // len(text) + 4
    with supervisor.client() as client:
        ids = []
        for _ in range(count):
            turn = client.send("kept", text)
            turn.collect()
            ids.append(turn.id)
        client.submit(Kind.SEND, {"text": text}, session="kept", msg_id=ids[-1])
        assert client.answer(ids[-1]).body["text"] == text  # the newest is kept
        client.submit(Kind.SEND, {"text": text}, session="kept", msg_id=ids[0])
        with pytest.raises(SupervisorError) as gone:
            client.answer(ids[0])
        assert gone.value.code == "expired" and "no longer kept" in gone.value.message
        assert client.run("kept", "sh echo ran").events  # still served
        assert len(client.sessions()) == 1


# ----------------------------------------------------- sessions on disk


def hs(sup, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hermes_sup.cli", "--state-dir", str(sup.state_dir), *args],
        capture_output=True,
        text=True,
        timeout=30,
        env=dict(os.environ, NO_COLOR="1"),
    )


def wait_for_lines(client: Client, session: str, count: int) -> None:
    """Until the session's log holds `count` printed lines (its pipe is read
    apart from its replies)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if len([x for x in client.logs(session, 100) if x.startswith("line ")]) >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"{session}'s log never held {count} lines")


def test_sessions_on_disk_are_listed_read_and_purged_after_a_restart(supervisor_factory) -> None:
    env = dict(os.environ, PYTHONPATH=RUNTIMES)
    sup = supervisor_factory("--allow-runtime", "hs_printer:make", env=env)
    with sup.client() as client:
        client.run("disk-a", "pid")
        client.open("disk-b", runtime="hs_printer:make")
        assert client.run("disk-b", "print 3").text == "printed 3"
        wait_for_lines(client, "disk-b", 3)
    sup.stop()
    sup.start()
    with sup.client() as client:
        rows = {r["key"]: r for r in client.sessions()}
        assert set(rows) == {"disk-a", "disk-b"}
        assert all(r["state"] == "exited" and r["pid"] is None for r in rows.values())
        assert rows["disk-a"]["runtime"] == "probe"
        assert rows["disk-b"]["runtime"] == "hs_printer:make"  # as it chose
        assert [r["key"] for r in client.sessions(state="exited")] == ["disk-a", "disk-b"]
        assert client.sessions(state="idle") == []
        assert "sessions_on_disk found=2" in sup.log()
        logged = client.logs("disk-b", 100)
        assert [line for line in logged if line.startswith("line ")] == [
            f"line {i:06d} of 3" for i in range(3)
        ]
        killed = client.kill("disk-a", purge=True)
        assert killed.reason == "not running, data purged"
        assert not (sup.data_dir / "sessions" / session_dir_name("disk-a")).exists()
        assert [r["key"] for r in client.sessions()] == ["disk-b"]
        # A stored session runs again with the options it was created with.
        assert client.run("disk-b", "print 1").text == "printed 1"
        assert [(r["key"], r["state"]) for r in client.sessions()] == [("disk-b", "idle")]
    listed = hs(sup, "list")
    assert listed.returncode == 0 and "disk-b" in listed.stdout and "disk-a" not in listed.stdout


# ---------------------------------------------------- watchers, follows


def test_one_client_cannot_take_every_watcher_slot(supervisor) -> None:
    with supervisor.client() as greedy, supervisor.client() as other:
        greedy.run("w", "pid")
        for _ in range(MAX_WATCHERS):
            greedy.submit(Kind.WATCH, {}, session="w")
        answers = [greedy.next() for _ in range(MAX_WATCHERS)]
        watching = [m for m in answers if m.kind is Kind.EVENT]
        refused = [m for m in answers if m.kind is Kind.ERROR]
        assert len(watching) == MAX_PER_CLIENT
        assert {m.body["code"] for m in refused} == {"busy"}
        assert f"limit {MAX_PER_CLIENT} per client" in refused[0].body["message"]
        # Everyone else can still watch.
        other.submit(Kind.WATCH, {}, session="w")
        assert other.next().body == {"type": "watching", "data": None}
        # Ending one makes room for one.
        greedy.submit(Kind.UNWATCH, {"watch": watching[0].re})
        greedy.submit(Kind.WATCH, {}, session="w")
        again = [greedy.next() for _ in range(2)]
        assert sorted(m.body["type"] for m in again) == ["unwatched", "watching"]


def test_log_follows_are_capped_per_client(supervisor_factory) -> None:
    env = dict(os.environ, PYTHONPATH=RUNTIMES)
    sup = supervisor_factory("--agent", "hs_printer:make", env=env)
    tries, lines = 200, 50
    with sup.client() as greedy, sup.client() as client:
        client.run("f", "print 1")
        for _ in range(tries):
            greedy.submit(Kind.LOGS, {"lines": 0, "follow": True}, session="f")
        answers = [greedy.next() for _ in range(tries)]
        following = {m.re for m in answers if m.kind is Kind.LOG_LINES}
        refused = [m for m in answers if m.kind is Kind.ERROR]
        assert len(following) == MAX_PER_CLIENT
        assert {m.body["code"] for m in refused} == {"busy"}
        assert f"limit {MAX_PER_CLIENT} per client" in refused[0].body["message"]
        assert client.run("f", f"print {lines}").text == f"printed {lines}"
        # Each follow gets each line once; the refused ones get none.
        printed = 0
        deadline = time.monotonic() + 20
        while printed < MAX_PER_CLIENT * lines and time.monotonic() < deadline:
            msg = greedy.next()
            assert msg.re in following
            printed += str(msg.body.get("data", "")).startswith("line ")
        while True:  # and nothing more comes
            try:
                msg = greedy.next(timeout=1.0)
            except Timeout:
                break
            printed += str(msg.body.get("data", "")).startswith("line ")
        assert printed == MAX_PER_CLIENT * lines
