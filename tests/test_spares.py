"""Spare workers (--spare-workers): forked ahead, then given a session.
Real supervisor, real processes."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from hermes_sup.protocol import session_dir_name
from hermes_sup.supervisor.config import MAX_DEFAULT_SPARES, Settings, default_spare_workers
from hermes_sup.supervisor.spare_workers import Spare, SparePool

from .waiting import wait_for

pytestmark = pytest.mark.e2e


def spare_pids(sup) -> set[int]:  # noqa: ANN001
    """The supervisor's children that are spares, by their process title."""
    found = set()
    for child in psutil.Process(sup.pid).children():
        try:
            if "(spare)" in " ".join(child.cmdline()):
                found.add(child.pid)
        except psutil.Error:
            pass
    return found


def test_a_new_session_gets_a_spare_which_becomes_only_its_own(supervisor_factory) -> None:
    env = {**os.environ, "SUPERVISOR_SECRET": "do-not-leak"}
    sup = supervisor_factory("--spare-workers", "2", env=env)
    with sup.client() as client:
        wait_for(lambda: client.status()["spare_workers"] == 2)
        spares = spare_pids(sup)
        assert len(spares) == 2
        reply = client.run("alice", "env HERMES_SESSION_KEY")
        assert reply.text == "alice"
        (row,) = client.sessions()
        assert row["pid"] in spares  # a spare, not a new fork
        # It became the session's worker exactly as a forked one would.
        assert client.run("alice", "env SUPERVISOR_SECRET").text == ""
        home = client.run("alice", "env HERMES_HOME").text
        cwd = client.run("alice", "cwd").text
        assert cwd == client.run("alice", "env TERMINAL_CWD").text and cwd != home
        assert client.run("alice", "write mark.txt alice's").ok
        own = sup.data_dir / "sessions" / session_dir_name("alice") / "workspace"
        assert (own / "mark.txt").read_text() == "alice's"
        assert "(spare)" not in " ".join(psutil.Process(row["pid"]).cmdline())
        # A second session gets the other spare, and its own everything.
        assert client.run("bob", "env HERMES_SESSION_KEY").text == "bob"
        assert (
            client.run("bob", "sh cat mark.txt 2>&1")
            .events[-1]
            .data.endswith("No such file or directory")
        )
        # The pool refills behind them, with new processes.
        wait_for(lambda: client.status()["spare_workers"] == 2)
        refilled = spare_pids(sup)
        assert len(refilled) == 2 and not refilled & spares
    # A spare warms up its logging before it has a session (worker/main.py
    # _warm_up): nothing of that reaches the log of the session it becomes.
    log = (sup.data_dir / "sessions" / session_dir_name("alice") / "worker.log").read_text()
    starts = [line for line in log.splitlines() if "worker start" in line]
    assert len(starts) == 1 and "session=alice " in starts[0], starts


def test_a_spare_that_dies_is_replaced_and_spares_die_with_the_supervisor(
    supervisor_factory,
) -> None:
    sup = supervisor_factory("--spare-workers", "1")
    with sup.client() as client:
        wait_for(lambda: client.status()["spare_workers"] == 1)
        (first,) = spare_pids(sup)
        os.kill(first, signal.SIGKILL)
        (second,) = wait_for(lambda: spare_pids(sup) - {first})
        wait_for(lambda: client.status()["spare_workers"] == 1)
        assert client.run("after", "env HERMES_SESSION_KEY").text == "after"
        assert client.sessions()[0]["pid"] == second
    assert "spare_exited" in sup.log() and "SIGKILL" in sup.log()
    spares = spare_pids(sup) | {second}
    assert sup.stop() == 0
    wait_for(lambda: not any(alive(p) for p in spares), 5)


def test_spares_die_at_once_with_a_supervisor_killed_with_its_zygote(supervisor_factory) -> None:
    """Nobody is left to stop them: a spare learns of its supervisor's death
    from the kernel (PR_SET_PDEATHSIG), which must wake its wait for a
    session; it used to sleep on for up to a minute."""
    sup = supervisor_factory("--spare-workers", "2")
    with sup.client() as client:
        wait_for(lambda: client.status()["spare_workers"] == 2)
    spares = spare_pids(sup)
    (zygote,) = [c.pid for c in psutil.Process(sup.pid).children() if c.pid not in spares]
    os.kill(zygote, signal.SIGKILL)
    os.kill(sup.pid, signal.SIGKILL)
    sup.proc.wait()
    # "At once": the bug kept them a minute; 20 s is room for a loaded machine.
    wait_for(lambda: not any(alive(p) for p in spares), 20, what="the spares to exit")


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_spares_that_die_young_back_off() -> None:
    pool = SparePool()
    delays = []
    for _ in range(4):
        spare = Spare()
        pool.add(spare)
        delays.append(pool.died(spare, young_within=2.0, base=0.5, cap=1.5))
    assert delays == [0.5, 1.0, 1.5, 1.5]
    assert len(pool) == 0 and pool.retry_at > time.monotonic()
    old = Spare(forked_at=time.monotonic() - 10)
    pool.add(old)
    assert pool.died(old, young_within=2.0, base=0.5, cap=1.5) == 0.0 and pool.failures == 0


def test_only_a_ready_spare_is_taken() -> None:
    pool = SparePool()
    waiting = Spare()
    pool.add(waiting)
    assert pool.take() is None  # not forked, not connected
    waiting.ready = True
    assert pool.take() is None  # said ready but no process known yet: cannot be
    ready = Spare(ready=True)
    pool.add(ready)
    pool.by_pid[0] = ready

    class Proc:
        pid = 0

    ready.proc = Proc()  # type: ignore[assignment]
    assert pool.take() is ready and 0 not in pool.by_pid and len(pool) == 1


def test_a_reload_resizes_the_pool_and_spares_take_the_new_settings(
    supervisor_factory, workdir
) -> None:
    path = workdir / "hermes-sup.toml"
    path.write_text('spare_workers = 2\nenv = { FLAVOUR = "old" }\n')
    sup = supervisor_factory("--config", str(path))
    with sup.client() as client:
        wait_for(lambda: client.status()["spare_workers"] == 2)
        before = spare_pids(sup)
        # Spares forked under the old settings serve new sessions with the new.
        path.write_text('spare_workers = 1\nenv = { FLAVOUR = "new" }\n')
        assert "spare_workers" in client.reload()["changed"]
        wait_for(lambda: len(spare_pids(sup)) == 1)
        (kept,) = spare_pids(sup)
        assert kept in before
        assert client.run("fresh", "env FLAVOUR").text == "new"
        assert client.sessions()[0]["pid"] == kept
        path.write_text('spare_workers = 0\nenv = { FLAVOUR = "new" }\n')
        client.reload()
        wait_for(lambda: not spare_pids(sup) and client.status()["spare_workers"] == 0)
        assert client.run("forked", "env FLAVOUR").text == "new"


def test_spares_are_on_by_default_one_per_cpu_and_zero_turns_them_off(
    supervisor_factory, workdir
) -> None:
    wanted = default_spare_workers()
    assert wanted >= 1
    sup = supervisor_factory()
    with sup.client() as client:
        wait_for(lambda: client.status()["spare_workers"] == wanted, timeout=30)
        assert len(spare_pids(sup)) == wanted
    # Off on the command line, and in a file; a reload back to the default.
    (workdir / "off").mkdir()
    (workdir / "filed").mkdir()
    off = supervisor_factory("--spare-workers", "0", root=workdir / "off")
    path = workdir / "hermes-sup.toml"
    path.write_text("spare_workers = 0\n")
    filed = supervisor_factory("--config", str(path), root=workdir / "filed")
    for quiet in (off, filed):
        with quiet.client() as client:
            client.run("a", "pid")  # a turn's end is when the pool refills
            assert client.status()["spare_workers"] == 0 and not spare_pids(quiet)
    path.write_text("")
    with filed.client() as client:
        assert "spare_workers" in client.reload()["changed"]
        wait_for(lambda: client.status()["spare_workers"] == wanted, timeout=30)


def test_the_default_spare_count_follows_the_cpus_this_process_may_use(monkeypatch) -> None:
    for cpus, spares in ((1, 1), (2, 2), (6, 6), (64, MAX_DEFAULT_SPARES)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, n=cpus: set(range(n)))
        assert default_spare_workers() == spares
        assert Settings(state_dir=Path("s"), data_dir=Path("d")).spare_workers == spares
