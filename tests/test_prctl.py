"""The prctl/clone wrapper: fork_to_parent makes a child of the caller's parent."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def test_fork_to_parent_makes_a_child_of_the_callers_parent(tmp_path) -> None:
    from hermes_sup.local.prctl import can_fork_to_parent

    if not can_fork_to_parent():
        pytest.skip("no clone(CLONE_PARENT) syscall number for this machine")
    code = (
        "import os, sys\n"
        "from hermes_sup.local.prctl import fork_to_parent\n"
        "pid = fork_to_parent()\n"
        "if pid == 0:\n"
        "    os.write(1, b'%d\\n' % os.getppid()); os._exit(7)\n"
        "os.write(1, b'%d\\n' % pid)\n"  # one write each: stdout may be unbuffered
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    numbers = {int(x) for x in out.stdout.split()}
    assert os.getpid() in numbers  # the grandchild saw us as its parent
    grandchild = (numbers - {os.getpid()}).pop()
    # Only a parent can reap: the grandchild is our child, with its own status.
    _, status = os.waitpid(grandchild, 0)
    assert os.waitstatus_to_exitcode(status) == 7
