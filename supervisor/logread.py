"""Reading stored session logs: the stamp every stored line begins with,
and choosing lines by count and time for `logs` requests (supervisor/front.py)
and for reading the files directly (cli/logfiles.py).

Writing the logs (stamping, rotation, the rate limit, a full disk) is
supervisor/logs.py. The stamp's format lives here, not there, because both
sides need it and the writer already depends on the reader's view of a
line; this module imports nothing of the writer's.

Every stored line begins with a timestamp and one space:

    2026-12-01T10:38:21.123456Z what the worker printed

RFC 3339 in UTC to the microsecond, always 27 characters wide. Such stamps
sort as text in time order, so `since` and `until` are byte comparisons,
with no date parsed per line. A line without a stamp (a log written before
stamps were) is shown as it is; its time is unknown, and it counts as older
than every stamped line: `since` leaves it out, `until` keeps it.
"""

from __future__ import annotations

import calendar
import math
import re
import time
from collections import deque
from pathlib import Path
from typing import Any

from hermes_sup.protocol import ErrorCode, RemoteProtocolError

# ------------------------------------------------------------- stamps

# "2026-12-01T10:38:21.123456Z": the width of every stamp, and of the prefix
# (stamp and space) that every stored line begins with.
STAMP_WIDTH = 27
PREFIX_WIDTH = STAMP_WIDTH + 1
_PATTERN = r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{6}Z "
_PREFIX = re.compile(_PATTERN.encode())
_PREFIX_TEXT = re.compile(_PATTERN)
# The last microsecond a stamp can hold (the end of year 9999); the first
# is 1970's.
LATEST_MICROS = 253402300799_999999


def format_stamp(when: float, up: bool = False) -> str:
    """`when` (seconds since the epoch) as a stamp, to the microsecond below
    (above if `up`), clamped to the years a stamp can hold. A float a hair
    off a whole microsecond (1.000001 is 1.00000099999...) counts as on it."""
    exact = min(max(when, 0.0), LATEST_MICROS / 1_000_000) * 1_000_000
    near = round(exact)
    micros = near if abs(exact - near) < 0.01 else (math.ceil(exact) if up else math.floor(exact))
    micros = min(micros, LATEST_MICROS)
    seconds, fraction = divmod(micros, 1_000_000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{fraction:06d}Z"


def stamp_seconds(stamp: str) -> float:
    """A stamp back to seconds since the epoch."""
    whole = time.strptime(stamp[:19], "%Y-%m-%dT%H:%M:%S")
    return float(calendar.timegm(whole)) + int(stamp[20:26]) / 1_000_000


def split_stamp(line: str) -> tuple[str | None, str]:
    """A stored line as (its stamp, or None for a line without one; the
    text the worker printed)."""
    if _PREFIX_TEXT.match(line):
        return line[:STAMP_WIDTH], line[PREFIX_WIDTH:]
    return None, line


# ------------------------------------------------------------- reading

# The most lines one `logs` request may ask for.
MAX_LOG_TAIL = 100_000


def requested_lines(path: Path, body: dict[str, Any], backups: int) -> list[str]:
    """The stored lines a `logs` request (PROTOCOL.md) asks for: the last
    `lines` of those stamped from `since` to `until` (both included), with
    their stamps if `timestamps`. A bad field is a `bad_field` error."""
    count = max(0, min(int(body.get("lines", 50)), MAX_LOG_TAIL))
    since = _time_field(body, "since")
    until = _time_field(body, "until")
    timestamps = body.get("timestamps", False)
    if not isinstance(timestamps, bool):
        raise RemoteProtocolError(
            ErrorCode.BAD_FIELD,
            f"'logs' body field 'timestamps' must be bool, got {type(timestamps).__name__}",
        )
    if not count:
        return []
    return tail(path, count, backups, since=since, until=until, timestamps=timestamps)


def _time_field(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        shown = type(value).__name__ if not isinstance(value, float) else repr(value)
        raise RemoteProtocolError(
            ErrorCode.BAD_FIELD,
            f"'logs' body field {name!r} must be a finite number of seconds since the epoch "
            f"(UTC), got {shown}",
        )
    return float(value)


def tail(
    path: Path,
    count: int,
    backups: int = 3,
    *,
    since: float | None = None,
    until: float | None = None,
    timestamps: bool = False,
) -> list[str]:
    """The last `count` lines of a log and, if needed, its rotated files:
    only those stamped from `since` to `until` (seconds since the epoch,
    both included) when given; each without its stamp unless `timestamps`.
    A line without a stamp is older than any time (see the top)."""
    # Stamps sort as text, so the bounds become stamps and lines are kept
    # by comparing bytes: `since` rounded up to the microsecond, `until`
    # down, which is exact, as stamps hold whole microseconds.
    low = format_stamp(since, up=True).encode() if since is not None else None
    high = format_stamp(until).encode() if until is not None else None
    cut = 0 if timestamps else PREFIX_WIDTH
    out: deque[str] = deque(maxlen=count)
    files = [path.with_name(f"{path.name}.{i}") for i in range(backups, 0, -1)] + [path]
    for f in files:
        try:
            with open(f, "rb") as fh:
                for raw in fh:
                    if not _PREFIX.match(raw, 0, PREFIX_WIDTH):
                        if low is None:
                            out.append(raw.rstrip(b"\n").decode("utf-8", "replace"))
                        continue
                    if (low is not None and raw[:STAMP_WIDTH] < low) or (
                        high is not None and raw[:STAMP_WIDTH] > high
                    ):
                        continue
                    out.append(raw[cut:].rstrip(b"\n").decode("utf-8", "replace"))
        except FileNotFoundError:
            continue
    return list(out)
