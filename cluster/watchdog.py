"""A node agent's watchdog over its supervisor: a supervisor that stops
answering pings is killed, so that its locks are released and its sessions
can be served elsewhere.

The node agent only saw a supervisor that exited. One that is stopped
(SIGSTOP, a debugger) or whose loop is stuck keeps its leases locked and
its TCP port open: its keys got no answer and could be taken by no other
node until someone acted. The watchdog pings it on its control socket
every `every` seconds, each ping given `timeout` seconds; after `misses`
unanswered in a row it SIGKILLs it (its own child, by pid: a stopped
process dies at once), and the kernel drops its locks; its workers follow
it (their parent-death signal). Until a supervisor has answered once it is
starting, and only a start longer than `start_grace` counts against it.

With a node lease (`serve --lease-time`, supervisor/node_lease.py) the
watchdog also reads the node's lease file: a supervisor that does not
answer while its lease runs out within one ping's time is killed at once,
without waiting for `misses`. A frozen supervisor cannot give its sessions
up itself, and once its deadline passes another node may take them: its
workers, still running, must be gone first (they die with it).

Standard library and the blocking client only; the agent runs it in a thread.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hermes_sup.client import Client, NotRunning, Timeout


@dataclass(frozen=True)
class WatchdogSettings:
    """How often the supervisor is pinged, and how many misses kill it."""

    every: float = 1.0
    timeout: float = 2.0
    misses: int = 3
    start_grace: float = 120.0

    def check(self) -> None:
        """ValueError naming the setting that cannot be used."""
        if not self.every > 0:
            raise ValueError(f"ping interval must be above 0 seconds, not {self.every}")
        if not self.timeout > 0:
            raise ValueError(f"ping timeout must be above 0 seconds, not {self.timeout}")
        if self.misses < 1:
            raise ValueError(f"ping misses must be at least 1, not {self.misses}")


def lease_left(data_dir: Path, node: str) -> float | None:
    """Seconds until the node's lease runs out (negative: it has), None if
    it has none. The file is the supervisor's (supervisor/node_lease.py,
    `lease_path`; a test holds the two alike): read here without importing
    the supervisor's modules."""
    try:
        data = json.loads((data_dir / ".node-leases" / f"{node}.json").read_bytes())
    except (OSError, ValueError):
        return None
    deadline = data.get("deadline") if isinstance(data, dict) else None
    if isinstance(deadline, bool) or not isinstance(deadline, (int, float)):
        return None
    return float(deadline) - time.time()


def ping_supervisor(state_dir: Path, timeout: float) -> bool:
    """Whether the supervisor on `state_dir` answers a ping within `timeout`."""
    try:
        with Client(state_dir, timeout=timeout) as client:
            client.ping()
    except (NotRunning, Timeout, OSError):
        return False
    return True


class Watchdog:
    """Counts a supervisor's unanswered pings and kills it past the limit."""

    def __init__(
        self,
        pid: int,
        settings: WatchdogSettings,
        ping: Callable[[float], bool],
        kill: Callable[[int, int], None] = os.kill,
        lease_left: Callable[[], float | None] = lambda: None,
    ) -> None:
        self.pid = pid
        self.settings = settings
        self.ping = ping
        self.kill = kill
        self.lease_left = lease_left
        self.started = time.monotonic()
        self.answered = False
        self.missed = 0

    def check(self) -> str | None:
        """One ping; if this one made the limit, kill the supervisor and say why."""
        if self.ping(self.settings.timeout):
            self.answered = True
            self.missed = 0
            return None
        if not self.answered:
            if time.monotonic() - self.started < self.settings.start_grace:
                return None
            why = f"it did not answer a ping within {self.settings.start_grace:.0f}s of its start"
        else:
            self.missed += 1
            left = self.lease_left()
            if left is not None and left < self.settings.every + self.settings.timeout:
                why = (
                    f"it does not answer and its node lease runs out in {max(left, 0.0):.1f}s: "
                    "its workers must be gone before another node may take its sessions"
                )
            elif self.missed < self.settings.misses:
                return None
            else:
                why = f"it missed {self.missed} pings in a row ({self.settings.timeout:g}s each)"
        try:
            self.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return why

    def run(self, stopped: Callable[[float], bool]) -> str:
        """Check every `every` seconds until the supervisor is killed (why)
        or `stopped(wait)` says so (""): a threading.Event's `wait`."""
        while not stopped(self.settings.every):
            why = self.check()
            if why is not None:
                return why
        return ""
