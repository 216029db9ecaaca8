"""A kernel control group per session's worker: the supervisor's policy.

Theory of operation
-------------------
At start (`start`) the supervisor finds a hierarchy it may use
(local/cgroupfs.py: a delegated v2 subtree, else v1 as root), makes its
subtree and removes every group a previous run left (killing what is still
in them). Without one, sessions run without cgroups and `describe` says why.

Each worker gets a group named by its routing id (random: never a name a
session chose). For a fork, `make` creates it with the session's limits
before the fork is asked for, and the spawn request names its cgroup.procs
files: the forked child writes "0" to them as its very first act (in the
zygote, worker/zygote.py), so nothing of the session runs outside it, a
first turn handed over in the request included. When the zygote answers
with the pid, `place` checks and moves it if the child could not (a spare
is placed this way when it is given its session, before the spawn request
reaches it).

Limits: memory_limit_mb becomes memory.max (swap 0), max_procs pids.max,
cpu_weight and io_weight the weights. On v2 memory.oom.group makes the
kernel kill the whole group on an OOM kill; v1 has no such switch, so
the supervisor ends the session itself. It does not poll every group's
counters for that (six files a group, twice a second, were three quarters
of an idle supervisor's CPU at 300 live sessions): each group's OOM
notification (an eventfd on memory.oom_control) wakes the loop, and only
a group that was noticed has its counters read by the health tick
(`oom_due`), for a few ticks, since the notice comes as the group runs
out of memory, a moment before the kill. A group whose notice could not
be set up is polled as before. Either way the session's end reason says `oom`.

When the worker is gone (`release`), whatever is left in the group is
killed and the group removed; a group still busy is retried every tick
(`retry`) until it is gone, and at stop every group goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hermes_sup.local import cgroupfs
from hermes_sup.local.cgroupfs import CgroupError, Hierarchy, Limits, Usage
from hermes_sup.local.logfmt import kv

from .config import Settings
from .sealing import SealingUnavailable
from .session import Session

log = logging.getLogger("hermes_sup.supervisor")
MIB = 1024 * 1024
MAX_WEIGHT = 10000
# Seconds the supervisor waits at start and stop for killed processes to
# leave their groups (never while serving: then the tick retries).
SETTLE_PATIENCE = 3.0
# Health ticks (of CGROUP_INTERVAL) a group's OOM counter is read after its
# OOM notice: the kill follows the notice by a moment.
NOTICE_TICKS = 6


def data_dir_tag(data_dir: Path) -> str:
    """What names a data directory's subtree (v1): stable for it, so the
    next supervisor on it finds what a killed one left."""
    return hashlib.sha256(str(data_dir.absolute()).encode()).hexdigest()[:12]


def clear_left_groups(data_dir: Path) -> int:
    """Remove what a supervisor on `data_dir` killed outright (its zygote
    with it) left of its groups, empty ones only, as the next start on it
    would; the number of session groups removed."""
    found = cgroupfs.detect(data_dir_tag(data_dir))
    if isinstance(found, str):
        return 0
    removed = 0
    for name in found.names():
        with contextlib.suppress(CgroupError, OSError):
            removed += found.remove(name)
    found.teardown()
    return removed


def group_name(worker_id: bytes) -> str:
    """A worker's group: its routing id in hex (random, a valid file name)."""
    return "w" + worker_id.hex()


def limits_for(settings: Settings) -> Limits:
    """A session's kernel limits from its (operator's) settings."""
    return Limits(
        memory=settings.memory_limit_mb * MIB if settings.memory_limit_mb else None,
        pids=settings.max_procs or None,
        # The kernel refuses a weight over 10000: taken as the most.
        cpu_weight=min(settings.cpu_weight, MAX_WEIGHT) if settings.cpu_weight else None,
        io_weight=min(settings.io_weight, MAX_WEIGHT) if settings.io_weight else None,
    )


@dataclass
class SessionGroups:
    """The session groups of this supervisor, or why there are none."""

    hierarchy: Hierarchy | None = None
    reason: str | None = "not started"
    asked: str = "auto"
    # Groups whose worker is gone but which were still busy: retried.
    leftover: set[str] = field(default_factory=set)
    # OOM kills already seen per live group (v1: a new one ends the session).
    oom_seen: dict[str, int] = field(default_factory=dict)
    # Ours (and the zygote's) for the OOM killer, once set at start.
    oom_score_adj: int | None = None
    # v1: each live group's OOM notice (an eventfd read by the loop), the
    # groups noticed with the health ticks left to look at them, and the
    # groups without a notice, polled.
    notices: dict[str, int] = field(default_factory=dict)
    noticed: dict[str, int] = field(default_factory=dict)
    unnoticed: set[str] = field(default_factory=set)

    def start(self, settings: Settings) -> None:
        """Find and set up the hierarchy (before the zygote starts, so that
        it runs in the supervisor's leaf), and clear a previous run's groups."""
        self.asked = settings.cgroups
        if settings.cgroups == "off":
            self.hierarchy, self.reason = None, "cgroups = off"
            return
        try:
            found = cgroupfs.detect(data_dir_tag(settings.data_dir))
            if isinstance(found, str):
                raise CgroupError(found)
            found.setup()
        except (CgroupError, OSError) as exc:
            self.hierarchy, self.reason = None, str(exc)
            if settings.cgroups == "on":
                raise SealingUnavailable(f"cgroups = on, but {exc}") from None
            log.warning(kv("cgroups_unavailable", reason=self.reason))
            return
        self.hierarchy, self.reason = found, None
        stale = found.names()
        for name in stale:
            self._remove(name)
        self._settle()
        log.info(
            kv(
                "cgroups",
                version=found.version,
                where=found.where(),
                controllers=",".join(found.controllers),
                stale_removed=len(stale),
            )
        )

    def made_dirs(self) -> tuple[str, ...]:
        """What setup made (for the zygote's clean-up if we are killed)."""
        return tuple(self.hierarchy.made_dirs()) if self.hierarchy is not None else ()

    @property
    def active(self) -> bool:
        return self.hierarchy is not None

    def make(self, worker_id: bytes, settings: Settings) -> list[str]:
        """Make a worker's group; the cgroup.procs files its child enters
        itself by ([] without cgroups, or if the group could not be made:
        then the worker runs without one, and the log says why)."""
        h = self.hierarchy
        if h is None:
            return []
        name = group_name(worker_id)
        try:
            h.make(name, limits_for(settings))
        except CgroupError as exc:
            log.error(kv("cgroup_failed", group=name, error=exc))
            return []
        self.oom_seen[name] = 0
        if not h.oom_group:
            self._arm(name)
        return h.procs_files(name)

    def _arm(self, name: str) -> None:
        """Have the group's OOM notice wake the loop (v1)."""
        assert self.hierarchy is not None
        # A spare's group is made again when the spare is given a session:
        # its first notice is closed, not left open beside the new one.
        self._disarm(name)
        notice = self.hierarchy.oom_notice(name)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if notice is None or loop is None:
            if notice is not None:
                os.close(notice)
            self.unnoticed.add(name)
            return
        loop.add_reader(notice, self._on_notice, name, notice)
        self.notices[name] = notice

    def _on_notice(self, name: str, notice: int) -> None:
        try:
            os.eventfd_read(notice)
        except OSError:
            pass  # already read: the notice stands all the same
        self.noticed[name] = NOTICE_TICKS

    def _disarm(self, name: str) -> None:
        notice = self.notices.pop(name, None)
        if notice is not None:
            with contextlib.suppress(RuntimeError):
                asyncio.get_running_loop().remove_reader(notice)
            os.close(notice)
        self.noticed.pop(name, None)
        self.unnoticed.discard(name)

    def holds(self, worker_id: bytes | None) -> bool:
        """Whether the worker is in a group of its own (its limits then held
        by the kernel)."""
        return (
            self.hierarchy is not None
            and worker_id is not None
            and group_name(worker_id) in self.oom_seen
        )

    def oom_watch_needed(self) -> bool:
        """Whether any group is due a look at its OOM counter (v1)."""
        return bool(self.noticed or self.unnoticed)

    def oom_due(self, worker_id: bytes) -> bool:
        """Whether the worker's group is due a look at its OOM counter now:
        noticed within the last NOTICE_TICKS looks, or without a notice."""
        name = group_name(worker_id)
        if name in self.unnoticed:
            return True
        left = self.noticed.get(name)
        if left is None:
            return False
        if left <= 1:
            del self.noticed[name]
        else:
            self.noticed[name] = left - 1
        return True

    def place(self, worker_id: bytes, pid: int) -> None:
        """Make sure the worker `pid` is in its group (a spare: moved now)."""
        h = self.hierarchy
        name = group_name(worker_id)
        if h is None or name not in self.oom_seen:
            return
        try:
            h.place(name, pid)
        except (CgroupError, OSError) as exc:
            log.error(kv("cgroup_place_failed", group=name, pid=pid, error=exc))

    def usage(self, worker_id: bytes | None) -> Usage | None:
        """What the kernel counts for a worker's group now (None: none)."""
        h = self.hierarchy
        if h is None or worker_id is None:
            return None
        name = group_name(worker_id)
        if name not in self.oom_seen:
            return None
        try:
            return h.usage(name)
        except (OSError, ValueError):
            return None

    def usage_dict(self, worker_id: bytes | None) -> dict[str, int | None] | None:
        """`usage` as list, inspect and metrics show it."""
        use = self.usage(worker_id)
        return use.to_dict() if use is not None else None

    def usage_by_key(self, sessions: list[Session]) -> dict[str, dict[str, int | None]]:
        """Each session's cgroup usage by key, for metrics (those that have one)."""
        found = {}
        for session in sessions:
            use = self.usage_dict(session.worker_id)
            if use is not None:
                found[session.key] = use
        return found

    def oom_killed(self, worker_id: bytes) -> Usage | None:
        """The group's usage if the kernel OOM-killed a process in it since
        the last look (v1: the supervisor then ends the session), else None."""
        use = self.usage(worker_id)
        if use is None:
            return None
        name = group_name(worker_id)
        if use.oom_kills > self.oom_seen.get(name, 0):
            self.oom_seen[name] = use.oom_kills
            return use
        return None

    def end_reason(self, worker_id: bytes | None) -> str | None:
        """Why the kernel ended the worker, if it did: `oom` (an OOM kill in
        its group) or `pids` (forks refused at pids.max), else None."""
        use = self.usage(worker_id)
        if use is None:
            return None
        if use.oom_kills:
            limit = f"{use.memory_max // MIB} MiB" if use.memory_max else "the host's memory"
            return f"was ended by the kernel: oom (out of memory at its memory limit of {limit})"
        if use.pids_max_hits:
            return (
                f"was ended after the kernel refused it processes: pids (at its limit of "
                f"{use.pids_max}, {use.pids_max_hits} forks refused)"
            )
        return None

    def release(self, worker_id: bytes | None) -> None:
        """The worker is gone: kill what is left in its group and remove it
        (retried from `retry` while it is busy)."""
        if self.hierarchy is None or worker_id is None:
            return
        name = group_name(worker_id)
        self._disarm(name)
        if self.oom_seen.pop(name, None) is None:
            return
        self._remove(name)

    def _remove(self, name: str) -> None:
        h = self.hierarchy
        assert h is not None
        try:
            h.kill_all(name)
            if h.remove(name):
                self.leftover.discard(name)
                return
        except (CgroupError, OSError) as exc:
            log.warning(kv("cgroup_remove_failed", group=name, error=exc))
        self.leftover.add(name)

    def _settle(self) -> None:
        """At start and stop only (it sleeps): wait a little for processes
        just killed to leave their groups (a spare killed at shutdown, a
        sealed worker's namespace being torn down), removing them as they go."""
        deadline = time.monotonic() + SETTLE_PATIENCE
        while self.leftover and time.monotonic() < deadline:
            time.sleep(0.02)
            self.retry()

    def retry(self) -> None:
        """Remove the groups that were still busy (from the tick)."""
        for name in list(self.leftover):
            self._remove(name)

    def stop(self) -> None:
        """The supervisor stops: every group goes, then its subtree."""
        h = self.hierarchy
        if h is None:
            return
        self.oom_seen.clear()
        for name in list(self.notices):
            self._disarm(name)
        for name in h.names():
            self._remove(name)
        self._settle()
        if self.leftover:
            log.warning(kv("cgroups_left", groups=",".join(sorted(self.leftover))))
        h.teardown()

    def describe(self) -> dict[str, Any]:
        """For status and logs: whether sessions get a cgroup, and how."""
        h = self.hierarchy
        return {
            "active": h is not None,
            "asked": self.asked,
            "version": h.version if h is not None else None,
            "where": h.where() if h is not None else None,
            "controllers": list(h.controllers) if h is not None else [],
            "oom_group": h.oom_group if h is not None else False,
            "reason": self.reason,
            # Workers are the OOM killer's first choice, we its last.
            "oom_score_adj": {
                "supervisor": self.oom_score_adj,
                "workers": cgroupfs.WORKER_OOM_SCORE_ADJ,
            },
        }


def lower_oom_score(groups: SessionGroups) -> None:
    """The supervisor (and the zygote it starts) low for the OOM killer, as
    root with CAP_SYS_RESOURCE; logged either way, and kept for `status`."""
    groups.oom_score_adj = cgroupfs.lower_oom_score()
    log.info(
        kv(
            "oom_score_adj",
            supervisor=groups.oom_score_adj,
            workers=cgroupfs.WORKER_OOM_SCORE_ADJ,
        )
    )


def amend_limits(
    limits: dict[str, str], settings: Settings, groups: SessionGroups
) -> dict[str, str]:
    """`describe_limits` (sealing.py) as it is with cgroups in force: memory
    and processes bounded by the kernel per session, and the weights."""
    h = groups.hierarchy
    if h is None:
        return limits  # as sealing says; `status` says why there are no cgroups
    where = f"kernel (cgroup {h.version})"
    if settings.memory_limit_mb:
        limits["memory"] = (
            f"{settings.memory_limit_mb} MiB, {where} memory.max incl. shm, tmpfs and memfd"
            + (
                "; OOM kill ends the session whole"
                if h.oom_group
                else "; OOM kill ends the session"
            )
        )
    if settings.max_procs:
        limits["processes"] = f"{settings.max_procs}, {where} pids.max (threads count)"
    if "cpu" in h.controllers:
        limits["cpu_weight"] = str(settings.cpu_weight or "default")
    if "io" in h.controllers or "blkio" in h.controllers:
        limits["io_weight"] = str(settings.io_weight or "default")
    return limits
