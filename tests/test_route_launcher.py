"""cluster/launcher.py: what it starts dies with the process that started it
(how a node agent's supervisor goes when the agent is killed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil

from hermes_sup.cluster.launcher import PARENT_GONE

PARENT = textwrap.dedent(
    """
    import os, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-m", "hermes_sup.cluster.launcher",
                              str(os.getpid()), "--", "sleep", "120"])
    print(child.pid, flush=True)
    time.sleep(120)
    """
)


def test_the_child_is_killed_when_its_parent_is() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = psutil.Process(int(parent.stdout.readline()))
    try:
        deadline = time.monotonic() + 30
        while child.name() != "sleep":  # exec'd: the launcher became the command
            assert time.monotonic() < deadline
            time.sleep(0.02)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        assert child.wait(30) in (-signal.SIGKILL, None)
    finally:
        for proc in (parent,):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if child.is_running():
            child.kill()


def launch(*args: str) -> int:
    """The launcher's exit status, run in its own process (it sets a
    parent-death signal on the process it runs in)."""
    cmd = [sys.executable, "-m", "hermes_sup.cluster.launcher", *args]
    return subprocess.run(cmd, capture_output=True, timeout=30).returncode


def test_a_parent_already_gone_or_bad_usage_starts_nothing(tmp_path) -> None:
    made = tmp_path / "made"
    # A pid that is not its parent: as if the parent died before the prctl.
    assert launch(str(os.getpid() + 1_000_000), "--", "touch", str(made)) == PARENT_GONE
    assert not made.exists()
    assert launch("x", "--", "true") == 2
    assert launch(str(os.getpid())) == 2
    assert launch(str(os.getpid()), "--", "touch", str(made)) == 0
    assert made.exists()
