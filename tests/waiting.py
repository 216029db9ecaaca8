"""One polling helper for the tests: wait on a condition with a deadline, never sleep-and-assert.

Test files used to carry their own copies of this loop; they differed only in the default
deadline, the poll interval and the message, which are parameters here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    check: Callable[[], T], timeout: float = 10.0, *, what: str | None = None, every: float = 0.02
) -> T:
    """Poll `check` until it returns something truthy and return that; fail past the deadline.

    The failure names `what` was awaited when given, so a slow run says which wait gave up.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError("timed out" if what is None else f"timed out waiting for {what}")
