"""How `hermes-sup serve` writes its own log to stderr.

`text` (the default) is one line per record: time, level, logger, then the
supervisor's `event key=value ...` (local/logfmt.py). `json` is one
JSON object per record, `{"ts", "level", "logger", "event", <fields>}`, the
fields read back from the key=value line, so journald and log shippers can
filter by session, pid or event; a record that is not key=value keeps its
text as `message`, and a traceback goes in `traceback`.

On a terminal, serve also says what a person waits for when Ctrl-C starts
a shutdown: how long running turns get, and that a second Ctrl-C forces it.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from typing import Any

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
LOG_FORMATS = ("text", "json")
_PAIR = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S*)')
_EVENT = re.compile(r"[a-z][a-z0-9_]*\Z")


def parse_kv(message: str) -> dict[str, Any] | None:
    """`event key=value ...` as {"event": ..., key: value}; None if the
    message is not such a line."""
    event, _, rest = message.partition(" ")
    if not _EVENT.match(event):
        return None
    fields: dict[str, Any] = {"event": event}
    pos = 0
    rest = rest.strip()
    while pos < len(rest):
        found = _PAIR.match(rest, pos)
        if found is None:
            return None
        value = found.group(2)
        if value.startswith('"') and value.endswith('"') and len(value) >= 2:
            value = value[1:-1].replace('\\"', '"')
        fields.setdefault(found.group(1), value)
        pos = found.end()
        while pos < len(rest) and rest[pos] == " ":
            pos += 1
    return fields


class JsonFormatter(logging.Formatter):
    """One JSON object a record."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        item: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        fields = parse_kv(message)
        if fields is None:
            item["message"] = message
        else:
            item.update({k: v for k, v in fields.items() if k not in item})
        if record.exc_info:
            item["traceback"] = self.formatException(record.exc_info)
        return json.dumps(item, default=str)


class ShutdownHint(logging.Filter):
    """After the supervisor's `shutdown` line, a sentence for the person at
    the terminal: what the wait is for, and how to cut it short."""

    def __init__(self, grace: float) -> None:
        super().__init__()
        self.grace = grace

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("shutdown signal="):
            print(
                f"hermes-sup: stopping: running turns get up to {self.grace:g}s to finish, "
                "then every worker is stopped; press Ctrl-C again to stop them now",
                file=sys.stderr,
                flush=True,
            )
        elif message.startswith("shutdown_forced"):
            print("hermes-sup: stopping every worker now", file=sys.stderr, flush=True)
        return True


def configure(level: str, log_format: str, grace: float) -> None:
    """The root logger's one handler, on stderr, in `log_format`."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    if sys.stderr.isatty():
        handler.addFilter(ShutdownHint(grace))
    logging.basicConfig(level=level.upper(), handlers=[handler])
