"""What a start says while it is under way.

Before the control socket is up nothing answers a client, and the sealed
Hermes preload alone may take a minute. So the start reports each stage
(reading the data directory, finding how to seal, the zygote and its
preload, opening the socket) in the state directory's STARTING_FILE, with
the seconds since it began: every client reads it, says "starting" and
exits with its own code, and `send` waits for the start to end. systemd
hears the preload's progress as STATUS=. The file goes when the control
socket is up (clients connect from then on) or when the start fails.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from hermes_sup.local import statedir
from hermes_sup.local.logfmt import kv

from .notify import Notifier

log = logging.getLogger("hermes_sup.supervisor")


class StartReport:
    """The start's progress, for clients (a file) and systemd (STATUS=)."""

    def __init__(self, state_dir: Path, notifier: Notifier) -> None:
        self.state_dir = state_dir
        self.notifier = notifier
        self.began = time.monotonic()
        # Serving: a zygote restarted from now on is no start to report.
        self.serving = False

    def stage(self, said: str, **more: Any) -> None:
        """Say what the start is doing now, with the seconds since it began."""
        if self.serving:
            return
        seconds = round(time.monotonic() - self.began, 1)
        report = {**more, "pid": os.getpid(), "stage": said, "seconds": seconds}
        try:
            statedir.write_starting(self.state_dir, report)
        except OSError as exc:
            log.warning(kv("starting_file_failed", error=str(exc)))

    def preload(self, report: dict[str, Any]) -> None:
        """The sealed Hermes preload's progress (the zygote's report)."""
        done, of = report.get("done"), report.get("of")
        if done == of:  # the zygote still builds Hermes's runtime after the imports
            said = f"preloaded Hermes's {of} modules, readying the zygote"
        else:
            said = f"preloading Hermes: {done} of {of} modules"
        self.notifier.status(said)
        self.stage(said, **{k: v for k, v in report.items() if k != "seconds"})

    def done(self) -> None:
        """The control socket is up, or the start failed: clients stop reading."""
        self.serving = True
        statedir.clear_starting(self.state_dir)
