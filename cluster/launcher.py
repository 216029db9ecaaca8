"""Run a command that dies with the process that started it.

`python -m hermes_sup.cluster.launcher PARENT_PID -- COMMAND...` sets the
kernel's parent-death signal (SIGKILL) and then execs COMMAND, which keeps
it: when the node agent that started the supervisor dies, however it dies,
the supervisor is killed too, and its own cleanup (its zygote and workers
die with it) leaves nothing of ours on the node. A launcher is used rather
than Popen's preexec_fn because the agent runs in a Ray worker, which has
threads. Standard library only.
"""

from __future__ import annotations

import os
import signal
import sys

from hermes_sup.local.prctl import PR_SET_PDEATHSIG, prctl

# The status when the parent was gone before the signal was set.
PARENT_GONE = 75


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
        print(
            "usage: python -m hermes_sup.cluster.launcher PARENT_PID -- COMMAND...", file=sys.stderr
        )
        return 2
    parent, command = int(argv[0]), argv[2:]
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    # The parent may have died between our fork and the prctl: then nobody
    # would ever send the signal.
    if os.getppid() != parent:
        return PARENT_GONE
    os.execvp(command[0], command)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
