"""Log lines that a peer can cause at will, at a rate the log can bear.

An unauthenticated TCP peer can fail handshakes, and a process of the
service user can open connections, as fast as it likes: one line each wrote
34,670 lines (7.4 MB) in 5 s from a single process. A `Throttle` keeps one
kind of line (one event name) to one verbatim line per interval, the first,
and sums up the rest in one line when the interval is over:

    remote_handshake_failed peer=tcp://127.0.0.1:5555 reason=...
    log_throttled kind=remote_handshake_failed suppressed=16802 seconds=10

Lines come from several threads (the event loop, the ZAP handler, the
client gate), so a throttle takes a lock. `flush_due` writes the summaries
of intervals that have ended, so the count of a flood that stopped is not
left unsaid; the client gate's thread calls it (gate.py), and `flush_all`
runs at shutdown.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from hermes_sup.local.logfmt import kv

INTERVAL = 10.0


class Throttle:
    """At most one verbatim line of one kind per interval, then a count."""

    def __init__(
        self,
        logger: logging.Logger,
        event: str,
        interval: float = INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.event = event
        self.interval = interval
        self.clock = clock
        self._lock = threading.Lock()
        self._window_end = -1.0  # the first line opens a window
        self._suppressed = 0
        self._level = logging.WARNING
        _ALL.append(self)

    def log(self, level: int, line: str) -> None:
        """Write `line`, unless one of this kind was written less than an
        interval ago: then count it for the summary."""
        if self.due(level):
            self.logger.log(level, line)

    def warning(self, line: str) -> None:
        self.log(logging.WARNING, line)

    def due(self, level: int = logging.WARNING) -> bool:
        """True if a line of this kind is to be written now (the caller
        writes it); else it is counted. For callers in a hurry: a line that
        is not written need not be formatted."""
        with self._lock:
            now = self.clock()
            if now < self._window_end:
                self._suppressed += 1
                self._level = level
                return False
            summary = self._take_summary()
            self._window_end = now + self.interval
        if summary:
            self.logger.log(level, summary)
        return True

    def flush(self, only_due: bool = False) -> None:
        """Write the summary of what was suppressed (if any); with
        `only_due`, only once its interval has ended."""
        with self._lock:
            if only_due and self.clock() < self._window_end:
                return
            summary, level = self._take_summary(), self._level
        if summary:
            self.logger.log(level, summary)

    def _take_summary(self) -> str:
        count, self._suppressed = self._suppressed, 0
        if not count:
            return ""
        return kv("log_throttled", kind=self.event, suppressed=count, seconds=f"{self.interval:g}")


_ALL: list[Throttle] = []


def flush_due() -> None:
    """Write the summaries of every throttle whose interval has ended."""
    for throttle in list(_ALL):
        throttle.flush(only_due=True)


def flush_all() -> None:
    """Write every pending summary now (at shutdown)."""
    for throttle in list(_ALL):
        throttle.flush()
