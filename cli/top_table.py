"""What `hermes-sup top` shows, apart from drawing it: the sessions as
`list` returns them, sorted, filtered, one line each, and which one is
selected. No terminal here, so it is tested by feeding rows.

The selection follows the session, not the line: a redraw that reorders
the rows (a session's CPU rose) keeps the same session selected, so a
key pressed to kill it never lands on its neighbour.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from .show import duration, shorten, size

# Sort orders by key, as top's: what each sorts by, largest first (the key
# itself: alphabetical). A row without the figure sorts last.
SORTS: dict[str, tuple[str, str]] = {
    "P": ("cpu_percent", "CPU%"),
    "M": ("rss", "RSS"),
    "T": ("tokens", "TOKENS"),
    "A": ("started", "AGE"),
    "N": ("key", "KEY"),
}
COLUMNS = "{key}  {state:<10} {pid:>7} {cpu:>6} {rss:>8} {procs:>5} {turns:>6} {queued:>4} {tokens:>8} {age:>7} {idle:>7}"
HEADER_FIELDS = {
    "state": "STATE",
    "pid": "PID",
    "cpu": "CPU%",
    "rss": "RSS",
    "procs": "PROCS",
    "turns": "TURNS",
    "queued": "QUEUE",
    "tokens": "TOKENS",
    "age": "AGE",
    "idle": "IDLE",
}
KEY_MIN, KEY_MAX = 8, 40


def _number(row: dict[str, Any], name: str) -> float | None:
    value = row.get(name)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _count(value: Any) -> str:
    if not isinstance(value, int) or isinstance(value, bool):
        return "-"
    return f"{value / 1000:.1f}k" if value >= 10_000 else str(value)


@dataclass
class Table:
    """The sessions on screen: the sort, the filter and the selection."""

    sort: str = "P"
    filter: str = ""
    rows: list[dict[str, Any]] = field(default_factory=list)
    selected: str | None = None  # the selected session's key

    def update(self, rows: list[dict[str, Any]]) -> None:
        """New rows from `list`: sorted and filtered, the selection kept on
        its session where it is still shown, else on the nearest line."""
        shown = [r for r in rows if self.filter.lower() in str(r.get("key", "")).lower()]
        name = SORTS[self.sort][0]
        if name == "key":
            shown.sort(key=lambda r: str(r.get("key", "")))
        elif name == "started":  # oldest first: the longest-lived on top
            shown.sort(key=lambda r: (_number(r, name) is None, _number(r, name) or 0.0))
        else:
            shown.sort(key=lambda r: (_number(r, name) is None, -(_number(r, name) or 0.0)))
        keys = [r.get("key") for r in shown]
        if self.selected not in keys:
            old = [r.get("key") for r in self.rows]
            at = old.index(self.selected) if self.selected in old else 0
            self.selected = keys[min(at, len(keys) - 1)] if keys else None
        self.rows = shown

    def move(self, by: int) -> None:
        """Select the row `by` lines down (up when negative), kept on screen."""
        keys = [r.get("key") for r in self.rows]
        if not keys:
            return
        at = keys.index(self.selected) if self.selected in keys else 0
        self.selected = keys[max(0, min(len(keys) - 1, at + by))]

    def sort_by(self, letter: str) -> None:
        self.sort = letter
        self.update(self.rows)

    def filter_by(self, text: str, all_rows: list[dict[str, Any]]) -> None:
        self.filter = text
        self.update(all_rows)

    def lines(self, width: int, now: float | None = None) -> tuple[str, list[tuple[bool, str]]]:
        """The header line, and each row's line with whether it is selected,
        fitted to `width` columns (keys cut in the middle, as `list` does)."""
        now = time.time() if now is None else now
        longest = max((len(str(r.get("key", ""))) for r in self.rows), default=KEY_MIN)
        rest = len(COLUMNS.format(key="", **dict.fromkeys(HEADER_FIELDS, "")))
        key_width = max(KEY_MIN, min(KEY_MAX, longest, width - rest))
        sorted_by = SORTS[self.sort][1]
        heads = {k: (v + "▾" if v == sorted_by else v) for k, v in HEADER_FIELDS.items()}
        key_head = "KEY▾" if sorted_by == "KEY" else "KEY"
        header = COLUMNS.format(key=key_head.ljust(key_width), **heads)
        out = []
        for row in self.rows:
            key = str(row.get("key", ""))
            started, last = _number(row, "started"), _number(row, "last_activity")
            line = COLUMNS.format(
                key=shorten(key, key_width).ljust(key_width),
                state=str(row.get("state", "?"))[:10],
                pid=row.get("pid") or "-",
                cpu="-" if _number(row, "cpu_percent") is None else f"{row['cpu_percent']:.1f}",
                rss=size(row.get("rss")),
                procs=_count(row.get("procs")),
                turns=_count(row.get("turns")),
                queued=_count(row.get("queued")),
                tokens=_count(row.get("tokens")),
                age=duration(now - started) if started else "-",
                idle=duration(now - last) if last else "-",
            )
            out.append((key == self.selected, line[:width]))
        return header[:width], out
