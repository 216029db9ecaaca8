"""Spare workers: forked ahead of need, connected, waiting for a session.

With `spare_workers` > 0 the supervisor keeps that many workers forked from
the zygote before any session asks for one. A spare has done what does not
depend on a session: it is in its own process group, dies with the
supervisor, and has its zmq context and a connected socket (the two costliest
steps of a start: the fork itself, and zmq). It holds nothing of any session
and runs no agent code. A new session takes a ready spare and sends it its
spawn request over that socket (`assign`); the spare then becomes the
session's worker exactly as a freshly forked one would: directories, cwd,
environment, rlimits, title, logging, runtime, hello.

This module is the bookkeeping; the supervisor does the I/O.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

from .process import WorkerProcess
from .states import backoff_delay


@dataclass
class Spare:
    """One spare worker, from the zygote request until it is assigned."""

    worker_id: bytes = field(default_factory=lambda: b"s" + secrets.token_bytes(15))
    token: bytes = field(default_factory=lambda: secrets.token_bytes(32))
    proc: WorkerProcess | None = None  # once the zygote has forked it
    out_fd: int | None = None  # the read end of its stdout/stderr pipe
    ready: bool = False  # it said `spare`: connected, and waiting
    forked_at: float = field(default_factory=time.monotonic)


class SparePool:
    """The spares by routing id and by pid, and the back-off after failures."""

    def __init__(self) -> None:
        self.by_id: dict[bytes, Spare] = {}
        self.by_pid: dict[int, Spare] = {}
        self.failures = 0  # spares in a row that died young
        self.retry_at = 0.0  # monotonic; no new spare before it

    def __len__(self) -> int:
        return len(self.by_id)

    def add(self, spare: Spare) -> None:
        self.by_id[spare.worker_id] = spare

    def forked(self, spare: Spare, proc: WorkerProcess, out_fd: int | None) -> None:
        spare.proc, spare.out_fd = proc, out_fd
        self.by_pid[proc.pid] = spare

    def take(self) -> Spare | None:
        """A ready spare, no longer in the pool; None if none is ready."""
        for spare in self.by_id.values():
            if spare.ready and spare.proc is not None:
                self.discard(spare)
                return spare
        return None

    def retire(self, spare: Spare) -> None:
        """Out of the pool, about to be killed: its exit is still ours to reap."""
        self.by_id.pop(spare.worker_id, None)

    def discard(self, spare: Spare) -> None:
        self.by_id.pop(spare.worker_id, None)
        if spare.proc is not None:
            self.by_pid.pop(spare.proc.pid, None)

    def ready_count(self) -> int:
        return sum(s.ready for s in self.by_id.values())

    def died(self, spare: Spare, young_within: float, base: float, cap: float) -> float:
        """Forget a spare that exited; the seconds to wait before the next
        one (spares that die at once must not become a fork loop)."""
        self.discard(spare)
        now = time.monotonic()
        if now - spare.forked_at < young_within:
            self.failures += 1
            delay = backoff_delay(self.failures, base, cap)
        else:
            self.failures, delay = 0, 0.0
        self.retry_at = now + delay
        return delay
