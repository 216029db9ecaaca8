"""A tool call as one line a person reads: `· terminal: ls -la`.

A Hermes turn reports each tool call three ways: `tool_start` (name,
arguments and Hermes's own preview of them), `tool_progress` (Hermes's
`tool.started` / `tool.completed` and its other progress events) and
`tool_complete` (the result). Printed as they come, that is three lines of
JSON per call. `send` and `attach` show one line per call instead, made
here: the preview Hermes gives (or the argument that says most), a line only
when the tool failed, and the progress events that say something new
(a subagent's progress, say). The raw events stay available with `--json`
(send) and `events` (the session's stream).
"""

from __future__ import annotations

import json
from typing import Any

# Progress events that repeat what tool_start / tool_complete already said,
# or that carry the model's hidden reasoning (Hermes's own CLI shows neither).
_REPEATS = frozenset({"tool.started", "tool.completed", "_thinking", "reasoning.available"})
# The arguments that say most about a call, in the order they are looked for.
_TELLING = ("command", "cmd", "path", "file_path", "url", "query", "pattern", "code", "text")
WIDTH = 160


def one_line(value: Any, limit: int = WIDTH) -> str:
    """A value on one line, cut to `limit` characters."""
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _summary(args: Any) -> str:
    """What a call's arguments come to in a few words: the telling one, else
    the only one, else all of them as JSON."""
    if not isinstance(args, dict):
        return "" if args in (None, "") else one_line(args, 120)
    for name in _TELLING:
        if isinstance(args.get(name), str) and args[name].strip():
            return one_line(args[name], 120)
    if len(args) == 1:
        return one_line(next(iter(args.values())), 120)
    return one_line(args, 120) if args else ""


def started(name: str, args: Any, data: Any) -> str:
    """The line for a tool call starting: `· NAME: WHAT`."""
    shown = data if isinstance(data, dict) else {}
    preview = shown.get("preview")
    what = one_line(preview, 120) if isinstance(preview, str) and preview else _summary(args)
    return f"· {name or '?'}: {what}" if what else f"· {name or '?'}"


def completed(name: str, data: Any) -> str | None:
    """The line for a tool call ending: None when it went well (the start
    said what it was), a line saying it failed otherwise."""
    shown = data if isinstance(data, dict) else {}
    if not shown.get("is_error"):
        return None
    result = shown.get("result")
    why = f": {one_line(result, 120)}" if result not in (None, "") else ""
    return f"· {name or '?'} failed{why}"


def progress(data: Any) -> str | None:
    """The line for a progress event, or None when it repeats the start and
    end lines (or is the model's reasoning)."""
    shown = data if isinstance(data, dict) else {}
    event = str(shown.get("event") or "progress")
    if event in _REPEATS:
        return None
    what = shown.get("preview") or shown.get("label") or shown.get("tool") or ""
    return f"· {event}: {one_line(what, 120)}" if what else f"· {event}"
