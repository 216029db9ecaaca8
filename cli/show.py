"""How the client commands show things: session states in display order and
their colours, short durations and sizes, and the `hermes-sup list` table."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import click

STATE_ORDER = [
    "busy",
    "starting",
    "idle",
    "stopping",
    "backoff",
    "failed",
    "hibernated",
    "exited",
]
STATE_COLORS = {
    "busy": "yellow",
    "idle": "green",
    "starting": "cyan",
    "stopping": "cyan",
    "backoff": "magenta",
    "failed": "red",
    "hibernated": None,
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
    """Fit a key in `width` columns by cutting its middle, visibly: the
    platform at its start and the thread or chat at its end both stay."""
    if len(key) <= width:
        return key
    tail = (width - 1) // 2
    return key[: width - 1 - tail] + "…" + key[len(key) - tail :]


# Every column of `list` but the key: (header, width, right-aligned).
COLUMNS = [
    ("STATE", 8, False),
    ("PID", 7, True),
    ("UPTIME", 7, True),
    ("IDLE", 6, True),
    ("TURNS", 5, True),
    ("RSS", 7, True),
    ("CPU%", 5, True),
]
MIN_KEY_WIDTH = 16
# The LABEL column (shown only when a session has a label) is at most this
# wide: a label may have 200 characters; the rest is in `inspect`.
MAX_LABEL_WIDTH = 32
# BRANCH (shown only when a session works on a git repository): its branch.
MAX_BRANCH_WIDTH = 48


def _optional_width(rows: list[dict[str, Any]], field: str, most: int) -> int:
    """The width of a column shown only when some row has the field: 0
    when none has it."""
    values = [len(r.get(field) or "") for r in rows]
    if not any(values):
        return 0
    return min(most, max(len(field), *values))


def sort_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Busiest states first, then by key: the order of every `list` output."""
    order = {state: i for i, state in enumerate(STATE_ORDER)}
    return sorted(rows, key=lambda r: (order.get(r["state"], len(order)), r["key"]))


def session_table(
    rows: list[dict[str, Any]], color: bool, now: float, width: int | None = None
) -> list[str]:
    """The lines of `hermes-sup list`: a header, one row per session (busiest
    states first, then by key) and a line of totals. The key column is as
    wide as the longest key; given a `width` (the terminal's) that the table
    would overflow, keys are cut in the middle to fit it. Rows from more
    than one node (a router's list) get a NODE column."""
    rows = sort_rows(rows)
    nodes = {r.get("node") for r in rows}
    node_width = max(len("NODE"), *(len(str(n)) for n in nodes)) if len(nodes) > 1 else 0
    node_width = min(node_width, MAX_BRANCH_WIDTH)
    branch_width = _optional_width(rows, "branch", MAX_BRANCH_WIDTH)
    label_width = _optional_width(rows, "label", MAX_LABEL_WIDTH)
    rest = sum(w + 1 for _, w, _ in COLUMNS)
    rest += sum(w + 1 for w in (node_width, branch_width, label_width) if w)
    key_width = max([len("SESSION"), *(len(r["key"]) for r in rows)])
    if width is not None and key_width + rest > width:
        key_width = max(MIN_KEY_WIDTH, width - rest)
    header = f"{'SESSION':<{key_width}} " + " ".join(
        f"{name:>{w}}" if right else f"{name:<{w}}" for name, w, right in COLUMNS
    )
    if node_width:
        header += f" {'NODE':<{node_width}}"
    if branch_width:
        header += f" {'BRANCH':<{branch_width}}"
    if label_width:
        header += " LABEL"
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
            f"{shorten(r['key'], key_width):<{key_width}} {state_cell} {r['pid'] or '-':>7} "
            f"{duration(up):>7} {duration(now - r['last_activity']):>6} {r['turns']:>5} "
            f"{size(r.get('rss')):>7} {cpu:>5}"
            + (
                f" {shorten(str(r.get('node') or '-'), node_width):<{node_width}}"
                if node_width
                else ""
            )
            + (
                f" {shorten(r.get('branch') or '-', branch_width):<{branch_width}}"
                if branch_width
                else ""
            )
            + (f" {shorten(r.get('label') or '-', label_width)}" if label_width else "")
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


class _Fields(dict):  # type: ignore[type-arg]
    """A row for str.format_map that names the fields when one is unknown."""

    def __missing__(self, name: str) -> Any:
        raise click.UsageError(
            f"--format: no field {name!r}; the fields are {', '.join(sorted(self))}"
        )


def format_rows(template: str, rows: list[dict[str, Any]]) -> list[str]:
    """`list --format`: one line per row from a template over its JSON
    fields, `{key} {state} {rss}` (Python format specs allowed, `\\t` a tab);
    `json` prints each row as one JSON object."""
    if template == "json":
        return [json.dumps(r) for r in rows]
    template = template.replace("\\t", "\t").replace("\\n", "\n")
    out = []
    for r in rows:
        values = _Fields({k: "-" if v is None else v for k, v in r.items()})
        try:
            out.append(template.format_map(values))
        except (ValueError, IndexError, AttributeError, KeyError) as exc:
            raise click.UsageError(f"--format {template!r}: {exc}") from None
    return out


def clock(epoch: float) -> str:
    """A moment for a person: local time to the second, with the date
    only when it is not today (2026-12-03 09:15:02, or 09:15:02)."""
    moment = time.localtime(epoch)
    today = time.localtime()
    if moment[:3] == today[:3]:
        return time.strftime("%H:%M:%S", moment)
    return time.strftime("%Y-%m-%d %H:%M:%S", moment)


def inspect_lines(info: dict[str, Any], now: float) -> list[str]:
    """`hermes-sup inspect`: one session, a field a line."""
    pid = info.get("pid")
    state = info["state"] + (f" (pid {pid})" if pid else "")
    if pid and info.get("started"):
        state += f", up {duration(now - info['started'])}"
    state += f", last activity {duration(now - info['last_activity'])} ago"
    exits = f"{info['exits']} worker exit(s)"
    if info.get("last_exit"):
        exits += f", the last: {info['last_exit']}"
    options = info.get("options") or {}
    opts = []
    if options.get("session_env"):
        pairs = " ".join(f"{k}={v}" for k, v in sorted(options["session_env"].items()))
        opts.append(f"session_env {pairs}")
    if options.get("env"):
        opts.append("env " + ", ".join(options["env"]))
    if options.get("agent"):
        opts.append("agent " + " ".join(f"{k}={v}" for k, v in sorted(options["agent"].items())))
    if options.get("workspace"):
        opts.append(f"workspace {options['workspace']}")
    if options.get("runtime"):
        opts.append(f"runtime {options['runtime']}")
    logs = info.get("log_files") or []
    # Turns flip idle and busy: the life of the worker is in the rest.
    history = [
        h
        for h in info.get("state_history") or []
        if {h.get("previous"), h.get("state")} != {"idle", "busy"}
    ]
    steps = [
        (f"{clock(h['at'])} " if isinstance(h.get("at"), (int, float)) else "")
        + f"{h.get('previous')} -> {h.get('state')}"
        + (f" ({h['reason']})" if h.get("reason") else "")
        for h in history[-8:]
    ]
    lines = [
        f"session:    {info['key']}",
        *([f"label:      {info['label']}"] if info.get("label") else []),
        f"state:      {state}",
        f"runtime:    {info.get('runtime')}"
        + (
            "   (settings reloaded since it started: applies at its next start)"
            if info.get("settings_outdated")
            else ""
        ),
        f"turns:      {info['turns']} done, {info['queued']} queued"
        + (f", running {info['current_turn']}" if info.get("current_turn") else ""),
        f"exits:      {exits}",
        f"data:       {info['dir']}",
        f"workspace:  {info['workspace']}"
        + (
            f"   (a repository of its own from {info['repo']}, branch {info['branch']})"
            if info.get("repo")
            else ""
        ),
        f"home:       {info['home']}",
        f"tmp:        {info['tmp']}",
        f"log:        {info['log']}"
        + (f" (+{len(logs) - 1} rotated)" if len(logs) > 1 else "")
        + ("" if logs else " (nothing logged yet)"),
        f"options:    {'; '.join(opts) or 'none'}",
        f"env names:  {' '.join(info.get('env_names') or [])}",
        f"model:      {model_line(info.get('model'))}",
        # One step a line, each with its time.
        f"history:    {steps[0] if steps else 'no start or stop in its recent history'}",
        *(f"            {step}" for step in steps[1:]),
    ]
    if info.get("approvals_waiting"):
        after_turns = next(i for i, line in enumerate(lines) if line.startswith("turns:")) + 1
        lines.insert(after_turns, f"approvals:  waiting: {', '.join(info['approvals_waiting'])}")
    return lines


def model_line(use: dict[str, Any] | None) -> str:
    """A session's model use through the supervisor's model endpoint."""
    if not use:
        return "no calls through the supervisor's model endpoint"
    line = (
        f"{use['requests']} call(s), {use['input_tokens']} tokens in, "
        f"{use['output_tokens']} out, {use['bytes_in']} bytes sent, {use['bytes_out']} received"
    )
    if use.get("refused"):
        line += f", {use['refused']} refused (budget)"
    if use.get("http_key"):
        line += f"; HTTP key {use['http_key']}"
    return line
