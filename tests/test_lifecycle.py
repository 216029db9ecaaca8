"""Workers that die, sessions that are killed, a supervisor that is killed:
real processes throughout, checked with psutil."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from hermes_sup.client import SupervisorError
from hermes_sup.protocol import Kind

from .conftest import processes_mentioning, wait_gone

pytestmark = pytest.mark.e2e

# Three kinds of grandchild: a plain background child, one that left the
# process group with setsid, and a daemon whose parent exited at once.
GRANDCHILDREN = (
    "sh sleep 1000 >/dev/null 2>&1 & "
    "setsid sleep 1001 >/dev/null 2>&1 & "
    "(setsid sh -c 'sleep 1002' >/dev/null 2>&1 &) ; "
    "echo started"
)


def worker_pid(client, key: str) -> int:
    return int(client.run(key, "pid").text)


def tree_of(pid: int, expect: int) -> list[psutil.Process]:
    """The worker's descendants, once all `expect` sleeps have started."""
    deadline = time.monotonic() + 5
    while True:
        procs = psutil.Process(pid).children(recursive=True)
        sleeps = [p for p in procs if p.name() == "sleep"]
        if len(sleeps) >= expect or time.monotonic() > deadline:
            return procs
        time.sleep(0.02)


def all_gone(procs: list[psutil.Process], timeout: float = 5.0) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.parametrize("force", [False, True])
def test_kill_leaves_no_descendant_behind(supervisor, force: bool) -> None:
    with supervisor.client() as client:
        pid = worker_pid(client, "victim")
        assert client.run("victim", "write keep.txt data").ok
        assert client.run("victim", GRANDCHILDREN).text == "exit 0"
        procs = tree_of(pid, expect=3)
        assert len([p for p in procs if p.name() == "sleep"]) == 3
        other = worker_pid(client, "bystander")

        result = client.kill("victim", force=force)
        assert result.pid == pid
        assert result.reason == ("killed" if force else "stopped")
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        assert all_gone(procs, timeout=3) == []

        rows = {r["key"]: r for r in client.sessions()}
        assert rows["victim"]["state"] == "exited" and rows["victim"]["pid"] is None
        assert rows["bystander"]["state"] == "idle" and rows["bystander"]["pid"] == other

        # Data stays; the next message starts a fresh worker on it.
        reply = client.run("victim", "sh cat keep.txt")
        events = reply.events
        assert events[-1].data == "data"
        assert worker_pid(client, "victim") != pid


def test_killing_an_unknown_session_is_an_error(supervisor) -> None:
    with supervisor.client() as client:
        with pytest.raises(SupervisorError) as err:
            client.kill("nobody")
        assert err.value.code == "no_such_session"


def test_worker_killed_mid_turn_is_reported_and_others_keep_working(supervisor_factory) -> None:
    supervisor = supervisor_factory("--min-uptime", "0")  # a crash, not a fast failure
    with supervisor.client(timeout=10) as client:
        client.run("steady", "pid")
        req = client.submit(Kind.SEND, {"text": "sleep 30"}, session="doomed")
        running_pid = None
        while running_pid is None:
            msg = client.next()
            assert msg.re == req
            running_pid = msg.body["data"].get("pid") if msg.kind is Kind.EVENT else None
        os.kill(running_pid, signal.SIGKILL)
        started = time.monotonic()
        msg = client.next()
        took = time.monotonic() - started
        assert msg.kind is Kind.ERROR and msg.re == req
        assert msg.body["code"] == "worker_died"
        assert "SIGKILL" in msg.body["message"] and str(running_pid) in msg.body["message"]
        assert took < 2.0  # prompt: reaped on SIGCHLD, not by polling
        assert client.run("steady", "env HERMES_SESSION_KEY").text == "steady"
        row = next(r for r in client.sessions() if r["key"] == "doomed")
        assert row["state"] == "exited" and "SIGKILL" in row["last_exit"]
        # Lazy restart on the next message.
        assert worker_pid(client, "doomed") != running_pid


def test_orphans_of_a_crashed_worker_are_killed(supervisor) -> None:
    with supervisor.client() as client:
        pid = worker_pid(client, "crashy")
        client.run("crashy", GRANDCHILDREN)
        procs = tree_of(pid, expect=3)
        os.kill(pid, signal.SIGKILL)
        assert all_gone(procs, timeout=5) == []
        assert client.ping().pid == supervisor.pid


def test_supervisor_sigkill_leaves_nothing_running(supervisor_factory, workdir) -> None:
    sup = supervisor_factory("--spare-workers", "2")  # spares, and sessions that were spares
    with sup.client() as client:
        pids = [worker_pid(client, f"s{i}") for i in range(4)]
        client.run("s0", GRANDCHILDREN)
        tree_of(pids[0], expect=3)
        busy = client.submit(Kind.SEND, {"text": "sleep 60"}, session="s1")
        assert client.next().re == busy
        deadline = time.monotonic() + 10
        while client.status()["spare_workers"] < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    ours = processes_mentioning(str(workdir))
    assert len(ours) >= 1 + 1 + 4 + 3 + 2  # supervisor, zygote, workers, sleeps, spares
    os.kill(sup.pid, signal.SIGKILL)
    sup.proc.wait()
    survivors = wait_gone(str(workdir), timeout=3.0)
    assert survivors == [], [(p.pid, p.name()) for p in survivors]


def test_a_second_supervisor_refuses_and_a_stale_socket_does_not_block(
    supervisor_factory, workdir
) -> None:
    first = supervisor_factory()
    second = supervisor_factory(start=False)
    second.start(wait=False)
    assert second.proc.wait(20) == 1
    assert "already running" in second.log() and str(first.pid) in second.log()
    # Killed hard, the first leaves its socket files behind; a new one starts anyway.
    os.kill(first.pid, signal.SIGKILL)
    first.proc.wait()
    assert (first.state_dir / "control.sock").exists()
    wait_gone(str(workdir), timeout=3.0)
    third = supervisor_factory()
    with third.client() as client:
        assert client.run("x", "pid").ok


def test_sigterm_lets_the_running_turn_finish_then_stops_everything(
    supervisor_factory, workdir
) -> None:
    sup = supervisor_factory()
    with sup.client(timeout=15) as client:
        client.run("idle-one", "pid")
        req = client.submit(Kind.SEND, {"text": "sleep 1"}, session="busy-one")
        assert client.next().re == req  # queued
        assert client.next().body["data"]["state"] == "running"
        queued = client.submit(Kind.SEND, {"text": "pid"}, session="busy-one")
        sup.proc.send_signal(signal.SIGTERM)
        answers = {}
        while len(answers) < 2:
            msg = client.next()
            if msg.kind is not Kind.EVENT:
                answers[msg.re] = msg
    assert answers[req].kind is Kind.REPLY and answers[req].body["text"] == "slept 1"
    assert answers[queued].kind is Kind.ERROR
    assert answers[queued].body["code"] == "shutting_down"
    assert sup.proc.wait(15) == 0
    assert wait_gone(str(workdir), timeout=3.0) == []


def test_messages_queued_during_start_run_in_order(supervisor) -> None:
    with supervisor.client() as client:
        reqs = [
            client.submit(Kind.SEND, {"text": f"sh echo {i}"}, session="ordered") for i in range(20)
        ]
        order = []
        while len(order) < 20:
            msg = client.next()
            if msg.kind is Kind.EVENT and msg.body["type"] == "output":
                order.append(int(msg.body["data"]))
                assert msg.re == reqs[int(msg.body["data"])]
        assert order == list(range(20))


def test_cancel_interrupts_the_running_turn(supervisor) -> None:
    with supervisor.client() as client:
        req = client.submit(Kind.SEND, {"text": "sleep 30"}, session="c")
        while True:
            msg = client.next()
            if msg.kind is Kind.EVENT and msg.body["data"].get("state") == "running":
                break
        started = time.monotonic()
        assert client.cancel("c") == req
        reply = client.answer(req)
        while reply.kind is Kind.EVENT:
            reply = client.answer(req)
        assert reply.body["text"] == "cancelled"
        assert time.monotonic() - started < 5


def test_cli_exit_codes_and_output(supervisor, workdir) -> None:
    base = [sys.executable, "-m", "hermes_sup.cli", "--state-dir", str(supervisor.state_dir)]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*base, *args], capture_output=True, text=True, timeout=30)

    ok = run("send", "cli", "sh echo hello; echo world")
    assert ok.returncode == 0 and ok.stdout == "hello\nworld\nexit 0\n"
    streamed = run("send", "cli", "stream once only")
    assert streamed.returncode == 0 and streamed.stdout == "once only\n"
    bad = run("send", "../etc", "hi")
    assert bad.returncode == 1 and "invalid session key" in bad.stderr
    assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    listed = run("list", "--json")
    assert listed.returncode == 0 and '"key": "cli"' in listed.stdout
    assert run("kill", "nobody").returncode == 1
    assert run("ping").returncode == 0
    missing = subprocess.run(
        [sys.executable, "-m", "hermes_sup.cli", "--state-dir", str(workdir / "nope"), "ping"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert missing.returncode == 3 and "hermes-sup --state-dir" in missing.stderr
    usage = run("send", "only-one-arg")
    assert usage.returncode == 2


def test_new_workers_survive_the_orphan_culls_of_dying_ones(supervisor) -> None:
    """Each worker exit triggers a sweep for orphans; a worker adopted by the
    supervisor but not yet registered must never be taken for one."""
    with supervisor.client(timeout=60) as client:
        for round_ in range(3):
            for i in range(20):
                client.run(f"old{round_}-{i}", "pid")
            kills = {
                client.submit(Kind.KILL, {"force": True}, session=f"old{round_}-{i}")
                for i in range(20)
            }
            sends = {
                client.submit(Kind.SEND, {"text": "pid"}, session=f"new{round_}-{i}")
                for i in range(20)
            }
            finals = {}
            while len(finals) < 40:
                msg = client.next()
                if msg.kind is not Kind.EVENT:
                    finals[msg.re] = msg
            assert all(finals[k].kind is Kind.KILLED for k in kills)
            died = [finals[s].body for s in sends if finals[s].kind is not Kind.REPLY]
            assert died == []


def test_workers_are_children_of_the_supervisor_forked_once(supervisor) -> None:
    """The zygote forks with CLONE_PARENT: the worker's parent is the
    supervisor from its first instruction, and no intermediate process lives.
    With the default spare workers on, so spares (and sessions that were
    spares) are held to it too."""
    with supervisor.client() as client:
        pids = [int(client.run(f"p{i}", "pid").text) for i in range(5)]
        status = client.status()
        spares = wait_for_spares(client)
    assert spares >= 1  # on by default
    zygote = psutil.Process(status["zygote_pid"])
    assert zygote.ppid() == supervisor.pid
    children = {p.pid for p in psutil.Process(supervisor.pid).children()}
    assert set(pids) <= children
    # The zygote, the workers and the spares, all the supervisor's own.
    assert len(children - set(pids) - {zygote.pid}) >= spares
    # Nothing else hangs off the zygote: no intermediate forks left behind.
    assert zygote.children() == []


def wait_for_spares(client, timeout: float = 20.0) -> int:
    """How many spare workers are ready once the pool is full (the default
    count for this machine), or after `timeout`: a spare being forked is
    briefly a copy of the zygote, titled as one."""
    from hermes_sup.supervisor.config import default_spare_workers

    wanted = default_spare_workers()
    deadline = time.monotonic() + timeout
    while (ready := client.status()["spare_workers"]) < wanted and time.monotonic() < deadline:
        time.sleep(0.02)
    return int(ready)
