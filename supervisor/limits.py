"""Per-session resource accounting, computed on demand from /proc.

One pass over the process table per sample, not one per session: with
thousands of sessions a per-session psutil walk would cost seconds.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import psutil

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
    attrs = ["ppid", "memory_info", "cpu_times"] if cpu else ["ppid", "memory_info"]
    children: dict[int, list[int]] = defaultdict(list)
    rss: dict[int, int] = {}
    cpu_s: dict[int, float] = {}
    for proc in psutil.process_iter(attrs):
        info = proc.info
        if info["memory_info"] is None:
            continue  # vanished, or not ours to read
        children[info["ppid"]].append(proc.pid)
        rss[proc.pid] = info["memory_info"].rss
        if cpu and info["cpu_times"] is not None:
            cpu_s[proc.pid] = info["cpu_times"].user + info["cpu_times"].system
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


def safe_max_sessions(fd_limit: int) -> int:
    """The most live sessions this supervisor can hold without running out of
    descriptors (libzmq aborts the whole process when it cannot get one)."""
    return max(1, (fd_limit - FD_RESERVE) // FDS_PER_SESSION)
