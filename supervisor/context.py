"""What every part of the supervisor reads: the settings in force, and the
few facts about the service as a whole.

A reload swaps `settings` (and `base_env`, `max_sessions`) here, in one
place; no part keeps a `Settings` of its own. A session runs with the
settings it was started under until its worker restarts, which is why its
settings are looked up with `settings_for(session)`, never
`session.settings or ...` at each use.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Coroutine
from typing import Any

from hermes_sup.local.logfmt import kv

from .config import Settings
from .metrics import Metrics
from .session import Session

log = logging.getLogger("hermes_sup.supervisor")


class Context:
    """The settings in force and service-wide facts, shared by the parts."""

    def __init__(self, settings: Settings, environ: dict[str, str]) -> None:
        self.settings = settings
        # The supervisor's own environment (less NOTIFY_SOCKET), and the part
        # of it that workers get (`pass_env`): recomputed on reload.
        self.environ = environ
        self.base_env: dict[str, str] = {}
        self.max_sessions = settings.max_sessions or 1
        self.accepting = True  # False from the start of shutdown
        self.forced = False  # told twice to shut down: no more grace
        self.started = time.time()
        self._metrics: Metrics | None = None
        self.tasks: set[asyncio.Task[Any]] = set()
        # This supervisor's name among a cluster's nodes, fixed at start (a
        # lease names it, so a reload must not change it), and whether it is
        # draining: taking no new sessions, stopping its idle ones (`drain`).
        self.node = settings.node or socket.gethostname()
        self.draining = False

    @property
    def metrics(self) -> Metrics | None:
        """The Prometheus metrics, if they are on."""
        return self._metrics

    @metrics.setter
    def metrics(self, metrics: Metrics | None) -> None:
        # The node's name and drain go into every scrape.
        if metrics is not None:
            metrics.node_info = lambda: (self.node, self.draining)
        self._metrics = metrics

    def settings_for(self, session: Session) -> Settings:
        """The settings a session's worker was started under (those in force
        for a session that has not started one)."""
        return session.settings or self.settings

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run `coro` as a task the supervisor keeps (and waits for at
        shutdown); an exception in it is a bug, logged with its traceback."""
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error(kv("bug", where="task"), exc_info=task.exception())
