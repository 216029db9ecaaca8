"""One polling helper for the tests: wait on a condition with a deadline, never sleep-and-assert.

Test files used to carry their own copies of this loop; they differed only in the default
deadline, the poll interval and the message, which are parameters here.

A deadline is for an idle machine: on a loaded one (CI, or tests running beside others) it is
stretched by `load_factor`, so that a slow run waits longer instead of failing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def load_factor() -> float:
    """How many times slower than on an idle machine things may run now: the one-minute load
    per CPU this process may use, and never less than 1."""
    try:
        return max(1.0, os.getloadavg()[0] / len(os.sched_getaffinity(0)))
    except OSError:
        return 1.0


def wait_for(
    check: Callable[[], T], timeout: float = 10.0, *, what: str | None = None, every: float = 0.02
) -> T:
    """Poll `check` until it returns something truthy and return that; fail past the deadline.

    The failure names `what` was awaited when given, so a slow run says which wait gave up.
    `timeout` is stretched by the load (`load_factor`).
    """
    deadline = time.monotonic() + timeout * load_factor()
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError("timed out" if what is None else f"timed out waiting for {what}")
