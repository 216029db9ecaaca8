"""Per-session resource accounting, computed on demand from /proc.

One pass over the process table per sample, not one per session: with
thousands of sessions a per-session psutil walk would cost seconds.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

# File descriptors the supervisor holds per live session: its ipc connection
# to the worker, the worker's pidfd and its output pipe (measured: 4,018 fds
# at 1,000 sessions), and headroom for libzmq's own use.
FDS_PER_SESSION = 5
# Descriptors kept back for clients, logs, the zygote and the interpreter.
FD_RESERVE = 256


@dataclass(frozen=True)
class TreeUsage:
    """What one worker and all its descendants use."""

    rss: int  # bytes
    procs: int  # descendants, not counting the worker
    cpu: float = 0.0  # user + system seconds of the whole tree


def scan_trees(roots: list[int], cpu: bool = False) -> dict[int, TreeUsage]:
    """RSS, descendant count and (if asked) CPU seconds of each root's
    process tree, in one pass over the process table."""
    children: dict[int, list[int]] = defaultdict(list)
    rss: dict[int, int] = {}
    cpu_s: dict[int, float] = {}
    for pid, ppid, pages, ticks in _process_table():
        children[ppid].append(pid)
        rss[pid] = pages * _PAGE
        if cpu:
            cpu_s[pid] = ticks / _TICKS
    usage = {}
    for root in roots:
        total, count, seconds = rss.get(root, 0), 0, cpu_s.get(root, 0.0)
        stack = list(children.get(root, ()))
        while stack:
            pid = stack.pop()
            total += rss.get(pid, 0)
            seconds += cpu_s.get(pid, 0.0)
            count += 1
            stack.extend(children.get(pid, ()))
        usage[root] = TreeUsage(rss=total, procs=count, cpu=seconds)
    return usage


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
    return max(1, (fd_limit - FD_RESERVE) // FDS_PER_SESSION)


def allowed_sessions(fd_limit: int, spare_workers: int, wanted: int | None) -> int:
    """How many sessions may run at once under `fd_limit` descriptors, with
    `spare_workers` spares holding theirs: `wanted` (the setting), lowered
    to what is safe; what is safe when nothing is wanted."""
    safe = max(1, safe_max_sessions(fd_limit) - spare_workers)
    return min(wanted or safe, safe)
