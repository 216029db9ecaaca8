"""Disk: the supervisor's reserve for its own state, and each session's
bound on what it writes.

Theory of operation
-------------------
Sessions write into the same file system as the supervisor's own state (the
turn journal, session records, logs), so one session filling it could stop
the supervisor from recording the turns of all the others. Two guards:

- The reserve (`disk_reserve_mb`). While the free space of the data or
  state directory's file system is below it, new turns are refused with
  `disk_full` (their ids stay unspent: a retry is safe), so what the
  supervisor must write for the turns already running, and for their ends,
  still fits. It is read with one statvfs per `send` (a microsecond or two);
  the change either way is logged once and shown in `status`.
- The per-session bound (`disk_limit_mb`, over workspace, home and tmp).
  Where the kernel can enforce it (project quotas) that is said at start;
  elsewhere a sampler adds up `st_blocks` over each live session's
  directory a slice at a time (at most WALK_ENTRIES entries per tick, so
  the main loop never stalls on a tree of a million files) and stops a
  session found over its bound with the reason `disk`. A session that has
  been idle, with no process of its own, since its last walk has had
  nothing of its own to write with but its worker: it is walked again
  when it is next active, and otherwise only every SETTLED_ROUNDS rounds
  (a worker a hostile session made write on its own while idle is still
  caught, a minute later rather than seconds), so an idle supervisor's
  rounds follow the active sessions, not the live ones.
"""

from __future__ import annotations

import logging
import os
import stat
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from hermes_sup.local.logfmt import kv

log = logging.getLogger("hermes_sup.supervisor")

MIB = 1024 * 1024
# Directory entries the sampler looks at per tick (each an lstat): a few
# milliseconds at most (about 3 ms measured), however large a session's tree.
WALK_ENTRIES = 1000
# Rounds a session idle and alone since its last walk is skipped for.
SETTLED_ROUNDS = 12


def free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged writer may still use on `path`'s file system
    (None if it cannot be read)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


class DiskReserve:
    """Whether new turns may start: free space on the data and state
    directories' file systems against the reserve."""

    def __init__(self, paths: Callable[[], tuple[Path, ...]], reserve_mb: Callable[[], int]):
        self.paths = paths
        self.reserve_mb = reserve_mb
        self.low: bool = False  # as of the last check: logged on each change
        self.free: int | None = None  # the smallest free space seen then, bytes

    def shortfall(self) -> str | None:
        """None while there is room; else a sentence saying where space is
        short. Logs each change between the two."""
        reserve = self.reserve_mb() * MIB
        if reserve <= 0:
            return None
        least: int | None = None
        where: Path | None = None
        for path in self.paths():
            free = free_bytes(path)
            if free is not None and (least is None or free < least):
                least, where = free, path
        self.free = least
        low = least is not None and least < reserve
        if low != self.low:
            self.low = low
            if low:
                log.warning(
                    kv(
                        "disk_reserve_low",
                        path=where,
                        free_mb=f"{(least or 0) / MIB:.1f}",
                        reserve_mb=reserve // MIB,
                        new_turns="refused",
                    )
                )
            else:
                log.warning(kv("disk_reserve_ok", free_mb=f"{(least or 0) / MIB:.1f}"))
        if not low:
            return None
        return (
            f"the data disk is nearly full ({(least or 0) / MIB:.1f} MiB free on {where}, "
            f"below the supervisor's reserve of {reserve // MIB} MiB for its own state); "
            "the turn was not run, and sending it again (same id) once there is room runs it once"
        )

    def describe(self) -> dict[str, object]:
        """For `status`: the reserve, the free space last seen, and whether
        new turns are refused."""
        self.shortfall()
        return {
            "reserve_mb": self.reserve_mb(),
            "free_mb": None if self.free is None else round(self.free / MIB, 1),
            "refusing_turns": self.low,
        }


@dataclass
class Walk:
    """One session's directories being added up, a slice per tick."""

    roots: tuple[Path, ...]
    pending: deque[Path] = field(default_factory=deque)
    # The directory being read (kept open across ticks: one with a million
    # entries is read a slice at a time too) and its file system.
    current: Iterator[os.DirEntry[str]] | None = None
    device: int = 0
    total: int = 0  # bytes (st_blocks * 512) so far this round
    seen: set[tuple[int, int]] = field(default_factory=set)  # hard links count once

    def start(self) -> None:
        self.close()
        self.pending = deque(self.roots)
        self.total = 0
        self.seen = set()

    def close(self) -> None:
        if self.current is not None:
            self.current.close()  # type: ignore[attr-defined]
            self.current = None


def walk_some(walk: Walk, budget: int) -> tuple[int, bool]:
    """Look at up to `budget` entries of `walk`; the entries looked at, and
    whether the walk is complete. Never follows a symbolic link nor leaves
    the file system a directory is on (a mount a session made is not ours
    to count, nor a link planted to make us count the host)."""
    looked = 0
    while looked < budget:
        if walk.current is None:
            if not walk.pending:
                return looked, True
            folder = walk.pending.popleft()
            try:
                walk.device = os.lstat(folder).st_dev
                walk.current = os.scandir(folder)
            except OSError:
                continue  # gone meanwhile, or not readable: not counted
        entry = next(walk.current, None)
        if entry is None:
            walk.close()
            continue
        looked += 1
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if st.st_dev != walk.device:
            continue
        if stat.S_ISDIR(st.st_mode):
            walk.pending.append(Path(entry.path))
        elif st.st_nlink > 1:
            ident = (st.st_dev, st.st_ino)
            if ident in walk.seen:
                continue
            walk.seen.add(ident)
        walk.total += st.st_blocks * 512
    return looked, walk.current is None and not walk.pending


def quota_support(path: Path) -> tuple[str | None, str]:
    """Whether the kernel could bound a session's disk use on `path`'s file
    system (project quotas), and why or why not, from its mount options."""
    best: tuple[str, str, str] | None = None  # mount point, type, options
    target = str(path.resolve())
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if " - " not in line or len(fields) < 6:
                    continue
                point = fields[4].replace("\\040", " ")
                tail = line.split(" - ", 1)[1].split()
                under = target == point or target.startswith(point.rstrip("/") + "/")
                if under and (best is None or len(point) >= len(best[0])):
                    best = (point, tail[0], fields[5] + "," + (tail[2] if len(tail) > 2 else ""))
    except OSError as exc:
        return None, f"mounts unreadable ({exc.strerror})"
    if best is None:
        return None, "its mount was not found"
    point, fstype, options = best
    flags = set(options.split(","))
    if fstype in ("ext4", "xfs") and flags & {"prjquota", "pquota", "prjquota=on"}:
        return fstype, f"{fstype} on {point} is mounted with project quotas"
    return None, f"{fstype} on {point} is not mounted with project quotas (prjquota)"


class DiskSampler:
    """Each live session's bytes on disk (workspace, home, HOME and tmp),
    added up a slice per tick; a session over `disk_limit_mb` is stopped
    with the reason `disk`."""

    def __init__(
        self,
        limit_mb: Callable[[object], int | None],
        interval: Callable[[], float],
        stop: Callable[[object, str], None],
        enabled: Callable[[], bool] = lambda: True,
        idle_since: Callable[[object], float | None] = lambda session: None,
        quiet: Callable[[object], bool] = lambda session: False,
    ) -> None:
        self.limit_mb = limit_mb  # the session's limit (its settings'), None: off
        self.enabled = enabled  # whether rounds run at all (the operator's setting)
        self.interval = interval
        self.stop = stop
        # When an idle session last had activity (None: it is not idle), and
        # whether it has no process of its own now (reads /proc: asked once
        # a walk, at its end). A session walked while quiet is `settled` at
        # that activity time, with the rounds it is skipped for while it
        # stays idle since.
        self.idle_since = idle_since
        self.quiet = quiet
        self.settled: dict[str, tuple[float, int]] = {}
        # The round under way: the keys still to add up, the first being
        # walked (its Walk kept across ticks), and when the next begins.
        self.round: deque[str] = deque()
        self.walk: Walk | None = None
        self.next_round = 0.0
        self.mode = "sampler"
        self.reason = ""

    def describe(self) -> dict[str, object]:
        """For `status`: what enforces the per-session bound, and why."""
        return {"enforced_by": self.mode, "why": self.reason}

    def tick(self, now: float, sessions: dict[str, object]) -> None:
        """Look at up to WALK_ENTRIES entries of the round under way, one
        session after another; a session's walk finished compares its total
        with its limit. A round takes the live sessions once per interval,
        so a tick costs the same however many sessions are live."""
        if not self.round:
            if now < self.next_round or not self.enabled():
                return
            self.next_round = now + self.interval()
            self.round.extend(sessions)
        budget = WALK_ENTRIES
        while self.round and budget > 0:
            key = self.round[0]
            session = sessions.get(key)
            limit = self.limit_mb(session) if session is not None else None
            if session is None or not limit:
                self.settled.pop(key, None)
                self._next_session()  # gone since the round began, or unbounded
                continue
            since = self.idle_since(session)
            settled = self.settled.get(key)
            if since is not None and settled is not None and settled[0] == since:
                if settled[1] > 1:
                    self.settled[key] = (since, settled[1] - 1)
                    self._next_session()  # idle and alone since its last walk
                    continue
                del self.settled[key]  # walked again now, all the same
            if self.walk is None:
                self.walk = Walk(
                    tuple(getattr(session, name) for name in ("workspace", "home", "user", "tmp"))
                )
                self.walk.start()
            looked, done = walk_some(self.walk, budget)
            budget -= looked
            if not done:
                continue
            total = self.walk.total
            self._next_session()
            session.disk_used = total  # type: ignore[attr-defined]
            if since is not None and self.idle_since(session) == since and self.quiet(session):
                self.settled[key] = (since, SETTLED_ROUNDS)
            else:
                self.settled.pop(key, None)
            if total > limit * MIB:
                self.stop(
                    session,
                    f"went over its disk limit ({total / MIB:.0f} MiB in its "
                    f"workspace, home and tmp > {limit} MiB) and was stopped (reason: disk)",
                )

    def _next_session(self) -> None:
        self.round.popleft()
        if self.walk is not None:
            self.walk.close()
            self.walk = None
