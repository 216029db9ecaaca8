"""Per-session resource accounting, computed on demand from /proc.

One pass over the process table per sample, not one per session: with
thousands of sessions a per-session psutil walk would cost seconds.

Memory is counted as the kernel shares it out: the PSS (proportional set
size) of every process in a worker's tree, summed, so a page the tree's
processes share counts once, not once per process (1,500 `sleep`s, each
with about 1.7 MiB of RSS that is nearly all shared libc and about 0.2 MiB
of PSS, tripped the limit when RSS was summed). PSS is dear to read: /proc/<pid>/smaps_rollup walks
the process's page tables. Measured on the 2-core test machine, in CPU time
of the reader: 100 `sleep`s 10 ms (their /proc/<pid>/stat: 3 ms), 100 idle
Python processes with zmq loaded 125 - 130 ms, so about 1.3 s for 1,000
workers, every sample. So a sample reads stat (RSS) for everyone, and
smaps_rollup only for the trees whose RSS sum is over their limit: the RSS
sum is an upper bound of the PSS sum, so a tree under its limit by RSS is
under it by PSS too.

Only the sessions' own processes are read: each worker's tree is walked
down from the worker through /proc/<pid>/task/<tid>/children (the kernel's
list of each thread's children), so a sample costs the processes of the
sessions sampled, not every process on the host (a host with 10,000
processes of its own and one session read 10,000 stat files a sample).
A process that left its tree by a double fork was reparented to the
supervisor (the subreaper) and is not counted, as with parent links.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

# File descriptors the supervisor holds per live session: its ipc connection
# to the worker, the worker's pidfd, its output pipe and its lease file
# (leases.py) (measured: 4,018 fds at 1,000 sessions before the lease), on
# a data directory that is not shared its epoch file and turn journal, kept
# open so that a turn opens neither (leases.py, journal.py), on cgroup v1
# its group's OOM notice (an eventfd: cgroups.py), a sealed session's proxy
# listener (proxy.py; its connections have a budget of their own there),
# and headroom for libzmq's own use.
FDS_PER_SESSION = 10
# Descriptors kept back for clients, logs, the zygote and the interpreter.
FD_RESERVE = 256
# The share of the descriptor limit the sealed sessions' egress proxy may
# hold for their connections (two a tunnel: proxy.py caps them at half of
# it), kept out of what live sessions may take.
PROXY_FD_SHARE = 8


@dataclass(frozen=True)
class TreeUsage:
    """What one worker and all its descendants use."""

    rss: int  # bytes
    procs: int  # descendants, not counting the worker
    cpu: float = 0.0  # user + system seconds of the whole tree
    pss: int | None = None  # bytes; read only when the RSS sum was over a threshold

    @property
    def memory(self) -> int:
        """What counts against a memory limit: the PSS sum when it was read,
        else the RSS sum (never less than the PSS sum)."""
        return self.pss if self.pss is not None else self.rss


def scan_trees(
    roots: list[int], cpu: bool = False, pss_over: Mapping[int, int] | None = None
) -> dict[int, TreeUsage]:
    """RSS, descendant count and (if asked) CPU seconds of each root's
    process tree, reading only the trees' own processes; and the tree's PSS
    for each root in `pss_over` whose RSS sum is over the bytes it maps to."""
    thresholds = pss_over or {}
    usage = {}
    for root in roots:
        total, count, seconds = 0, -1, 0.0
        tree = []
        for pid in tree_pids(root):
            stat = _stat(pid)
            if stat is None:
                continue  # gone meanwhile, or a zombie
            pages, ticks = stat
            total += pages * _PAGE
            seconds += ticks / _TICKS if cpu else 0.0
            count += 1
            tree.append((pid, pages * _PAGE))
        pss = None
        if root in thresholds and total > thresholds[root]:
            pss = sum(_pss(pid, rss) for pid, rss in tree)
        usage[root] = TreeUsage(rss=total, procs=max(count, 0), cpu=seconds, pss=pss)
    return usage


def tree_pids(root: int) -> list[int]:
    """`root` and every live descendant of it (by the kernel's children
    lists, each thread's: a child forked by a thread is that thread's),
    parents before their children; empty if `root` is gone."""
    found: list[int] = []
    stack = [root]
    seen = set()
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue  # a pid reused while we walked: counted once
        try:
            threads = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue  # gone meanwhile
        seen.add(pid)
        found.append(pid)
        stack.extend(_children(pid, threads))
    return found


def children_of(pid: int) -> list[int]:
    """The live children of `pid` (of any of its threads); [] if it is gone."""
    try:
        return _children(pid, os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return []


def _children(pid: int, threads: list[str]) -> list[int]:
    found: list[int] = []
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                found.extend(int(child) for child in f.read().split())
        except OSError:
            continue  # a thread that just ended
    return found


def _stat(pid: int) -> tuple[int, int] | None:
    """(resident pages, user + system ticks) of a process, from one read of
    /proc/<pid>/stat; None if it is gone or a zombie (which holds no
    memory and is no longer running). Parsed here, not by psutil: psutil
    took 60 - 100 ms for 1,000 workers, time the event loop waited for the
    GIL (this runs in a thread of the supervisor)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # The command name is in parentheses and may hold spaces or ')'.
    fields = data[data.rindex(b")") + 2 :].split()
    if fields[0] == b"Z":
        return None
    # After the name: state ppid ... utime(12) stime(13) ... rss(22).
    return int(fields[21]), int(fields[11]) + int(fields[12])


def _pss(pid: int, rss: int) -> int:
    """A process's proportional set size in bytes: 0 if it is gone, its RSS
    if its memory map cannot be read (another user's setuid program)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return 0
    except OSError:
        return rss
    start = data.find(b"\nPss:")
    if start < 0:
        return 0  # a zombie, or a kernel thread: nothing mapped
    return int(data[start + 5 : data.index(b"kB", start)]) * 1024


_PAGE = os.sysconf("SC_PAGE_SIZE")
_TICKS = os.sysconf("SC_CLK_TCK")


def safe_max_sessions(fd_limit: int) -> int:
    """The most live sessions this supervisor can hold without running out of
    descriptors (libzmq aborts the whole process when it cannot get one)."""
    return max(1, (fd_limit - FD_RESERVE - fd_limit // PROXY_FD_SHARE) // FDS_PER_SESSION)


def allowed_sessions(fd_limit: int, spare_workers: int, wanted: int | None) -> int:
    """How many sessions may run at once under `fd_limit` descriptors, with
    `spare_workers` spares holding theirs: `wanted` (the setting), lowered
    to what is safe; what is safe when nothing is wanted."""
    safe = max(1, safe_max_sessions(fd_limit) - spare_workers)
    return min(wanted or safe, safe)
