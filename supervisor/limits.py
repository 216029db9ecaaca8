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
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

# File descriptors the supervisor holds per live session: its ipc connection
# to the worker, the worker's pidfd, its output pipe and its lease file
# (leases.py) (measured: 4,018 fds at 1,000 sessions before the lease), on
# a data directory that is not shared its epoch file and turn journal, kept
# open so that a turn opens neither (leases.py, journal.py), a sealed
# session's proxy listener (proxy.py; its connections have a budget of
# their own there), and headroom for libzmq's own use.
FDS_PER_SESSION = 9
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
    process tree, in one pass over the process table; and the tree's PSS
    for each root in `pss_over` whose RSS sum is over the bytes it maps to."""
    children: dict[int, list[int]] = defaultdict(list)
    rss: dict[int, int] = {}
    cpu_s: dict[int, float] = {}
    for pid, ppid, pages, ticks in _process_table():
        children[ppid].append(pid)
        rss[pid] = pages * _PAGE
        if cpu:
            cpu_s[pid] = ticks / _TICKS
    thresholds = pss_over or {}
    usage = {}
    for root in roots:
        total, count, seconds = rss.get(root, 0), 0, cpu_s.get(root, 0.0)
        tree = [root]
        stack = list(children.get(root, ()))
        while stack:
            pid = stack.pop()
            total += rss.get(pid, 0)
            seconds += cpu_s.get(pid, 0.0)
            count += 1
            tree.append(pid)
            stack.extend(children.get(pid, ()))
        pss = None
        if root in thresholds and total > thresholds[root]:
            pss = sum(_pss(pid, rss.get(pid, 0)) for pid in tree)
        usage[root] = TreeUsage(rss=total, procs=count, cpu=seconds, pss=pss)
    return usage


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


def _process_table() -> Iterator[tuple[int, int, int, int]]:
    """(pid, ppid, resident pages, user + system ticks) of every process,
    from one read of /proc/<pid>/stat each. It runs in a thread of the
    supervisor and holds the GIL while it parses: psutil took 60 - 100 ms
    for 1,000 workers, time the event loop waited for the GIL."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue  # gone meanwhile
        # The command name is in parentheses and may hold spaces or ')'.
        fields = data[data.rindex(b")") + 2 :].split()
        if fields[0] == b"Z":
            continue  # a zombie holds no memory and is no longer running
        # After the name: state ppid ... utime(12) stime(13) ... rss(22).
        yield int(name), int(fields[1]), int(fields[21]), int(fields[11]) + int(fields[12])


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
