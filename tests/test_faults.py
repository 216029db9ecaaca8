"""Fault tolerance with real processes: hangs, limits, backoff, idle culling,
eviction, timeouts, shutdown, supervisor death, resends. Each test checks
what the client saw, what `list` shows, and that other sessions kept working."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from hermes_sup.client import SupervisorError
from hermes_sup.protocol import Kind, Message, session_dir_name

from .conftest import wait_gone

pytestmark = pytest.mark.e2e

RUNTIMES = str(Path(__file__).parent / "runtimes")


def until(predicate, timeout: float = 10.0, every: float = 0.05):
    """Poll `predicate` until it returns something truthy, with a deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(every)


def row(client, key: str) -> dict:
    return next(r for r in client.sessions() if r["key"] == key)


def wait_running(client, req: str) -> int:
    """Consume a turn's status events until it runs; return the worker pid.
    Messages for other requests are kept for later."""
    while True:
        msg = client.answer(req)
        assert msg.kind is Kind.EVENT, msg.body
        data = msg.body.get("data")
        if isinstance(data, dict) and data.get("state") == "running":
            return data["pid"]


def final(client, req: str, timeout: float = 20.0) -> Message:
    """The final answer (reply or error) of one request, keeping the rest."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            msg = client.answer(req, timeout=max(0.1, deadline - time.monotonic()))
        except SupervisorError as exc:
            return Message(Kind.ERROR, {"code": exc.code, "message": exc.message}, re=req)
        if msg.kind is not Kind.EVENT:
            return msg


def test_a_stopped_worker_is_hung_not_busy(supervisor_factory) -> None:
    sup = supervisor_factory("--heartbeat-timeout", "1.5")
    with sup.client() as client:
        # A long turn keeps heartbeating: busy, not hung.
        assert client.run("long", "sleep 2.5").text == "slept 2.5"
        req = client.submit(Kind.SEND, {"text": "sleep 60"}, session="frozen")
        pid = wait_running(client, req)
        os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        msg = final(client, req)
        assert msg.kind is Kind.ERROR and msg.body["code"] == "worker_died"
        assert "hung" in msg.body["message"] and "no heartbeat" in msg.body["message"]
        assert time.monotonic() - started < 8
        assert "hung" in row(client, "frozen")["last_exit"]
        assert client.run("long", "pid").ok
    assert "hung" in sup.log()


def test_memory_limit_recycles_the_session(supervisor_factory) -> None:
    sup = supervisor_factory("--memory-limit", "80")
    hog = (
        f'sh {sys.executable} -c "b = bytes(range(256)) * (1024 * 1024); '
        'import time; time.sleep(60)"'
    )
    with sup.client() as client:
        try:
            client.run("hog", hog)
        except SupervisorError as exc:
            # Recycled during the turn: by the sampler, or by the kernel
            # where the session's cgroup is killed whole (v2), or (v1) by the
            # supervisor on its group's OOM notice, which may come first.
            assert exc.code in ("worker_died", "session_killed")
            assert "memory limit" in exc.message and "80 MiB" in exc.message
        # (With a v1 cgroup the kernel kills the hog alone, and the
        # supervisor ends the session, the turn ended or not.)
        r = until(lambda: (x := row(client, "hog"))["state"] in ("exited", "backoff") and x)
        assert r and "memory limit" in r["last_exit"] and "80 MiB" in r["last_exit"]
        # It comes back on the next message.
        assert client.run("hog", "env HERMES_SESSION_KEY").text == "hog"


def test_process_limit_recycles_a_session_that_forks_too_much(supervisor_factory) -> None:
    # Unsealed and without cgroups: sessions share a uid, so the sampler's
    # count is the limit (sealed, or with a cgroup's pids.max, the kernel
    # refuses the fork: test_hostile_session.py, test_cgroups_e2e.py).
    sup = supervisor_factory(
        "--max-procs", "10", "--min-uptime", "0", "--sealed", "off", "--cgroups", "off"
    )
    with sup.client() as client:
        pid = int(client.run("forky", "pid").text)
        reply = client.run(
            "forky", "sh for i in $(seq 30); do sleep 100 >/dev/null 2>&1 & done; echo spawned"
        )
        assert reply.text == "exit 0"
        r = until(lambda: (x := row(client, "forky"))["state"] == "exited" and x, timeout=10)
        assert r and "process limit" in r["last_exit"] and "> 10" in r["last_exit"]
        assert until(
            lambda: (
                not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
            ),
            timeout=5,
        )
        assert client.run("calm", "pid").ok


def test_rlimits_are_applied_to_workers(supervisor_factory) -> None:
    sup = supervisor_factory("--max-open-files", "64", "--cpu-seconds", "1")
    with sup.client() as client:
        events = client.run("fds", "sh ulimit -n; ulimit -t").events
        assert [e.data for e in events if e.type == "output"] == ["64", "1"]
        # A command that burns CPU past the limit is killed by the kernel.
        reply = client.run("fds", "sh while :; do :; done")
        assert reply.data["exit"] in (-24, 152, 137)  # SIGXCPU (or its shell status)
        assert client.run("fds", "pid").ok


def test_a_hung_worker_leaves_a_traceback_in_its_log(supervisor_factory) -> None:
    env = dict(os.environ, PYTHONPATH=RUNTIMES)
    sup = supervisor_factory("--agent", "hs_gil_hog:make", "--heartbeat-timeout", "1", env=env)
    with sup.client() as client:
        assert client.run("stuck", "hello").text == "hello"
        with pytest.raises(SupervisorError) as err:
            client.run("stuck", "hang")
        assert err.value.code == "worker_died" and "hung" in err.value.message
        assert client.run("other", "fine").text == "fine"
    text = (sup.data_dir / "sessions" / session_dir_name("stuck") / "worker.log").read_text()
    assert "Fatal Python error: Aborted" in text
    assert "hs_gil_hog.py" in text and "run_turn" in text


def test_crash_at_import_backs_off_then_fails(supervisor_factory) -> None:
    env = dict(os.environ, PYTHONPATH=RUNTIMES)
    sup = supervisor_factory(
        "--agent",
        "hs_crash_at_import:make",
        "--backoff-base",
        "0.2",
        "--max-fast-failures",
        "3",
        "--failed-cooldown",
        "60",
        env=env,
    )
    with sup.client() as client, sup.client() as watcher:
        watch = watcher.submit(Kind.WATCH)
        assert watcher.next().re == watch
        started = time.monotonic()
        req = client.submit(Kind.SEND, {"text": "hello"}, session="crashy")
        delays = []
        while True:
            msg = client.next()
            if msg.kind is not Kind.EVENT:
                break
            if msg.body["data"].get("state") == "backoff":
                delays.append(msg.body["data"]["retry_in"])
                assert "status 3" in msg.body["data"]["reason"]
        took = time.monotonic() - started
        assert msg.kind is Kind.ERROR and msg.re == req
        assert msg.body["code"] == "session_failed"
        assert "3 fast failures" in msg.body["message"]
        assert delays == [0.2, 0.4]  # doubling back-off
        assert took >= 0.6
        r = row(client, "crashy")
        assert r["state"] == "failed" and r["exits"] == 3
        # Refused at once while failed; the supervisor keeps serving.
        with pytest.raises(SupervisorError) as err:
            client.run("crashy", "again")
        assert err.value.code == "session_failed"
        assert client.ping().pid == sup.pid
        # Every transition was published to the watcher.
        states = []
        while True:
            try:
                ev = watcher.next(timeout=0.5)
            except Exception:
                break
            if ev.body["type"] == "state":
                states.append(ev.body["data"]["state"])
        assert states == ["starting", "backoff", "starting", "backoff", "starting", "failed"]
        assert client.kill("crashy").reason == "cleared"
        assert row(client, "crashy")["state"] == "exited"


def test_idle_sessions_hibernate_but_busy_ones_do_not(supervisor_factory) -> None:
    sup = supervisor_factory("--idle-timeout", "1")
    with sup.client() as client:
        client.run("idle", "pid")
        # Busy until the test ends its turn, however long the wait below.
        req = client.submit(Kind.SEND, {"text": "sleep 600"}, session="busy")
        wait_running(client, req)
        assert until(lambda: row(client, "idle")["state"] == "hibernated", timeout=5)
        assert "idle for" in row(client, "idle")["last_exit"]
        assert row(client, "busy")["state"] == "busy"
        client.cancel("busy", req)
        assert final(client, req).body["text"] == "cancelled"
        # The busy-to-idle transition reset its clock: culled a second later, not at once.
        assert row(client, "busy")["state"] == "idle"
        assert until(lambda: row(client, "busy")["state"] == "hibernated", timeout=5)
        # Data stays; it comes back transparently.
        assert client.run("idle", "env HERMES_SESSION_KEY").text == "idle"


def test_lru_eviction_at_max_sessions_and_overloaded_when_all_busy(supervisor_factory) -> None:
    sup = supervisor_factory("--max-sessions", "2")
    with sup.client() as client:
        client.run("first", "write f.txt one")
        client.run("second", "pid")
        client.run("first", "pid")  # now "second" is the least recently used
        client.run("third", "pid")
        assert until(lambda: row(client, "second")["state"] == "exited", timeout=5)
        assert "evicted" in row(client, "second")["last_exit"]
        assert row(client, "first")["state"] == "idle"
        # The evicted session returns on its next message (evicting "first" now).
        assert client.run("second", "env HERMES_SESSION_KEY").text == "second"
        # All slots busy: a new session is refused, nothing is evicted.
        reqs = [
            client.submit(Kind.SEND, {"text": "sleep 2"}, session=k) for k in ("second", "third")
        ]
        for r in reqs:
            wait_running(client, r)
        with pytest.raises(SupervisorError) as err:
            client.run("fourth", "pid")
        assert err.value.code == "overloaded" and "2 session slots" in err.value.message
        for r in reqs:
            assert final(client, r).kind is Kind.REPLY
        # "first" lost its worker, not its data.
        assert client.run("first", "sh cat f.txt").events[-1].data == "one"


def test_max_sessions_is_capped_by_the_fd_limit(supervisor_factory) -> None:
    def low_fds() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (340, 340))

    from hermes_sup.supervisor.limits import safe_max_sessions

    # Spare workers hold a session's descriptors each: fewer sessions fit.
    spares = 2
    allowed = safe_max_sessions(340) - spares
    sup = supervisor_factory("--max-sessions", "1000", "--spare-workers", str(spares), start=False)
    sup.start(preexec_fn=low_fds)
    assert f"max_sessions_lowered wanted=1000 allowed={allowed}" in sup.log()
    with sup.client(timeout=30) as client:
        reqs = {
            client.submit(Kind.SEND, {"text": "sleep 3"}, session=f"s{i}"): i
            for i in range(allowed + 1)
        }
        results = {}
        while len(results) < allowed + 1:
            msg = client.next()
            if msg.kind is not Kind.EVENT:
                results[reqs[msg.re]] = msg
        refused = [m for m in results.values() if m.kind is Kind.ERROR]
        assert len(refused) == 1 and refused[0].body["code"] == "overloaded"
        assert client.ping().pid == sup.pid  # a refusal, never an abort


def test_turn_timeout_cancels_and_reports(supervisor_factory) -> None:
    sup = supervisor_factory("--turn-timeout", "0.5")
    with sup.client() as client:
        pid = int(client.run("t", "pid").text)
        started = time.monotonic()
        with pytest.raises(SupervisorError) as err:
            client.run("t", "sleep 30")
        assert err.value.code == "turn_timeout" and "0.5s" in err.value.message
        assert time.monotonic() - started < 3
        # The runtime honoured the cancel: same worker, still usable.
        assert int(client.run("t", "pid").text) == pid


def test_shutdown_gives_in_flight_turns_a_shutting_down_error(supervisor_factory, workdir) -> None:
    sup = supervisor_factory("--shutdown-grace", "0.5")
    with sup.client() as client:
        req = client.submit(Kind.SEND, {"text": "sleep 30"}, session="long")
        wait_running(client, req)
        sup.proc.send_signal(signal.SIGTERM)
        msg = final(client, req)
    assert msg.kind is Kind.ERROR and msg.body["code"] == "shutting_down"
    assert sup.proc.wait(15) == 0
    assert wait_gone(str(workdir), 3) == []


def test_a_second_sigint_forces_shutdown(supervisor_factory, workdir) -> None:
    sup = supervisor_factory("--shutdown-grace", "60")
    with sup.client() as client:
        req = client.submit(Kind.SEND, {"text": "sleep 60"}, session="long")
        wait_running(client, req)
        sup.proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        assert sup.proc.poll() is None  # still waiting for the turn (grace 60s)
        started = time.monotonic()
        sup.proc.send_signal(signal.SIGINT)
        assert sup.proc.wait(10) == 0
        assert time.monotonic() - started < 5
        msg = final(client, req)
    assert msg.kind is Kind.ERROR and msg.body["code"] == "shutting_down"
    assert wait_gone(str(workdir), 3) == []


def test_resending_a_send_never_runs_the_turn_twice(supervisor) -> None:
    body = {"text": "sh echo ran >> count.txt; sleep 0.3; wc -l < count.txt"}
    with supervisor.client() as client:
        req = client.submit(Kind.SEND, body, session="once")
        first_event = client.next()
        assert first_event.re == req
        # The client "timed out" and resends the same request (same id).
        client.submit(Kind.SEND, body, session="once", msg_id=req)
        answers = []
        while not answers or answers[-1].kind is Kind.EVENT:
            answers.append(client.next())
        assert any(
            a.body.get("data", {}) == {"state": "duplicate"}
            for a in answers
            if a.kind is Kind.EVENT and isinstance(a.body.get("data"), dict)
        )
        assert answers[-1].body["text"] == "exit 0"
        # A resend after the end gets the same final answer again, no new run.
        client.submit(Kind.SEND, body, session="once", msg_id=req)
        again = client.next()
        assert again.kind is Kind.REPLY and again.body == answers[-1].body
        events = client.run("once", "sh wc -l < count.txt").events
        assert events[-1].data.strip() == "1"


def test_supervisor_sigkill_with_a_stopped_worker(supervisor_factory, workdir) -> None:
    sup = supervisor_factory()
    with sup.client() as client:
        pid = int(client.run("stopped", "pid").text)
        client.run("stopped", "sh sleep 1000 >/dev/null 2>&1 & echo ok")
        client.run("running", "pid")
    os.kill(pid, signal.SIGSTOP)
    os.kill(sup.pid, signal.SIGKILL)
    sup.proc.wait()
    # The zygote sees the supervisor go and kills the stopped worker's tree.
    survivors = wait_gone(str(workdir), timeout=3.0)
    assert survivors == [], [(p.pid, p.name(), p.status()) for p in survivors]


def test_a_restarted_supervisor_stops_leftover_workers_by_pid_and_create_time(
    supervisor_factory, workdir
) -> None:
    sup = supervisor_factory()
    with sup.client() as client:
        pid = int(client.run("left", "pid").text)
        zygote = next(p for p in psutil.Process(sup.pid).children() if p.pid != pid)
    # Kill the supervisor and its zygote together while the worker is stopped:
    # nothing is left to clean up after it, so it survives.
    os.kill(pid, signal.SIGSTOP)
    os.kill(zygote.pid, signal.SIGKILL)
    os.kill(sup.pid, signal.SIGKILL)
    sup.proc.wait()
    time.sleep(0.5)
    assert psutil.Process(pid).status() == psutil.STATUS_STOPPED
    # And a record whose pid is now someone else's: must never be touched.
    bystander = subprocess.Popen(["sleep", "30"])
    try:
        records = sup.state_dir / "workers"
        (records / str(bystander.pid)).write_text(json.dumps({"key": "ghost", "create_time": 1.0}))
        second = supervisor_factory(root=workdir)
        log = second.log()
        assert f"stopped leftover worker of session 'left' pid {pid}" in log
        assert f"'ghost' pid {bystander.pid}: process gone or pid reused; ignored" in log
        assert until(
            lambda: (
                not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
            ),
            timeout=3,
        )
        assert bystander.poll() is None
        with second.client() as client:
            assert client.run("left", "env HERMES_SESSION_KEY").text == "left"
    finally:
        bystander.kill()
        bystander.wait()


def wait_for_spares(client, count: int) -> None:  # noqa: ANN001
    """Until `count` spare workers are ready (so the next new session gets one)."""
    deadline = time.monotonic() + 10
    while client.status()["spare_workers"] < count:
        assert time.monotonic() < deadline, "spare workers did not get ready"
        time.sleep(0.02)


# Spares are on by default: the forked case turns them off.
FORKED_OR_SPARE = pytest.mark.parametrize(
    "spares", [["--spare-workers", "0"], ["--spare-workers", "2"]], ids=["forked", "spare"]
)


@FORKED_OR_SPARE
def test_a_first_turn_handed_to_a_starting_worker_can_be_cancelled(
    supervisor_factory, spares
) -> None:
    """Once a runtime has started, a new session's first turn rides in the
    spawn request. A cancel that arrives before that worker's hello is held
    and sent after it: the running turn sees it (its reply says so), rather
    than the cancel being lost on a worker not yet connected."""
    env = dict(os.environ, PYTHONPATH=RUNTIMES)
    sup = supervisor_factory("--agent", "hs_picky:make", *spares, env=env)
    with sup.client() as client:
        assert client.run("warm", "hi").text == "hi"
        wait_for_spares(client, int(spares[-1]))
        req = client.submit(Kind.SEND, {"text": "sleep 30"}, session="slow-1")
        started = time.monotonic()
        assert client.cancel("slow-1") == req  # its worker is still in make()
        final = client.answer(req)
        while final.kind is Kind.EVENT:
            final = client.answer(req)
        assert final.kind is Kind.REPLY and final.body["text"] == "cancelled"
        assert time.monotonic() - started < 10
        assert client.run("slow-1", "again").text == "again"


@FORKED_OR_SPARE
def test_a_handed_first_turn_whose_worker_cannot_start_is_not_lost(
    supervisor_factory, spares
) -> None:
    """A worker that fails to load its runtime never ran the turn it was
    handed: the turn goes back to the queue and ends as the session's
    failure, not as a turn the worker died in."""
    env = dict(os.environ, PYTHONPATH=RUNTIMES)
    sup = supervisor_factory(
        "--agent", "hs_picky:make", "--failed-cooldown", "60", *spares, env=env
    )
    with sup.client() as client:
        assert client.run("warm", "hi").text == "hi"
        wait_for_spares(client, int(spares[-1]))
        with pytest.raises(SupervisorError) as err:
            client.run("bad-1", "hi")
        assert err.value.code == "session_failed"
        assert "could not load its agent runtime" in err.value.message
        assert client.run("warm", "still here").text == "still here"


def test_a_handed_first_turn_cancelled_before_a_failed_start_stays_cancelled(
    supervisor_factory,
) -> None:
    """Cancelled while its worker was starting, and that worker then failed
    to load: the turn ends as cancelled; it does not go back to the queue."""
    env = dict(os.environ, PYTHONPATH=RUNTIMES)
    sup = supervisor_factory("--agent", "hs_picky:make", "--failed-cooldown", "60", env=env)
    with sup.client() as client:
        assert client.run("warm", "hi").text == "hi"
        req = client.submit(Kind.SEND, {"text": "sleep 30"}, session="slow-bad-1")
        assert client.cancel("slow-bad-1") == req
        with pytest.raises(SupervisorError) as err:
            final = client.answer(req)
            while final.kind is Kind.EVENT:
                final = client.answer(req)
        assert err.value.code == "turn_failed"
        assert "cancelled before it started" in err.value.message


def test_a_worker_killed_in_its_first_turn_runs_it_once(supervisor, workdir) -> None:
    """At most once, with the first turn in the spawn request too: a worker
    that dies during it fails the turn, and no new worker runs it again."""
    runs = supervisor.data_dir / "sessions" / session_dir_name("dies") / "workspace" / "runs"
    with supervisor.client() as client:
        assert client.run("warm", "hi").text == "hi"
        req = client.submit(Kind.SEND, {"text": "sh echo ran >> runs; sleep 30"}, session="dies")
        assert until(runs.exists)
        (row_,) = [r for r in client.sessions() if r["key"] == "dies"]
        os.kill(row_["pid"], signal.SIGKILL)
        with pytest.raises(SupervisorError) as err:
            while client.answer(req, timeout=20).kind is Kind.EVENT:
                pass
        assert err.value.code == "worker_died"
        assert client.run("dies", "echo back").text == "echo back"
        time.sleep(0.5)
        assert runs.read_text() == "ran\n"


def test_an_idle_worker_beats_slowly_and_is_hung_only_after_missing_three(
    supervisor_factory,
) -> None:
    """Idle workers heartbeat every idle interval, not every busy one, so
    thousands of them cost little; a silent idle worker is hung after three
    missed idle beats, not after the (busy) heartbeat timeout."""
    sup = supervisor_factory("--heartbeat-timeout", "1", "--idle-heartbeat-interval", "1.5")
    with sup.client() as client:
        pid = int(client.run("idle", "pid").text)
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            time.sleep(2.5)  # well past the busy timeout, within 3 idle beats
            assert " hung session=idle" not in sup.log()
            deadline = stopped + 15
            while row(client, "idle")["state"] == "idle":
                assert time.monotonic() < deadline, (
                    "an idle worker that went silent was never found hung"
                )
                time.sleep(0.1)
            found = time.monotonic() - stopped
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)  # if it is still there, let it die
        # Declared hung after 3 idle beats (4.5 s), then killed after its abort grace.
        assert " hung session=idle" in sup.log() and 4.4 < found < 12, found
        assert "hung" in (row(client, "idle")["last_exit"] or "")
        assert client.run("idle", "pid").ok  # and it comes back
