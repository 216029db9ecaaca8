"""Per-session resource accounting, computed on demand from /proc.

One pass over the process table per sample, not one per session: with
thousands of sessions a per-session psutil walk would cost seconds.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import psutil

# File descriptors the supervisor needs per live session: its ipc connection
# to the worker, the worker's pidfd, and headroom for libzmq's own use.
FDS_PER_SESSION = 3
# Descriptors kept back for clients, logs, the zygote and the interpreter.
FD_RESERVE = 256


@dataclass(frozen=True)
class TreeUsage:
    """What one worker and all its descendants use."""

    rss: int  # bytes
    procs: int  # descendants, not counting the worker


def scan_trees(roots: list[int]) -> dict[int, TreeUsage]:
    """RSS and descendant count of each root's process tree, in one pass."""
    children: dict[int, list[int]] = defaultdict(list)
    rss: dict[int, int] = {}
    for proc in psutil.process_iter(["ppid", "memory_info"]):
        info = proc.info
        if info["memory_info"] is None:
            continue  # vanished, or not ours to read
        children[info["ppid"]].append(proc.pid)
        rss[proc.pid] = info["memory_info"].rss
    usage = {}
    for root in roots:
        total, count = rss.get(root, 0), 0
        stack = list(children.get(root, ()))
        while stack:
            pid = stack.pop()
            total += rss.get(pid, 0)
            count += 1
            stack.extend(children.get(pid, ()))
        usage[root] = TreeUsage(rss=total, procs=count)
    return usage


def safe_max_sessions(fd_limit: int) -> int:
    """The most live sessions this supervisor can hold without running out of
    descriptors (libzmq aborts the whole process when it cannot get one)."""
    return max(1, (fd_limit - FD_RESERVE) // FDS_PER_SESSION)
