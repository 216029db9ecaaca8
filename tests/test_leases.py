"""Many supervisors on one data directory: a session is served by one of them
at a time (its lease), a dead one's sessions are taken over with their
files, a cut-off old owner can never write after another took its session
(the fencing epoch), and spare directories never collide. Real supervisors."""

from __future__ import annotations

import os
import signal
import time
from functools import partial
from pathlib import Path

import psutil
import pytest
import zmq

from hermes_sup.client import Output, SupervisorError
from hermes_sup.local import statedir
from hermes_sup.protocol import Kind, Message, decode, encode, session_dir_name
from hermes_sup.supervisor import leases

from . import waiting

pytestmark = pytest.mark.e2e


def two_nodes(supervisor_factory, workdir: Path, *names: str):  # noqa: ANN001, ANN201
    """One supervisor per name, each with its own state directory and the
    same data directory, told it is shared (as on NFS: the tests here
    take leases over by hand, which a local lock never allows)."""
    shared = workdir / "shared"
    made = []
    for name in names:
        root = workdir / name
        root.mkdir()
        config = root / "hermes-sup.toml"
        config.write_text(f'node = "{name}"\nshared_data = "yes"\n')
        sup = supervisor_factory("--config", str(config), root=root, start=False)
        sup.data_dir = shared
        made.append(sup.start())
    return made


wait_for = partial(waiting.wait_for, timeout=30.0, every=0.05)


def raw_request(sup, msg: Message) -> Message:  # noqa: ANN001
    """One request on a raw socket: the whole answer, body fields and all."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(statedir.endpoint(sup.state_dir, statedir.CONTROL_SOCKET))
        key = statedir.read_key(sup.state_dir)
        sock.send_multipart(encode(msg, key))
        assert sock.poll(15_000), "no answer"
        return decode(sock.recv_multipart(), key)
    finally:
        sock.close(0)
        ctx.term()


def session_dir(sup, key: str) -> Path:  # noqa: ANN001
    return sup.data_dir / "sessions" / session_dir_name(key)


def test_one_key_runs_on_one_supervisor_and_moves_when_it_dies(supervisor_factory, workdir):
    a, b = two_nodes(supervisor_factory, workdir, "node-a", "node-b")
    with a.client() as ca:
        assert ca.run("alice", "write notes.txt kept across nodes").ok
        pid_a = int(ca.run("alice", "pid").text)
    with b.client() as cb:
        with pytest.raises(SupervisorError) as err:
            cb.run("alice", "pid")
        assert err.value.code == "moved" and "node node-a" in err.value.message
        # The body names the holder for a router: `node`, and why.
        asked = Message(Kind.SEND, {"text": "sh echo once >> moved.txt"}, session="alice")
        answer = raw_request(b, asked)
        assert answer.kind is Kind.ERROR and answer.body["code"] == "moved"
        assert answer.body["node"] == "node-a" and answer.body["reason"] == "leased"
        # Requests about the session are sent where it lives, too.
        with pytest.raises(SupervisorError) as err:
            cb.kill("alice", purge=True)
        assert err.value.code == "moved"
    assert session_dir(a, "alice").is_dir() and os.path.exists(f"/proc/{pid_a}")

    # node-a dies without a word: the kernel drops its locks, node-b takes over.
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait(10)
    # The request refused as `moved` spent nothing: the same signed frame
    # (a router's resend) is taken once the lease is free, and only once.
    for _ in range(2):
        again = raw_request(b, asked)
        assert again.kind is not Kind.ERROR, again
    with b.client() as cb:
        reply = wait_for(lambda: _run_or_none(cb, "alice", "sh cat notes.txt"), what="takeover")
        printed = "".join(e.line for e in reply.events if isinstance(e, Output))
        assert printed.strip() == "kept across nodes"
        assert int(cb.run("alice", "pid").text) != pid_a
        ran = cb.run("alice", "sh cat moved.txt")
        assert "".join(e.line for e in ran.events if isinstance(e, Output)).split() == ["once"]
    epoch, _ = leases.read_epoch(session_dir(b, "alice"))
    assert epoch >= 2  # a, then b
    with b.client() as cb:
        seen = cb.inspect("alice")
        assert seen["node"] == "node-b" and seen["lease_epoch"] == epoch
    holder = leases.read_holder(session_dir(b, "alice"))
    assert holder is not None and holder.node == "node-b" and holder.pid == b.pid
    wait_for(lambda: not os.path.exists(f"/proc/{pid_a}"), what="node-a's worker gone")


def _run_or_none(client, key: str, text: str):  # noqa: ANN001, ANN202
    try:
        return client.run(key, text)
    except SupervisorError as exc:
        assert exc.code == "moved", exc
        return None


def test_a_stale_owner_cannot_write_after_a_new_owner_took_the_session(supervisor_factory, workdir):
    """A partition, simulated: another node takes the session as a new owner
    does (a new epoch, its name in the lease file) while node-a still
    believes it owns it. node-a's next write into the session's directory
    (new options in session.json) is refused: logged, the file unchanged,
    the client told `moved`, node-a's worker stopped and the lease let go."""
    (a,) = two_nodes(supervisor_factory, workdir, "node-a")
    with a.client() as ca:
        ca.open("bob", options={"label": "first"})
        pid = int(ca.run("bob", "pid").text)
        path = session_dir(a, "bob")
        before = (path / "session.json").read_bytes()
        assert b'"first"' in before
        epoch, token = leases.read_epoch(path)
        assert epoch >= 1 and token
        # The new owner's two writes (it holds the lock where node-a's was lost).
        leases.write_epoch(path, epoch + 1, "f" * 16)
        (path / leases.LEASE_FILE).write_text('{"node": "node-c", "endpoint": null, "pid": 1}')

        with pytest.raises(SupervisorError) as err:
            ca.open("bob", options={"label": "second"})
        assert err.value.code == "moved" and "node node-c" in err.value.message
        assert (path / "session.json").read_bytes() == before
        assert leases.read_epoch(path) == (epoch + 1, "f" * 16)
        wait_for(lambda: "lease_lost" in a.log(), what="lease_lost logged")
        wait_for(lambda: not os.path.exists(f"/proc/{pid}"), what="the stale worker stopped")
        row = wait_for(
            lambda: next(
                (r for r in ca.sessions() if r["key"] == "bob" and r["state"] == "exited"), None
            ),
            what="bob exited",
        )
        assert row["node"] == "node-a"
    # node-a let the lock go: the new owner could take it.
    assert leases.Leases("node-c").holder_elsewhere(path) is None


def test_a_stale_owner_runs_no_turn_after_a_new_owner_took_the_session(supervisor_factory, workdir):
    """The fence is checked as each turn starts, too (a turn writes into the
    session's files): a turn on a session taken over is answered `moved`,
    its worker killed before it could run it."""
    (a,) = two_nodes(supervisor_factory, workdir, "node-a")
    with a.client() as ca:
        pid = int(ca.run("carol", "pid").text)
        path = session_dir(a, "carol")
        epoch, _ = leases.read_epoch(path)
        leases.write_epoch(path, epoch + 1, "e" * 16)
        with pytest.raises(SupervisorError) as err:
            ca.run("carol", "write stale.txt from the old owner")
        assert err.value.code == "moved" and "lease was lost" in err.value.message
        assert not (path / "workspace" / "stale.txt").exists()
        wait_for(lambda: not os.path.exists(f"/proc/{pid}"), what="the stale worker killed")
        assert leases.read_epoch(path) == (epoch + 1, "e" * 16)
        assert "lease_lost" in a.log()


def test_a_worker_that_lost_its_lease_mid_turn_is_stopped_without_a_word_to_its_node(
    supervisor_factory, workdir
):
    """An owner cut off from the file server, simulated: while node-a's
    worker runs a long turn writing into the workspace, the session's lease
    file is renamed away (what the server does once the client's lease ran
    out) and node-b takes the session. node-a is asked nothing more, yet it
    finds the lease lost on its own and kills the worker and what it
    started: the two owners' writes overlap for a moment only."""
    a, b = two_nodes(supervisor_factory, workdir, "node-a", "node-b")
    path = session_dir(a, "dave")
    ticks = path / "workspace" / "ticks"
    loop = 'while :; do echo "A $$ $(date +%s.%N)" >> ticks; sleep 0.05; done'
    with a.client(timeout=60) as ca:
        pid = int(ca.run("dave", "pid").text)
        turn = ca.submit(Kind.SEND, {"text": f"sh {loop}"}, session="dave")
        wait_for(lambda: ticks.exists() and ticks.read_text().count("\n") >= 2, what="ticks")
        started = [p.pid for p in psutil.Process(pid).children(recursive=True)]
        assert started, "the turn's shell"
        os.rename(path / leases.LEASE_FILE, path / "lease.cut-off")
        taken_at = time.time()
        with b.client() as cb:
            assert int(cb.run("dave", "pid").text) != pid
        wait_for(lambda: not os.path.exists(f"/proc/{pid}"), what="node-a's worker killed")
        for child in started:
            wait_for(lambda: not psutil.pid_exists(child), what="what it started killed")  # noqa: B023
        answer = ca.next()
        while answer.kind is Kind.EVENT:
            answer = ca.next()
        assert answer.re == turn and answer.kind is Kind.ERROR, answer
        assert answer.body["code"] == "moved", answer
    assert "lease_lost" in a.log()
    last = max(float(line.split()[2]) for line in ticks.read_text().splitlines())
    # The measure, for the record (not a deadline: the machine may be loaded).
    print(f"overlap: node-a's worker wrote {last - taken_at:.2f}s after node-b was asked")
    assert leases.read_holder(path) is not None and leases.read_holder(path).node == "node-b"


def test_spare_directories_of_two_supervisors_never_collide(supervisor_factory, workdir):
    a, b = two_nodes(supervisor_factory, workdir, "node-a", "node-b")
    base = a.data_dir / ".spare-sessions"
    roots = sorted(p.name for p in base.iterdir() if p.is_dir())
    assert len(roots) == 2 and roots[0].startswith("node-a-") and roots[1].startswith("node-b-")
    with a.client() as ca, b.client() as cb:
        for i in range(6):
            assert ca.run(f"a{i}", "env HERMES_SESSION_KEY").text == f"a{i}"
            assert cb.run(f"b{i}", "env HERMES_SESSION_KEY").text == f"b{i}"
        # Each one's spares are still its own, refilled, none taken twice.
        for root in roots:
            assert len(list((base / root).iterdir())) >= 1
    keys = [f"{side}{i}" for side in "ab" for i in range(6)]
    made = sorted(p.name for p in (a.data_dir / "sessions").iterdir())
    assert made == sorted(session_dir_name(k) for k in keys)
    # b stops: a restarted node sweeps only spares nobody holds.
    b.stop()
    a.stop()
    c = two_nodes(supervisor_factory, workdir, "node-c")[0]
    left = sorted(p.name for p in base.iterdir() if p.is_dir())
    assert len(left) == 1 and left[0].startswith("node-c-")
    with c.client() as cc:
        assert cc.run("c0", "pid").ok


def test_two_supervisors_racing_for_new_keys_never_both_run_one(supervisor_factory, workdir):
    """The same new keys sent to both supervisors at once: for each key one
    runs it, the other answers `moved` naming it; never both."""
    a, b = two_nodes(supervisor_factory, workdir, "node-a", "node-b")
    keys = [f"race{i}" for i in range(12)]
    with a.client(timeout=30) as ca, b.client(timeout=30) as cb:
        sent = {
            name: {client.submit(Kind.SEND, {"text": "pid"}, session=k): k for k in keys}
            for name, client in (("node-a", ca), ("node-b", cb))
        }
        finals: dict[str, dict[str, Message]] = {"node-a": {}, "node-b": {}}
        for name, client in (("node-a", ca), ("node-b", cb)):
            while len(finals[name]) < len(keys):
                msg = client.next()
                if msg.kind is not Kind.EVENT:
                    finals[name][sent[name][msg.re]] = msg
    for key in keys:
        answers = {name: finals[name][key] for name in finals}
        ran = [name for name, msg in answers.items() if msg.kind is Kind.REPLY]
        assert len(ran) == 1, (key, answers)
        other = "node-b" if ran[0] == "node-a" else "node-a"
        refused = answers[other]
        assert refused.kind is Kind.ERROR and refused.body["code"] == "moved", refused
        assert refused.body["node"] == ran[0]
