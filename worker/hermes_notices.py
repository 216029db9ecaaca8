"""What a Hermes agent says outside its turns: its background processes.

A process the agent started with `notify_on_complete` (or `watch_patterns`)
ends or matches after the turn did. Hermes's process registry puts that on
its completion queue, which Hermes's own gateway drains to start a new turn
in the chat. In a worker nobody else drains it: this thread does, and sends
each event as a notice (PROTOCOL.md, "Notices"), for the front end to start
that turn. Only what the notice needs is sent; where it goes is the front
end's decision (it knows which chat the session is), never the event's.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("hermes_sup.worker.hermes")

POLL = 0.25  # seconds between looks at the queue when it is empty
# The completion queue's events a chat hears of, and their fields it needs.
EVENT_TYPES = ("completion", "watch_match", "watch_disabled")
FIELDS = (
    "type",
    "session_id",
    "command",
    "exit_code",
    "completion_reason",
    "termination_source",
    "output",
    "started_at",
    "pattern",
    "suppressed",
    "message",
)
MAX_FIELD = 4096


def start_notices(notify: Callable[[Any], None]) -> threading.Thread:
    """Drain Hermes's completion queue into notices, in a daemon thread."""
    from tools.process_registry import process_registry

    thread = threading.Thread(
        target=_drain, args=(process_registry.completion_queue, notify), name="notices", daemon=True
    )
    thread.start()
    return thread


def _drain(completions: queue.Queue[Any], notify: Callable[[Any], None]) -> None:
    while True:
        try:
            event = completions.get(timeout=POLL * 4)
        except queue.Empty:
            continue
        if not isinstance(event, dict) or event.get("type", "completion") not in EVENT_TYPES:
            continue
        kept = {name: _plain(event[name]) for name in FIELDS if name in event}
        kept.setdefault("type", "completion")
        try:
            notify({"kind": "process", "event": kept})
        except Exception:
            log.exception("a background process notice was not sent")


def _plain(value: Any) -> Any:
    if isinstance(value, str):
        return value[-MAX_FIELD:]
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return str(value)[-MAX_FIELD:]
