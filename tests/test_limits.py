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
