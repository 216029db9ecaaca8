"""A turn runs at most once, whatever happens to its supervisor, and its
client can learn what became of it: real supervisors, killed with SIGKILL,
restarted on the same data, or sharing it with another node."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest

from hermes_sup.client import Output, SupervisorError
from hermes_sup.protocol import session_dir_name
from hermes_sup.supervisor.journal import JOURNAL_FILE, read

from . import waiting
from .test_leases import two_nodes

wait_for = partial(waiting.wait_for, timeout=30.0, every=0.05)


def printed(reply) -> str:  # noqa: ANN001
    return "".join(e.line for e in reply.events if isinstance(e, Output))


def kill_hard(sup) -> None:  # noqa: ANN001
    """SIGKILL a supervisor (its workers go with it: parent-death signal)."""
    sup.proc.send_signal(signal.SIGKILL)
    sup.proc.wait(10)
    sup._log.close()


def runs(sup, key: str) -> list[str]:  # noqa: ANN001
    """The lines the session's turns appended to ran.txt."""
    path = sup.data_dir / "sessions" / session_dir_name(key) / "workspace" / "ran.txt"
    return path.read_text().split() if path.exists() else []


def test_a_turn_sent_again_after_its_supervisor_was_killed_is_never_run_again(
    supervisor_factory,
):
    sup = supervisor_factory()
    with sup.client() as c:
        first = c.run("alice", "sh echo one >> ran.txt; echo done", turn_id="t-one")
        assert printed(first).split() == ["done"]
        assert c.turn_status("alice", "t-one")["state"] == "ended"
        assert c.turn_status("alice", "never-sent")["state"] == "unknown"
        # Running when the supervisor dies: its fate is recorded as such.
        turn = c.send("alice", "sh echo two >> ran.txt; sleep 60", turn_id="t-two")
        next(iter(turn))
        wait_for(lambda: runs(sup, "alice") == ["one", "two"], what="the second turn running")
        state = c.turn_status("alice", "t-two")
        assert state["state"] == "running" and state["node"]
    kill_hard(sup)
    journal = sup.data_dir / "sessions" / session_dir_name("alice")
    entries, _, _ = read(journal)
    assert entries["t-two"].started and entries["t-two"].ended is None

    sup.start()
    with sup.client() as c:
        # Read from the journal: no one holds the session, the turn never ended.
        state = c.turn_status("alice", "t-two")
        assert state["state"] == "interrupted" and state["started"], state
        # The same ids again, from a new client of a new supervisor.
        again = c.run("alice", "sh echo one >> ran.txt; echo done", turn_id="t-one")
        assert again.text == first.text and printed(again) == ""  # its recorded reply
        with pytest.raises(SupervisorError) as err:
            c.run("alice", "sh echo two >> ran.txt; sleep 60", turn_id="t-two")
        assert err.value.code == "interrupted" and "was not run again" in str(err.value)
        ended = c.turn_status("alice", "t-two")
        assert ended["state"] == "ended" and ended["outcome"]["body"]["code"] == "interrupted"
        # A new id is a new turn.
        assert c.run("alice", "sh echo three >> ran.txt", turn_id="t-three").ok
    assert runs(sup, "alice") == ["one", "two", "three"]


def test_a_node_sharing_the_data_answers_for_a_turn_another_node_ran(
    supervisor_factory, workdir: Path
):
    a, b = two_nodes(supervisor_factory, workdir, "node-a", "node-b")
    with a.client() as ca, b.client() as cb:
        turn = ca.send("bob", "sh echo ran >> ran.txt; sleep 60", turn_id="t-bob")
        next(iter(turn))
        wait_for(lambda: runs(a, "bob") == ["ran"], what="the turn running on node-a")
        # node-b reads node-a's journal: running there.
        state = cb.turn_status("bob", "t-bob")
        assert state["state"] == "running" and state["node"] == "node-a", state
        assert ca.cancel("bob", "t-bob")
        assert turn.collect().text == "cancelled"
        # node-a records the end just after its client has it: node-b,
        # reading the journal, sees it a moment later.
        done = wait_for(
            lambda: (s := cb.turn_status("bob", "t-bob"))["state"] == "ended" and s,
            what="the end in node-a's journal",
        )
        assert done["node"] == "node-a" and done["outcome"]["body"]["text"] == "cancelled"
    kill_hard(a)
    with b.client() as cb:
        # The session moves to node-b, which never saw the turn: the
        # journal's answer (the cancelled turn's), not a second run.
        reply = wait_for(
            lambda: _send_or_none(cb, "bob", "t-bob"), what="node-b taking the session over"
        )
        assert reply.text == "cancelled", reply
    assert runs(a, "bob") == ["ran"]


def _send_or_none(client, key: str, turn_id: str):  # noqa: ANN001, ANN202
    try:
        return client.run(key, "sh echo ran >> ran.txt; sleep 60", turn_id=turn_id)
    except SupervisorError as exc:
        if exc.code == "moved":
            return None
        raise


def test_a_torn_journal_record_is_ignored_and_the_journal_stays_bounded(supervisor_factory):
    from hermes_sup.supervisor.journal import JOURNAL_TURNS

    sup = supervisor_factory()
    with sup.client() as c:
        for i in range(2 * JOURNAL_TURNS + 10):
            c.run("carol", f"echo {i}", turn_id=f"c-{i}")
        path = sup.data_dir / "sessions" / session_dir_name("carol") / JOURNAL_FILE
        entries, since, count = read(path.parent)
        assert len(entries) <= 2 * JOURNAL_TURNS and count <= 4 * JOURNAL_TURNS + 2
        assert since is not None and f"c-{2 * JOURNAL_TURNS + 9}" in entries
        assert "c-0" not in entries
        # A write cut short (a crash mid-record) leaves a torn tail: ignored.
        with open(path, "ab") as f:
            f.write(b"\x85\xa1t\xa5c-new")
        assert c.turn_status("carol", f"c-{2 * JOURNAL_TURNS + 9}")["state"] == "ended"
    assert os.path.getsize(path) < 1_000_000


def test_the_cli_sends_by_turn_id_and_says_what_became_of_it(supervisor_factory):
    sup = supervisor_factory()

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "hermes_sup.cli", "--state-dir", str(sup.state_dir), *args],
            capture_output=True,
            text=True,
            timeout=120,
        )

    assert cli("turn", "status", "dave", "order-42").returncode == 4  # unknown
    for _ in range(2):
        sent = cli("send", "dave", "--turn-id", "order-42", "sh echo placed >> ran.txt")
        assert sent.returncode == 0, sent.stderr
    assert runs(sup, "dave") == ["placed"]
    state = cli("turn", "status", "dave", "order-42")
    assert state.returncode == 0 and "order-42 ended" in state.stdout, state
    assert "reply 'exit 0'" in state.stdout
    as_json = json.loads(cli("turn", "status", "dave", "order-42", "--json").stdout)
    assert as_json["state"] == "ended" and as_json["outcome"]["kind"] == "reply"
    bad = cli("send", "dave", "--turn-id", "x" * 65, "echo")
    assert bad.returncode == 2 and "--turn-id" in bad.stderr
