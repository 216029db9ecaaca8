"""Durations as people write them: 90, 90s, 10m, 2h, 1h30m, 1d.

One reading for every place that takes one: `kill --idle-for`, and each
setting in seconds, on the command line and in the configuration file.
"""

from __future__ import annotations

import re

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# Numbers each followed by a unit, the last one's unit optional (seconds).
WHOLE = re.compile(r"(?:\d+(?:\.\d+)?[smhd])*(?:\d+(?:\.\d+)?)?")
PART = re.compile(r"(\d+(?:\.\d+)?)([smhd]?)")


def parse_duration(text: str) -> float:
    """'90', '90s', '10m', '2h', '1h30m', '1d' -> seconds; ValueError saying
    what a duration looks like otherwise."""
    value = text.strip().lower()
    if not value:
        raise ValueError("empty duration")
    if not WHOLE.fullmatch(value):
        raise ValueError(f"{text!r} is not a duration like 90s, 10m, 2h or 1h30m")
    return sum(float(number) * UNITS.get(unit, 1) for number, unit in PART.findall(value))
