"""The memory limit counts what a session's processes use together (PSS,
a shared page once), not the sum of their RSS: 1,500 `sleep`s, nearly all
shared libc, tripped the limit when each one's RSS was added up."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil
import pytest

from hermes_sup.client import SupervisorError

MIB = 1024 * 1024
HOG = f'sh {sys.executable} -c "b = bytes(range(256)) * (1024 * 1024); import time; time.sleep(60)"'


def test_pss_is_read_only_over_the_threshold_and_counts_shared_pages_once() -> None:
    from hermes_sup.supervisor.limits import scan_trees

    shell = subprocess.Popen(["sh", "-c", "for i in $(seq 40); do sleep 30 & done; wait"])
    try:
        deadline = time.monotonic() + 10
        while len(psutil.Process(shell.pid).children()) < 40:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        cheap = scan_trees([shell.pid], pss_over={shell.pid: 1 << 40})[shell.pid]
        assert cheap.pss is None and cheap.memory == cheap.rss  # under: not read
        use = scan_trees([shell.pid], pss_over={shell.pid: 0})[shell.pid]
        assert use.procs == 40 and use.pss is not None and use.memory == use.pss
        # 41 copies of the same binaries and libc: their PSS is a small part.
        assert 0 < use.pss < use.rss / 3, (use.pss, use.rss)
    finally:
        for p in psutil.Process(shell.pid).children(recursive=True):
            p.send_signal(signal.SIGKILL)
        shell.kill()
        shell.wait()


@pytest.mark.e2e
def test_many_small_processes_sharing_pages_are_not_over_a_limit_their_rss_sum_is(
    supervisor_factory,
) -> None:
    limit = 150
    # The sampler's PSS is what is tested: without cgroups (with them the
    # kernel's memory.max stops the hog first: test_cgroups_e2e.py).
    sup = supervisor_factory("--memory-limit", str(limit), "--max-procs", "300", "--cgroups", "off")
    with sup.client() as client:
        pid = int(client.run("sleepy", "pid").text)
        reply = client.run(
            "sleepy", "sh for i in $(seq 200); do sleep 120 >/dev/null 2>&1 & done; echo spawned"
        )
        assert reply.text == "exit 0"
        row = next(r for r in client.sessions() if r["key"] == "sleepy")
        # The premise: their RSS, added up, is over the limit.
        assert row["procs"] >= 200 and row["rss"] > limit * MIB, row
        # A session that does use more than the limit is recycled: a sample
        # ran while the sleeps were there.
        with pytest.raises(SupervisorError) as err:
            client.run("hog", HOG)
        assert err.value.code == "worker_died" and "memory limit" in err.value.message
        row = next(r for r in client.sessions() if r["key"] == "sleepy")
        assert row["state"] == "idle" and row["pid"] == pid, row
        assert int(client.run("sleepy", "pid").text) == pid
        assert "PSS" in err.value.message
    assert "session=sleepy" not in "\n".join(
        line for line in sup.log().splitlines() if "memory limit" in line
    )
