"""A node's lease on its sessions, with a deadline: a node that is frozen
or cut off from its routers loses its sessions within a known time, and
gives them up itself first.

Theory of operation. A session's lease is a lock on its `lease` file
(leases.py), held until its holder's process dies. A frozen node (SIGSTOP,
a host stalled) never dies, and a node the routers cannot reach still
holds its locks: its keys were hostage for as long as it lasted. So, with
`--lease-time T`, a node also holds a lease on all its sessions at once,
one small file in the shared data directory:

    DATA/.node-leases/<node>.json   {"node", "deadline", "heard"}: the
                                    wall-clock time until which the node
                                    holds its sessions, and when a router
                                    last reached it

The node renews it (deadline = now + T) every T/RENEWALS seconds while it
hears from a router: routers ping their nodes every second. A node that
heard none for T/2 is cut off if the routers still reach another node (its
file says it heard one within T/2): it stops renewing, so its deadline
passes at most 1.5 T after the last router reached it, or T after it
froze. If the routers reach no node (every router stopped, or being
restarted) nobody is cut off from anyone: every node renews, and no
session is given up for a router's absence.

- The owner fences itself: once its own deadline is less than one renewal
  away (measured on its monotonic clock, so a node that wakes from a freeze
  sees at once that it passed), it gives up every session it holds (the
  lease-lost path: its lock let go, its turns answered `moved`, its worker
  killed with everything under it). A node back in touch renews, and takes
  sessions again as they are asked for.
- Another node may take a session whose lease file names a holder whose
  deadline passed by more than SKEW (clocks of two nodes may differ by
  that much): leases.py breaks the holder's lock (renames the lease file
  away: the lock stays on the old file) and takes the session with a new
  fencing epoch, which a holder that wakes reads within one lease-watch
  pass (lease_watch.py) before anything else it does.

A node's lease is renewed from its start, before any router reached it,
unless the routers already reach another node.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from hermes_sup.local.logfmt import kv

from .leases import log_lost
from .ownership import Ownership
from .session import Session

log = logging.getLogger("hermes_sup.supervisor")

NODE_LEASES = ".node-leases"
RENEWALS = 5  # renewals per lease time
SKEW = 1.0  # seconds of clock difference between two nodes a taker allows for


def lease_path(data_dir: Path, node: str) -> Path:
    """The node lease file of `node` in a shared data directory (the node
    agent's watchdog reads it too: cluster/watchdog.py, `lease_left`)."""
    return data_dir / NODE_LEASES / f"{node}.json"


def read_deadline(data_dir: Path, node: str) -> float | None:
    """The wall-clock deadline `node`'s lease file says, None if none can be read."""
    try:
        data = json.loads(lease_path(data_dir, node).read_bytes())
    except (OSError, ValueError):
        return None
    deadline = data.get("deadline") if isinstance(data, dict) else None
    if isinstance(deadline, bool) or not isinstance(deadline, (int, float)):
        return None
    return float(deadline)


def node_expired(data_dir: Path, node: str, now: float | None = None) -> bool:
    """Whether `node`'s lease ran out (by more than SKEW): its sessions may
    be taken from it. A node with no lease file never runs out."""
    deadline = read_deadline(data_dir, node)
    return deadline is not None and (time.time() if now is None else now) > deadline + SKEW


def write_deadline(data_dir: Path, node: str, deadline: float, heard: float | None = None) -> None:
    """Write the node's lease file whole (a new file renamed into place:
    a reader sees the old deadline or the new)."""
    path = lease_path(data_dir, node)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps({"node": node, "deadline": deadline, "heard": heard}))
    os.replace(tmp, path)


def reached_elsewhere(data_dir: Path, node: str, now: float, within: float) -> list[str]:
    """The other nodes whose lease files say a router reached them in the
    last `within` seconds (wall clock), sorted."""
    try:
        paths = sorted((data_dir / NODE_LEASES).glob("*.json"))
    except OSError:
        return []
    reached = []
    for path in paths:
        try:
            data = json.loads(path.read_bytes())
        except (OSError, ValueError):
            continue
        heard = data.get("heard") if isinstance(data, dict) else None
        other = data.get("node") if isinstance(data, dict) else None
        if other == node or isinstance(heard, bool) or not isinstance(heard, (int, float)):
            continue
        if now - heard <= within:
            reached.append(str(other))
    return reached


class NodeLease:
    """This node's lease: renewed while routers reach it, and the node's
    sessions given up before it runs out."""

    def __init__(
        self,
        data_dir: Path,
        node: str,
        lease_time: float,
        sessions: dict[str, Session],
        ownership: Ownership,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.data_dir = data_dir
        self.node = node
        self.lease_time = lease_time
        self.sessions = sessions
        self.ownership = ownership
        self.clock = clock
        self.wall = wall
        self.every = lease_time / RENEWALS
        self.heard: float | None = None  # when a router last pinged us (monotonic)
        self.deadline: float | None = None  # our own deadline (monotonic)
        self.fenced = False  # we gave our sessions up; until the next renewal

    def heard_from_router(self) -> None:
        """A router reached us (its ping)."""
        self.heard = self.clock()

    def in_touch(self, now: float) -> bool:
        """Whether a router reached us recently (half a lease time)."""
        return self.heard is not None and now - self.heard <= self.lease_time / 2

    def tick(self) -> None:
        """Fence ourselves if our deadline is near, else renew if in touch."""
        now = self.clock()
        if self.deadline is not None and now >= self.deadline - self.every:
            # Within one renewal of running out (or past it: we were
            # frozen): give everything up before another node may take it.
            renewed = now - (self.deadline - self.lease_time)
            self.deadline, self.fenced = None, True
            given = self.give_up_all(
                f"this node's lease was last renewed {renewed:.1f}s ago (no router reached it)"
            )
            log.error(kv("node_lease_expired", node=self.node, sessions_given_up=given))
        wall = self.wall()
        if not self.in_touch(now) and reached_elsewhere(
            self.data_dir, self.node, wall, self.lease_time / 2
        ):
            return  # the routers reach other nodes, not this one: cut off
        heard = None if self.heard is None else wall - (now - self.heard)
        try:
            write_deadline(self.data_dir, self.node, wall + self.lease_time, heard)
        except OSError as exc:
            log.warning(kv("node_lease_unwritten", node=self.node, error=exc.strerror or exc))
            return
        if self.fenced:
            log.info(kv("node_lease_renewed", node=self.node))
        self.deadline, self.fenced = now + self.lease_time, False

    def give_up_all(self, why: str) -> int:
        """Give up every session whose lease we hold, as a lease found lost
        is: its lock let go, its turns answered, its worker killed."""
        given = 0
        for session in list(self.sessions.values()):
            if session.lease is None:
                continue
            log_lost(session.key, why)
            self.ownership.release(session)
            self.ownership.on_lease_lost(session, why)
            given += 1
        return given

    async def run(self) -> None:
        """Tick every renewal interval, until cancelled."""
        while True:
            await asyncio.sleep(self.every)
            try:
                self.tick()
            except Exception:
                log.exception(kv("bug", where="node_lease"))
