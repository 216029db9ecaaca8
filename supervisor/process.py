"""Handles on worker processes, and killing a process tree without orphans.

Workers are the supervisor's own children (the zygote forks them with
CLONE_PARENT; with a double fork they re-parent to it, a child subreaper),
so it reaps them itself with waitpid and learns their exit status the
moment they die. The handle below is Popen-like so the supervisor
logic can be tested with a fake; the real one signals through a pidfd, which
can never hit a recycled pid.
"""

from __future__ import annotations

import os
import signal
from typing import Protocol

import psutil

from hermes_sup.local.prctl import PR_SET_CHILD_SUBREAPER, prctl

from .limits import tree_pids


def become_subreaper() -> None:
    """Make orphaned descendants re-parent to this process instead of init."""
    prctl(PR_SET_CHILD_SUBREAPER, 1)


class ProcessHandle(Protocol):
    """What the supervisor needs of a worker process."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def send_signal(self, sig: int) -> None: ...
    def signal_group(self, sig: int) -> None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...
    def descendants(self) -> list[psutil.Process]: ...


def exit_status(status: int) -> tuple[int | None, str | None]:
    """Split a waitpid status into (exit code, signal name)."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            return None, signal.Signals(sig).name
        except ValueError:
            return None, f"signal {sig}"
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status), None
    return None, None


class WorkerProcess:
    """A worker that is our child (via the subreaper). Its exit is recorded by
    the supervisor's reaper through `set_exited`; this class never waits."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.exit_code: int | None = None
        self.exit_signal: str | None = None
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except (ProcessLookupError, OSError):
            self._pidfd = None  # already gone (and reaped): nothing to signal
        try:
            self.create_time: float | None = psutil.Process(pid).create_time()
        except psutil.Error:
            self.create_time = None

    def set_exited(self, status: int) -> None:
        """Record the waitpid status; called once by the reaper."""
        self.exit_code, self.exit_signal = exit_status(status)
        self.returncode = self.exit_code if self.exit_code is not None else -1
        self.close()

    def poll(self) -> int | None:
        """The exit status if the reaper has seen the exit, else None."""
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Signal the worker itself; a no-op once it has exited."""
        if self.returncode is not None or self._pidfd is None:
            return
        try:
            signal.pidfd_send_signal(self._pidfd, sig)
        except ProcessLookupError:
            pass

    def signal_group(self, sig: int) -> None:
        """Signal the worker's process group (it called setsid, so pgid == pid)."""
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def terminate(self) -> None:
        """SIGTERM the worker."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the worker."""
        self.send_signal(signal.SIGKILL)

    def descendants(self) -> list[psutil.Process]:
        """Every live descendant, found through parent links (so a grandchild
        that called setsid is still found). Empty once the worker is gone.
        Walked down the kernel's children lists (limits.tree_pids): the
        cost of the tree, where psutil's children() reads every process on
        the host, which made stopping N workers cost N x the host."""
        if self.returncode is not None:
            return []
        try:
            proc = psutil.Process(self.pid)
            if self.create_time is not None and proc.create_time() != self.create_time:
                return []
        except psutil.Error:
            return []
        found = []
        for pid in tree_pids(self.pid)[1:]:
            try:
                found.append(psutil.Process(pid))  # its create time, for kill_processes
            except psutil.Error:
                continue  # gone meanwhile
        return found

    def close(self) -> None:
        """Release the pidfd."""
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


def kill_processes(procs: list[psutil.Process], sig: int = signal.SIGKILL) -> int:
    """Signal each process that is still the same process (psutil checks its
    create time, so a recycled pid is never hit). Returns how many were signalled."""
    hit = 0
    for proc in procs:
        try:
            proc.send_signal(sig)
            hit += 1
        except psutil.Error:
            pass
    return hit
