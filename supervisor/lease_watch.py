"""Fencing that reaches the worker: the leases this supervisor holds are
read back continuously, not only when it writes.

The fence in ownership.py guards the supervisor's own writes and each
turn's start; a worker already running a turn writes into the session's
files on its own. An owner cut off from the file server loses its lease
there while its worker goes on, so every CHECK_EVERY seconds the epoch
file of each session whose lease we hold is read (one small read each,
O(sessions held)), in a thread so that a slow file server never stalls
the loop. A session whose epoch is no longer ours is given up at once:
the ordinary fence (`Ownership.fenced`) logs it, lets the lock go, answers
its turns `moved` and SIGKILLs its worker and everything under it. The
worker's writes then overlap a new owner's for at most about one pass.

A pass that is still reading (a file server that does not answer) is not
doubled: the next starts when it ends.

Only where leases can be lost: on a data directory only this host uses
(leases.py, "Where the lock can be lost") a held lock cannot be taken, so
the watch does not run at all, and an idle supervisor does no work per
live session for it.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from hermes_sup.local.logfmt import kv

from .leases import Lease, read_epoch
from .ownership import Ownership
from .session import Session

log = logging.getLogger("hermes_sup.supervisor")

CHECK_EVERY = 0.5  # seconds between two passes over the leases held


def read_epochs(dirs: list[Path]) -> list[tuple[int, str] | None]:
    """Each directory's epoch line; None for one that cannot be read."""
    seen: list[tuple[int, str] | None] = []
    for path in dirs:
        try:
            seen.append(read_epoch(path))
        except OSError:
            seen.append(None)
    return seen


class LeaseWatch:
    """Reads back the epoch of every lease held, and gives up those taken over."""

    def __init__(
        self, sessions: dict[str, Session], ownership: Ownership, every: float = CHECK_EVERY
    ) -> None:
        self.sessions = sessions
        self.ownership = ownership
        self.every = every

    async def run(self) -> None:
        """Check every `every` seconds, until cancelled; on a data directory
        that is not shared, nothing (see the module docstring)."""
        if not self.ownership.shared:
            return
        while True:
            await asyncio.sleep(self.every)
            try:
                await self.check_all()
            except Exception:
                log.exception(kv("bug", where="lease_watch"))

    def held(self) -> list[tuple[Session, Lease]]:
        """The sessions whose lease we hold and have fenced (an unfenced
        one, whose epoch could not be written, is guarded by its lock alone)."""
        return [
            (session, session.lease)
            for session in self.sessions.values()
            if session.lease is not None and not session.lease.unfenced
        ]

    async def check_all(self) -> int:
        """One pass; returns how many sessions were found taken over."""
        held = self.held()
        if not held:
            return 0
        loop = asyncio.get_running_loop()
        seen = await loop.run_in_executor(None, read_epochs, [lease.dir for _, lease in held])
        lost = 0
        for (session, lease), epoch in zip(held, seen, strict=True):
            if session.lease is not lease or epoch == (lease.epoch, lease.token):
                continue  # given up or retaken meanwhile, or still ours
            # The ordinary fence reads it once more and acts on what it finds.
            if not self.ownership.fenced(session):
                lost += 1
        return lost
