"""One small interface over the kernel's cgroups, v2 and v1.

The supervisor gives every session's worker a control group of its own
(supervisor/cgroups.py decides what goes in it); this module only speaks to
the kernel. `detect()` finds what this process may use and returns a
`Hierarchy`, or the reason there is none:

- v2: a delegated subtree. The supervisor's own cgroup (from /proc/self/cgroup,
  "0::/...") is the unit; where systemd started us in `<unit>/supervisor`
  (DelegateSubgroup=supervisor) the unit is its parent. A cgroup with
  processes cannot enable controllers for its children (the "no internal
  process" rule), so `setup()` moves every process of the unit into the leaf
  `<unit>/supervisor`, then enables the controllers in `<unit>` and in
  `<unit>/sessions`, under which each group is made.
- v1 (root only: systemd does not delegate v1 to anyone else): the same
  layout mirrored in the memory, pids, cpu (and blkio, where it has a weight)
  hierarchies, under `<our cgroup>/hermes-sup-<tag>`; the tag is stable per
  data directory, so a restart finds the groups its predecessor left.

Every path comes from the kernel's own tables, and group names are made by
the caller from random routing ids: nothing a session sends names a path.
The file operations go through `Files`, so tests can run the v2 code against
a faithful fake tree; the standard library only (the zygote imports nothing
of this, the supervisor does).
"""

from __future__ import annotations

import errno
import os
import signal
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

# Controllers a v2 session group gets, in the order they are enabled; memory
# and pids are required, cpu and io are used where the kernel offers them.
V2_CONTROLLERS = ("memory", "pids", "cpu", "io")
REQUIRED = ("memory", "pids")
# v1 hierarchies mirrored; cpu and blkio where mounted (and, for blkio, where
# it has a weight: only the CFQ/BFQ schedulers give it one).
V1_CONTROLLERS = ("memory", "pids", "cpu", "blkio")
SESSIONS = "sessions"
LEAF = "supervisor"
# How many rounds of SIGKILL over a v1 group's processes before giving up on
# emptying it now (a fork bomb at pids.max refills it while it is killed).
KILL_ROUNDS = 50


class CgroupError(Exception):
    """A cgroup could not be made, limited or entered; the message says which file."""


@dataclass(frozen=True)
class Limits:
    """A session group's limits; None is no limit. Weights use the v2 scale
    (1 - 10000, 100 is the default) and are mapped for v1."""

    memory: int | None = None
    pids: int | None = None
    cpu_weight: int | None = None
    io_weight: int | None = None


@dataclass(frozen=True)
class Usage:
    """What the kernel counts for a group: bytes and tasks in use against
    their limits (None: unlimited or not known), OOM kills and refused forks."""

    memory: int | None
    memory_max: int | None
    pids: int | None
    pids_max: int | None
    oom_kills: int
    pids_max_hits: int

    def to_dict(self) -> dict[str, int | None]:
        return {
            "memory": self.memory,
            "memory_max": self.memory_max,
            "pids": self.pids,
            "pids_max": self.pids_max,
            "oom_kills": self.oom_kills,
            "pids_max_hits": self.pids_max_hits,
        }


class Files:
    """The file operations a hierarchy needs: the real kernel files here, a
    fake tree in tests (with the kernel's semantics for those files)."""

    def read(self, path: Path) -> str:
        with open(path) as f:
            return f.read()

    def write(self, path: Path, text: str) -> None:
        # One write(2) per value: cgroup files take a value per write.
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)

    def mkdir(self, path: Path) -> None:
        try:
            os.mkdir(path)
        except FileExistsError:
            pass

    def rmdir(self, path: Path) -> None:
        os.rmdir(path)

    def exists(self, path: Path) -> bool:
        return os.path.exists(path)

    def children(self, path: Path) -> list[str]:
        try:
            return sorted(e.name for e in os.scandir(path) if e.is_dir(follow_symlinks=False))
        except FileNotFoundError:
            return []

    def writable(self, path: Path) -> bool:
        return os.access(path, os.W_OK)


def _int(text: str) -> int | None:
    text = text.strip()
    return None if text in ("max", "") else int(text)


def _keyed(text: str, key: str) -> int:
    """The value of `key` in a flat keyed file ("oom_kill 3" lines)."""
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0


class Hierarchy(ABC):
    """Session groups in one cgroup hierarchy (v2) or mirrored in several (v1)."""

    version: str
    # Whether the kernel kills a group whole on an OOM kill (v2's
    # memory.oom.group); without it the supervisor ends the session.
    oom_group: bool
    controllers: tuple[str, ...]

    def __init__(self, files: Files) -> None:
        self.files = files

    @abstractmethod
    def where(self) -> str:
        """Where the session groups are made, for `status`."""

    @abstractmethod
    def setup(self) -> None:
        """Make the subtree the session groups go in (idempotent)."""

    @abstractmethod
    def names(self) -> list[str]:
        """The session groups that exist (a previous run's too)."""

    @abstractmethod
    def make(self, name: str, limits: Limits) -> None:
        """Make the group `name` with `limits` (an existing one is reused)."""

    @abstractmethod
    def procs_files(self, name: str) -> list[str]:
        """The cgroup.procs files a process writes "0" to, to enter the group."""

    @abstractmethod
    def contains(self, name: str, pid: int) -> bool:
        """Whether `pid` is in the group (in every mirrored hierarchy)."""

    def place(self, name: str, pid: int) -> None:
        """Move `pid` (a whole process) into the group, where it is not already."""
        if self.contains(name, pid):
            return  # it entered itself: a migration is not free
        for path in self.procs_files(name):
            try:
                self.files.write(Path(path), str(pid))
            except OSError as exc:
                if exc.errno == errno.ESRCH:
                    return  # gone already: nothing to place
                raise CgroupError(f"cannot move pid {pid} into {path}: {exc.strerror}") from None

    @abstractmethod
    def usage(self, name: str) -> Usage:
        """What the kernel counts for the group now."""

    def oom_notice(self, name: str) -> int | None:
        """A descriptor that becomes readable when the group runs out of
        memory, for a hierarchy whose OOM kills the supervisor must act on
        itself (v1); None where the kernel acts alone, or none can be made."""
        return None

    @abstractmethod
    def pids(self, name: str) -> list[int]:
        """The processes in the group."""

    def kill_all(self, name: str) -> None:
        """SIGKILL every process in the group, until it is empty or a bounded
        number of rounds has passed (the caller retries the removal later)."""
        for _ in range(KILL_ROUNDS):
            pids = self.pids(name)
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    @abstractmethod
    def remove(self, name: str) -> bool:
        """Remove the group; False while processes are still in it."""

    @abstractmethod
    def teardown(self) -> None:
        """Remove what setup made, where it is empty (the supervisor stops)."""

    @abstractmethod
    def made_dirs(self) -> list[str]:
        """The directories setup made, deepest first: the session groups are
        their children (for the zygote's clean-up after a supervisor that
        was killed, see remove_empty)."""


class V2(Hierarchy):
    """A delegated cgroup v2 subtree: `<unit>/supervisor` holds the supervisor
    (and its zygote), `<unit>/sessions/<name>` one session's worker each."""

    version = "v2"
    oom_group = True

    def __init__(self, unit: Path, files: Files | None = None) -> None:
        super().__init__(files or Files())
        self.unit = unit
        self.sessions = unit / SESSIONS
        available = self.files.read(unit / "cgroup.controllers").split()
        self.controllers = tuple(c for c in V2_CONTROLLERS if c in available)

    def where(self) -> str:
        return str(self.sessions)

    def setup(self) -> None:
        f, unit = self.files, self.unit
        f.mkdir(unit / LEAF)
        # The no-internal-process rule: every process of the unit (us, the
        # zygote if there is one) into the leaf, before any controller is
        # enabled for the unit's children. A process may exit meanwhile.
        for _ in range(10):
            pids = f.read(unit / "cgroup.procs").split()
            if not pids:
                break
            for pid in pids:
                try:
                    f.write(unit / LEAF / "cgroup.procs", pid)
                except OSError as exc:
                    if exc.errno != errno.ESRCH:
                        raise CgroupError(
                            f"cannot move pid {pid} into {unit / LEAF}: {exc.strerror}"
                        ) from None
        enable = " ".join(f"+{c}" for c in self.controllers)
        try:
            f.write(unit / "cgroup.subtree_control", enable)
            f.mkdir(self.sessions)
            f.write(self.sessions / "cgroup.subtree_control", enable)
        except OSError as exc:
            raise CgroupError(f"cannot enable {enable} under {unit}: {exc.strerror}") from None

    def names(self) -> list[str]:
        return self.files.children(self.sessions)

    def make(self, name: str, limits: Limits) -> None:
        f, group = self.files, self.sessions / name
        values: list[tuple[str, str]] = [("memory.oom.group", "1")]
        if limits.memory is not None:
            # Swap would let a session go past its memory: none.
            values += [("memory.max", str(limits.memory)), ("memory.swap.max", "0")]
        if limits.pids is not None:
            values.append(("pids.max", str(limits.pids)))
        if limits.cpu_weight is not None and "cpu" in self.controllers:
            values.append(("cpu.weight", str(limits.cpu_weight)))
        if limits.io_weight is not None and "io" in self.controllers:
            values.append(("io.weight", f"default {limits.io_weight}"))
        try:
            f.mkdir(group)
            for file, value in values:
                if file == "memory.swap.max" and not f.exists(group / file):
                    continue  # a kernel built without swap accounting
                f.write(group / file, value)
        except OSError as exc:
            raise CgroupError(f"cannot make {group}: {exc.strerror}") from None

    def procs_files(self, name: str) -> list[str]:
        return [str(self.sessions / name / "cgroup.procs")]

    def contains(self, name: str, pid: int) -> bool:
        return str(pid) in self.files.read(self.sessions / name / "cgroup.procs").split()

    def pids(self, name: str) -> list[int]:
        # Every process of the group's subtree (a session may not make
        # children, but a fake or a future layout might).
        found: list[int] = []
        stack = [self.sessions / name]
        while stack:
            group = stack.pop()
            try:
                found += [int(p) for p in self.files.read(group / "cgroup.procs").split()]
            except FileNotFoundError:
                continue
            stack += [group / c for c in self.files.children(group)]
        return found

    def usage(self, name: str) -> Usage:
        f, group = self.files, self.sessions / name
        events = f.read(group / "memory.events")
        return Usage(
            memory=_int(f.read(group / "memory.current")),
            memory_max=_int(f.read(group / "memory.max")),
            pids=_int(f.read(group / "pids.current")),
            pids_max=_int(f.read(group / "pids.max")),
            oom_kills=_keyed(events, "oom_kill"),
            pids_max_hits=_keyed(f.read(group / "pids.events"), "max"),
        )

    def kill_all(self, name: str) -> None:
        kill = self.sessions / name / "cgroup.kill"
        if self.files.exists(kill):
            # Linux 5.14+: the kernel kills the whole subtree, forks racing it included.
            try:
                self.files.write(kill, "1")
                return
            except FileNotFoundError:
                return
        super().kill_all(name)

    def remove(self, name: str) -> bool:
        try:
            self.files.rmdir(self.sessions / name)
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno == errno.EBUSY:
                return False
            raise CgroupError(f"cannot remove {self.sessions / name}: {exc.strerror}") from None
        return True

    def teardown(self) -> None:
        try:
            self.files.rmdir(self.sessions)
        except OSError:
            pass  # a group still there (the caller said so); never the leaf we run in

    def made_dirs(self) -> list[str]:
        return [str(self.sessions)]


class V1(Hierarchy):
    """cgroup v1 (root only): each session group mirrored in one directory
    per controller hierarchy, `<base>/sessions/<name>`."""

    version = "v1"
    oom_group = False

    def __init__(self, bases: dict[str, Path], files: Files | None = None) -> None:
        super().__init__(files or Files())
        self.bases = bases
        self.controllers = tuple(bases)

    def where(self) -> str:
        return ", ".join(str(b / SESSIONS) for b in self.bases.values())

    def _group(self, controller: str, name: str) -> Path:
        return self.bases[controller] / SESSIONS / name

    def setup(self) -> None:
        for base in self.bases.values():
            try:
                self.files.mkdir(base)
                self.files.mkdir(base / SESSIONS)
            except OSError as exc:
                raise CgroupError(f"cannot make {base / SESSIONS}: {exc.strerror}") from None

    def names(self) -> list[str]:
        found: set[str] = set()
        for base in self.bases.values():
            found.update(self.files.children(base / SESSIONS))
        return sorted(found)

    def make(self, name: str, limits: Limits) -> None:
        values: list[tuple[str, str, str]] = []
        if limits.memory is not None:
            values.append(("memory", "memory.limit_in_bytes", str(limits.memory)))
            # With swap accounting, memory+swap capped at the same: no swap.
            values.append(("memory", "memory.memsw.limit_in_bytes", str(limits.memory)))
        if limits.pids is not None:
            values.append(("pids", "pids.max", str(limits.pids)))
        if limits.cpu_weight is not None and "cpu" in self.bases:
            # v2 weight 100 is v1's 1024 shares.
            shares = max(2, limits.cpu_weight * 1024 // 100)
            values.append(("cpu", "cpu.shares", str(shares)))
        if limits.io_weight is not None and "blkio" in self.bases:
            values.append(("blkio", "blkio.weight", str(min(1000, max(10, limits.io_weight)))))
        try:
            for controller in self.bases:
                self.files.mkdir(self._group(controller, name))
            for controller, file, value in values:
                path = self._group(controller, name) / file
                if file == "memory.memsw.limit_in_bytes" and not self.files.exists(path):
                    continue  # no swap accounting in this kernel
                self.files.write(path, value)
        except OSError as exc:
            raise CgroupError(f"cannot make session group {name}: {exc.strerror}") from None

    def procs_files(self, name: str) -> list[str]:
        return [str(self._group(c, name) / "cgroup.procs") for c in self.bases]

    def contains(self, name: str, pid: int) -> bool:
        try:
            text = self.files.read(Path(f"/proc/{pid}/cgroup"))
        except OSError:
            return False
        mine = {c: str(self._group(c, name)) for c in self.bases}
        found = 0
        for line in text.splitlines():
            _, names, path = line.split(":", 2)
            for controller in names.split(","):
                if controller in mine and mine[controller].endswith(path) and path != "/":
                    found += 1
        return found == len(mine)

    def pids(self, name: str) -> list[int]:
        # The pids hierarchy holds every process of the group (each is
        # placed in all of them; pids is required).
        try:
            text = self.files.read(self._group("pids", name) / "cgroup.procs")
        except FileNotFoundError:
            return []
        return [int(p) for p in text.split()]

    def usage(self, name: str) -> Usage:
        f = self.files
        mem, pids = self._group("memory", name), self._group("pids", name)
        limit = int(f.read(mem / "memory.limit_in_bytes"))
        return Usage(
            memory=int(f.read(mem / "memory.usage_in_bytes")),
            # v1 says "no limit" as a page-rounded LONG_MAX.
            memory_max=None if limit >= 1 << 62 else limit,
            pids=_int(f.read(pids / "pids.current")),
            pids_max=_int(f.read(pids / "pids.max")),
            oom_kills=_keyed(f.read(mem / "memory.oom_control"), "oom_kill"),
            pids_max_hits=_keyed(f.read(pids / "pids.events"), "max"),
        )

    def oom_notice(self, name: str) -> int | None:
        # v1's OOM notification: an eventfd registered on the group's
        # memory.oom_control through cgroup.event_control. The kernel keeps
        # the eventfd, not the oom_control descriptor, which is closed here.
        if "memory" not in self.bases:
            return None
        mem = self._group("memory", name)
        notice = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        try:
            control = os.open(mem / "memory.oom_control", os.O_RDONLY | os.O_CLOEXEC)
            try:
                self.files.write(mem / "cgroup.event_control", f"{notice} {control}")
            finally:
                os.close(control)
        except OSError:
            os.close(notice)
            return None
        return notice

    def remove(self, name: str) -> bool:
        gone = True
        for controller in self.bases:
            try:
                self.files.rmdir(self._group(controller, name))
            except FileNotFoundError:
                continue
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    raise CgroupError(
                        f"cannot remove {self._group(controller, name)}: {exc.strerror}"
                    ) from None
                gone = False
        return gone

    def teardown(self) -> None:
        for base in self.bases.values():
            for path in (base / SESSIONS, base):
                try:
                    self.files.rmdir(path)
                except OSError:
                    break  # a group still there: leave the rest

    def made_dirs(self) -> list[str]:
        return [str(d) for base in self.bases.values() for d in (base / SESSIONS, base)]


@dataclass(frozen=True)
class Mounts:
    """Where the hierarchies are mounted: the v2 mount point, and each v1
    controller's."""

    v2: Path | None
    v1: dict[str, Path]


def read_mounts(mountinfo: str) -> Mounts:
    """The cgroup mounts in a /proc/self/mountinfo text."""
    v2: Path | None = None
    v1: dict[str, Path] = {}
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        if len(fields) < sep + 4 or fields[3] != "/":
            continue  # a bind mount of a subtree: not a whole hierarchy
        fstype, options = fields[sep + 1], fields[sep + 3].split(",")
        point = Path(fields[4].replace("\\040", " "))
        if fstype == "cgroup2":
            v2 = v2 or point
        elif fstype == "cgroup":
            for controller in options:
                v1.setdefault(controller, point)
    return Mounts(v2, v1)


def read_own(proc_cgroup: str) -> tuple[str | None, dict[str, str]]:
    """Our v2 path ("0::/...") and each v1 controller's, from /proc/self/cgroup."""
    v2: str | None = None
    v1: dict[str, str] = {}
    for line in proc_cgroup.splitlines():
        num, names, path = line.split(":", 2)
        if num == "0" and names == "":
            v2 = path
        else:
            for controller in names.split(","):
                v1[controller] = path
    return v2, v1


def detect_v2(mounts: Mounts, own: str | None, files: Files) -> V2 | str:
    """A delegated v2 subtree we may use, or why not."""
    if mounts.v2 is None or own is None:
        return "no cgroup v2 hierarchy"
    if own == "/":
        return "the supervisor runs in the v2 root cgroup (start it as a unit with Delegate=yes)"
    here = mounts.v2 / own.lstrip("/")
    # Started by systemd in <unit>/supervisor (DelegateSubgroup=supervisor).
    unit = here.parent if here.name == LEAF else here
    try:
        available = files.read(unit / "cgroup.controllers").split()
    except OSError as exc:
        return f"cannot read {unit / 'cgroup.controllers'}: {exc.strerror}"
    missing = [c for c in REQUIRED if c not in available]
    if missing:
        return f"controllers {' '.join(missing)} not delegated to {unit}"
    for file in ("cgroup.procs", "cgroup.subtree_control"):
        if not files.writable(unit / file):
            return f"{unit / file} is not writable (not delegated: Delegate=yes)"
    return V2(unit, files)


def detect_v1(mounts: Mounts, own: dict[str, str], tag: str, files: Files) -> V1 | str:
    """v1 groups under our own cgroups (root only), or why not."""
    if os.geteuid() != 0:
        return "cgroup v1 is never delegated to an unprivileged user"
    bases: dict[str, Path] = {}
    for controller in V1_CONTROLLERS:
        point, path = mounts.v1.get(controller), own.get(controller)
        if point is None or path is None:
            if controller in REQUIRED:
                return f"no cgroup v1 {controller} hierarchy"
            continue
        base = point / path.lstrip("/") / f"hermes-sup-{tag}"
        if controller == "blkio" and not files.exists(point / path.lstrip("/") / "blkio.weight"):
            continue  # no proportional IO scheduler: nothing to weigh with
        if not files.writable(base.parent):
            return f"{base.parent} is not writable"
        bases[controller] = base
    return V1(bases, files)


def detect(
    tag: str,
    mountinfo: str | None = None,
    proc_cgroup: str | None = None,
    files: Files | None = None,
) -> Hierarchy | str:
    """The hierarchy session groups can be made in, or why there is none:
    a delegated v2 subtree first, else v1 as root. `tag` names our v1
    subtree (stable for one data directory)."""
    files = files or Files()
    if mountinfo is None:
        mountinfo = files.read(Path("/proc/self/mountinfo"))
    if proc_cgroup is None:
        proc_cgroup = files.read(Path("/proc/self/cgroup"))
    mounts = read_mounts(mountinfo)
    own_v2, own_v1 = read_own(proc_cgroup)
    v2 = detect_v2(mounts, own_v2, files)
    if isinstance(v2, V2):
        return v2
    v1 = detect_v1(mounts, own_v1, tag, files)
    if isinstance(v1, V1):
        return v1
    return f"{v2}; {v1}"


def remove_empty(dirs: list[str], patience: float = 2.0) -> None:
    """Remove each of `dirs` (deepest first) and the groups in them, once
    empty: what a supervisor killed outright could not (its zygote calls
    this after killing its workers, which leave their groups a moment
    later). Populated or foreign groups stay; errors are ignored."""
    deadline = time.monotonic() + patience
    for top in dirs:
        while True:
            try:
                for entry in os.scandir(top):
                    if entry.is_dir(follow_symlinks=False):
                        try:
                            os.rmdir(entry.path)
                        except OSError:
                            pass
                os.rmdir(top)
                break
            except FileNotFoundError:
                break
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    break
                time.sleep(0.02)  # a killed worker still leaving its group


# The OOM killer's view of our processes (proc(5) oom_score_adj): the
# supervisor, zygote and HTTP endpoint low, so that it takes a session's
# process first; every worker raises its own (always allowed) at its fork.
SUPERVISOR_OOM_SCORE_ADJ = -900
WORKER_OOM_SCORE_ADJ = 500


def set_oom_score_adj(value: int, pid: int | str = "self") -> bool:
    """Write a process's oom_score_adj; False where it may not be lowered
    (going below the last value needs CAP_SYS_RESOURCE)."""
    try:
        with open(f"/proc/{pid}/oom_score_adj", "w") as f:
            f.write(str(value))
    except OSError:
        return False
    return True


def lower_oom_score() -> int | None:
    """As root, make this process (and what it starts) the OOM killer's last
    choice but not immune; unprivileged (or without CAP_SYS_RESOURCE, as in
    some containers), it stays as it is. Returns the value now."""
    if os.geteuid() == 0:
        set_oom_score_adj(SUPERVISOR_OOM_SCORE_ADJ)
    try:
        with open("/proc/self/oom_score_adj") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None
