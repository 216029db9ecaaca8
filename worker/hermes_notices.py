"""What a Hermes agent says outside its turns: background processes, cron jobs.

A process the agent started with `notify_on_complete` (or `watch_patterns`)
ends or matches after the turn did. Hermes's process registry puts that on
its completion queue, which Hermes's own gateway drains to start a new turn
in the chat. In a worker nobody else drains it: this thread does, and sends
each event as a notice (PROTOCOL.md, "Notices"), for the front end to start
that turn. Only what the notice needs is sent; where it goes is the front
end's decision (it knows which chat the session is), never the event's.

Cron jobs the agent made live in the session's own home; Hermes's gateway
would tick them and deliver their output. Here a thread ticks them
(Hermes's `cron.scheduler.tick`, every TICK seconds) and their delivery is
replaced: the output goes out as a notice, to the session's chat only, as
a job's explicit target elsewhere is not this session's to reach. That
delivery function is an internal of Hermes (pinned with the runtime).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from hermes_sup.protocol.messages import PROCESS_NOTICE_FIELDS as FIELDS

log = logging.getLogger("hermes_sup.worker.hermes")

POLL = 0.25  # seconds between looks at the queue when it is empty
TICK = 15.0  # seconds between looks for due cron jobs
MAX_MESSAGE = 16 * 1024  # characters of a cron job's output sent on
# The completion queue's events a chat hears of (their fields: FIELDS).
EVENT_TYPES = ("completion", "watch_match", "watch_disabled")
MAX_FIELD = 4096


def start_notices(notify: Callable[[Any], None]) -> threading.Thread:
    """Drain Hermes's completion queue into notices, in a daemon thread."""
    from tools.process_registry import process_registry

    thread = threading.Thread(
        target=_drain, args=(process_registry.completion_queue, notify), name="notices", daemon=True
    )
    thread.start()
    return thread


def start_cron(notify: Callable[[Any], None]) -> threading.Thread:
    """Tick the session's cron jobs in a daemon thread; their output as notices."""
    import cron.scheduler as scheduler

    def deliver(job: dict[str, Any], content: str, adapters: Any = None, loop: Any = None) -> None:
        notify(
            {
                "kind": "message",
                "text": str(content)[:MAX_MESSAGE],
                "job": str(job.get("name") or job.get("id") or ""),
            }
        )
        return None  # delivered, as far as the job is concerned

    scheduler._deliver_result = deliver

    def run() -> None:
        while True:
            try:
                scheduler.tick(verbose=False)
            except Exception:
                log.exception("cron tick failed")
            threading.Event().wait(TICK)

    thread = threading.Thread(target=run, name="cron", daemon=True)
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
