"""Deadlines by key in a heap: the supervisor's periodic work costs what is
due, not what is held.

A supervisor holding 10,000 conversations, most of them hibernated, must
not look at all of them four times a second. Each session that has a
worker has one deadline here, the next moment something about it could
need doing (judging its silence, hibernating it); a tick pops what is due.

Deadlines only ever need to move earlier when a session's state changes
(its turn starts and its silence limit shortens, settings are reloaded),
and the owner then sets them again. Everything else (a heartbeat, a new
turn's activity) moves the real deadline later, so a stale entry is
harmless: it pops early, the owner finds nothing to do and sets the new
deadline. Entries are replaced lazily: `set` pushes, and a popped entry
that is not the key's current deadline is skipped, as in the heapq
documentation's priority queue.
"""

from __future__ import annotations

import heapq
import itertools


class Deadlines:
    """One deadline per key (a monotonic time); `pop_due` takes those due."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str]] = []
        self._current: dict[str, tuple[float, int]] = {}
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._current)

    def __contains__(self, key: str) -> bool:
        return key in self._current

    def set(self, key: str, when: float) -> None:
        """The key's deadline is `when` (replacing any other)."""
        entry = (when, next(self._order))
        self._current[key] = entry
        heapq.heappush(self._heap, (*entry, key))
        # Replaced entries stay in the heap until popped: rebuild when they
        # outnumber the live ones, so the heap stays O(keys).
        if len(self._heap) > 64 and len(self._heap) > 4 * len(self._current):
            self._heap = [(w, n, k) for k, (w, n) in self._current.items()]
            heapq.heapify(self._heap)

    def discard(self, key: str) -> None:
        """The key has no deadline any more."""
        self._current.pop(key, None)

    def pop_due(self, now: float) -> list[str]:
        """Remove and return the keys whose deadline is at or before `now`,
        earliest first."""
        due = []
        heap, current = self._heap, self._current
        while heap and heap[0][0] <= now:
            when, order, key = heapq.heappop(heap)
            if current.get(key) == (when, order):
                del current[key]
                due.append(key)
        return due

    def next_at(self) -> float | None:
        """The earliest deadline, if any (stale entries may make it early)."""
        return self._heap[0][0] if self._heap else None
