"""How the client commands show things: session states in display order and
their colours, short durations and sizes, and the `hermes-sup list` table."""

from __future__ import annotations

import os
import sys
from typing import Any

import click

STATE_ORDER = ["busy", "starting", "idle", "stopping", "backoff", "failed", "exited"]
STATE_COLORS = {
    "busy": "yellow",
    "idle": "green",
    "starting": "cyan",
    "stopping": "cyan",
    "backoff": "magenta",
    "failed": "red",
    "exited": None,
}


def use_color(ctx: click.Context) -> bool:
    """Colour only on a terminal, and never when NO_COLOR is set."""
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR")


def duration(seconds: float | None) -> str:
    """Seconds as at most two units: 42s, 3m07s, 5h02m, 2d04h; None as '-'."""
    if seconds is None:
        return "-"
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


def size(n: int | None) -> str:
    """Bytes in binary units: 512B, 1.5K, 20.3M, 2.0G; None as '-'."""
    if n is None:
        return "-"
    for unit in ("B", "K", "M", "G"):
        if n < 1024 or unit == "G":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n}"


def shorten(key: str, width: int) -> str:
    """Fit a key in `width` columns, marking the cut visibly."""
    return key if len(key) <= width else key[: width - 1] + "…"


def session_table(rows: list[dict[str, Any]], color: bool, now: float) -> list[str]:
    """The lines of `hermes-sup list`: a header, one row per session (busiest
    states first, then by key) and a line of totals; 80 columns wide."""
    rows = sorted(rows, key=lambda r: (STATE_ORDER.index(r["state"]), r["key"]))
    header = (
        f"{'SESSION':<24} {'STATE':<8} {'PID':>7} {'UPTIME':>7} {'IDLE':>6} "
        f"{'TURNS':>5} {'RSS':>7} {'CPU%':>5}"
    )
    lines = [click.style(header, bold=True) if color else header]
    total_rss = 0
    for r in rows:
        up = now - r["started"] if r["pid"] and r["started"] else None
        cpu = "-" if r.get("cpu_percent") is None else f"{r['cpu_percent']:.1f}"
        total_rss += r.get("rss") or 0
        state_cell = f"{r['state']:<8}"
        if color and STATE_COLORS.get(r["state"]):
            state_cell = click.style(state_cell, fg=STATE_COLORS[r["state"]])
        lines.append(
            f"{shorten(r['key'], 24):<24} {state_cell} {r['pid'] or '-':>7} {duration(up):>7} "
            f"{duration(now - r['last_activity']):>6} {r['turns']:>5} "
            f"{size(r.get('rss')):>7} {cpu:>5}"
        )
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["state"]] = counts.get(r["state"], 0) + 1
    by_state = ", ".join(f"{counts[s]} {s}" for s in STATE_ORDER if s in counts)
    runtime = rows[0]["runtime"] if rows else "-"
    lines.append(
        f"{len(rows)} session(s){': ' + by_state if by_state else ''}; "
        f"RSS {size(total_rss)}; runtime {runtime}"
    )
    return lines
