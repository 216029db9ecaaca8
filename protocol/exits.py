"""Named exit codes of worker processes.

They let the supervisor tell "crashed once" from "will never start": a
worker that cannot load its runtime exits with RUNTIME_LOAD_FAILED and is not
respawned in a loop.
"""

from __future__ import annotations

import signal
from enum import IntEnum


class WorkerExit(IntEnum):
    """Exit codes a worker chooses. Anything else is a crash."""

    OK = 0  # asked to stop, stopped
    BOOT_FAILED = 70  # could not set up its environment, directories or sockets
    RUNTIME_LOAD_FAILED = 71  # the agent runtime failed to import or construct
    SUPERVISOR_GONE = 72  # the supervisor died; the worker cleaned up and left
    SEAL_FAILED = 73  # sealed mode: a namespace, mount or privilege step failed; nothing ran


def describe_exit(code: int | None, signal_name: str | None) -> str:
    """A sentence saying why a worker ended, for errors and logs."""
    if signal_name is not None:
        if signal_name == "SIGKILL":
            return "killed by SIGKILL (perhaps out of memory)"
        if signal_name == "SIGXCPU":
            return "killed by SIGXCPU (CPU time limit exceeded)"
        return f"killed by {signal_name}"
    if code is None:
        return "ended for an unknown reason"
    try:
        named = WorkerExit(code)
    except ValueError:
        if 128 < code <= 128 + 64:
            # A sealed worker is the init of its PID namespace: it ends on a
            # signal it handles, with 128 + the signal's number, as shells say.
            try:
                return f"exited with status {code} (128 + {signal.Signals(code - 128).name})"
            except ValueError:
                pass
        return f"exited with status {code}"
    return {
        WorkerExit.OK: "exited normally",
        WorkerExit.BOOT_FAILED: "failed to boot (status 70, see the session log)",
        WorkerExit.RUNTIME_LOAD_FAILED: "could not load its agent runtime (status 71, see the session log)",
        WorkerExit.SUPERVISOR_GONE: "exited because the supervisor went away",
        WorkerExit.SEAL_FAILED: "could not seal its session (status 73: a namespace, mount or "
        "privilege step failed; nothing of the session ran; see the session log)",
    }[named]


def signal_named(value: str) -> signal.Signals:
    """'TERM', 'SIGTERM', 'sigterm' or '15' as a signal (what `signal` takes
    on the wire); ValueError naming the forms otherwise."""
    text = value.strip().upper()
    try:
        if text.isdigit():
            return signal.Signals(int(text))
        return signal.Signals[text if text.startswith("SIG") else "SIG" + text]
    except (KeyError, ValueError):
        raise ValueError(
            f"{value[:20]!r} is not a signal name or number (e.g. TERM, HUP, 10)"
        ) from None
