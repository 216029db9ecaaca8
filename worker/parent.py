"""Whether the supervisor that started this worker is still alive.

A worker is the supervisor's child (the zygote forks it with CLONE_PARENT),
so `os.getppid()` tells, until it is born into a PID namespace of its own
(sealed sessions): there the parent is outside the namespace, getppid says
0 and the supervisor's pid names nothing. Such a worker learns it from the
kernel's parent-death signal (`on_death_signal`). That signal is asked for
after the fork, and again after each change of credentials (which clears
it), so until the last time it is asked for, a pidfd of the supervisor
covers the gap: the zygote opens it while the supervisor is its parent,
every worker inherits it, and it turns readable the moment the supervisor
exits, whatever namespace the reader is in. The worker closes it
(`let_go`) before anything of its session runs: a session's shell could
otherwise take it from the worker and signal the supervisor with it.
"""

from __future__ import annotations

import os
import select

_pid: int | None = None
_pidfd: int | None = None
_gone = False  # the parent-death signal came


def watch(pid: int) -> bool:
    """In the zygote: follow supervisor `pid` (our parent) by a pidfd.
    False where the kernel has none (before Linux 5.3): getppid then."""
    global _pid, _pidfd
    _pid = pid
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        return False
    if os.getppid() != pid:  # gone before we looked: the fd names no parent
        os.close(fd)
        return False
    _pidfd = fd
    return True


def on_death_signal() -> None:
    """The parent-death signal came (called from its handler)."""
    global _gone
    _gone = True


def let_go() -> None:
    """The parent-death signal is asked for for good: close the pidfd."""
    global _pidfd
    if _pidfd is not None:
        os.close(_pidfd)
        _pidfd = None


def alive(pid: int) -> bool:
    """Whether supervisor `pid` still runs."""
    if _gone:
        return False
    if _pid == pid:
        if _pidfd is not None:
            poller = select.poll()
            poller.register(_pidfd, select.POLLIN)
            return not poller.poll(0)
        if os.getppid() == 0:  # our parent is outside our PID namespace
            return True  # and the parent-death signal has not come
    return os.getppid() == pid
