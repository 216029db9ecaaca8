"""Resource limits: the process tree usage they are enforced on."""

from __future__ import annotations

import subprocess


def test_process_tree_usage_read_from_proc_matches_psutil() -> None:
    """scan_trees reads /proc/<pid>/stat itself (psutil held the supervisor's
    GIL 3 times longer); it must still count what psutil counts."""
    import signal
    import time

    import psutil

    from hermes_sup.supervisor.limits import scan_trees

    shell = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30 & wait"])
    try:
        deadline = time.monotonic() + 5
        while len(psutil.Process(shell.pid).children()) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        tree = [psutil.Process(shell.pid), *psutil.Process(shell.pid).children(recursive=True)]
        usage = scan_trees([shell.pid], cpu=True)[shell.pid]
        assert usage.procs == 2
        expected = sum(p.memory_info().rss for p in tree)
        # Read at different moments from the kernel's approximate RSS
        # counters (stat here, statm in psutil): close, not equal.
        assert abs(usage.rss - expected) <= 2 * 1024 * 1024, (usage.rss, expected)
        assert usage.cpu >= 0.0
        assert scan_trees([2**22 + 7]) == {2**22 + 7: scan_trees([2**22 + 7])[2**22 + 7]}
        assert scan_trees([2**22 + 7])[2**22 + 7].procs == 0  # no such process: nothing
    finally:
        for p in psutil.Process(shell.pid).children(recursive=True):
            p.send_signal(signal.SIGKILL)
        shell.kill()
        shell.wait()


def test_the_scan_reads_the_trees_not_every_process_on_the_host(monkeypatch) -> None:  # noqa: ANN001
    """A sample costs the sessions' own processes: it never lists /proc,
    and it finds a child forked by a thread other than the main one (the
    kernel lists it among that thread's children)."""
    import os
    import signal
    import sys
    import time

    import psutil

    from hermes_sup.supervisor import limits

    # The child of a second thread, while the main thread sleeps on.
    code = (
        "import subprocess, threading, time\n"
        "threading.Thread(target=lambda: subprocess.Popen(['sleep', '30']).wait()).start()\n"
        "time.sleep(30)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 30
        while [c.name() for c in psutil.Process(parent.pid).children()] != ["sleep"]:
            assert time.monotonic() < deadline, "the thread's child did not start"
            time.sleep(0.01)
        listed: list[str] = []
        real_listdir = os.listdir

        def listdir(path: str) -> list[str]:
            listed.append(path)
            return real_listdir(path)

        monkeypatch.setattr(limits.os, "listdir", listdir)
        usage = limits.scan_trees([parent.pid])[parent.pid]
        assert usage.procs == 1
        assert "/proc" not in listed
        assert limits.tree_pids(parent.pid)[0] == parent.pid
    finally:
        for p in psutil.Process(parent.pid).children(recursive=True):
            p.send_signal(signal.SIGKILL)
        parent.kill()
        parent.wait()
