"""The one prctl(2) wrapper, and the clone(CLONE_PARENT) fork (Linux only).

The supervisor (a child subreaper), the zygote (parent-death signal, forking
workers to the supervisor) and workers all call prctl, in different processes;
it lives here so that none of them imports another's package for it. It
imports the standard library only: the zygote imports it before it forks.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
from typing import Any

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
# Looked up once (in the zygote, for every worker), not per call.
_prctl = ctypes.CDLL(None, use_errno=True).prctl


def prctl(option: int, value: int) -> None:
    """Call prctl(option, value), raising OSError on failure."""
    if _prctl(option, value, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}): {os.strerror(err)}")


CLONE_PARENT = 0x00008000
# clone(2) by machine; with every pointer argument 0 their order does not matter.
_SYS_CLONE = {"x86_64": 56, "aarch64": 220}.get(os.uname().machine)


def can_fork_to_parent() -> bool:
    """Whether fork_to_parent works on this machine."""
    return _SYS_CLONE is not None


@functools.cache
def _fork_calls() -> tuple[Any, Any, Any, Any]:
    api = ctypes.pythonapi
    libc = ctypes.PyDLL(None, use_errno=True)  # PyDLL: the GIL stays held
    return api.PyOS_BeforeFork, libc.syscall, api.PyOS_AfterFork_Child, api.PyOS_AfterFork_Parent


def fork_to_parent(namespaces: int = 0) -> int:
    """os.fork(), except that the child's parent is our own parent
    (clone with CLONE_PARENT): one fork where a double fork was needed.
    `namespaces`: CLONE_NEW* flags the child is born into (a sealed
    worker's own PID namespace, say)."""
    return fork_with(CLONE_PARENT | namespaces)


def fork_with(flags: int) -> int:
    """os.fork() through clone(2) with `flags` (CLONE_PARENT, CLONE_NEW*).

    The caller must have no other threads, as for any fork of Python. The
    interpreter's fork hooks run as in os.fork(), and the syscall is made
    with the GIL held (PyDLL), as os.fork() makes it."""
    assert _SYS_CLONE is not None
    before, syscall, after_child, after_parent = _fork_calls()
    before()
    pid = syscall(_SYS_CLONE, flags | signal.SIGCHLD, 0, 0, 0, 0)
    if pid == 0:
        after_child()
        return 0
    after_parent()
    if pid < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"clone({flags:#x}): {os.strerror(err)}")
    return int(pid)
