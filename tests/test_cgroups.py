"""The cgroup interface (local/cgroupfs.py) through its one `Hierarchy`:
v2 against a fake tree in a temp directory that keeps the kernel's rules we
rely on, v1 for real on this machine (as root), and a real delegated v2
subtree where the host has one."""

from __future__ import annotations

import dataclasses
import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hermes_sup.local import cgroupfs
from hermes_sup.local.cgroupfs import Files, Limits

MIB = 1024 * 1024
INTERFACE = {
    "cgroup.procs": "",
    "cgroup.controllers": "",
    "cgroup.subtree_control": "",
    "cgroup.kill": "",
    "memory.max": "max\n",
    "memory.swap.max": "max\n",
    "memory.oom.group": "0\n",
    "memory.current": "0\n",
    "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n",
    "pids.max": "max\n",
    "pids.current": "0\n",
    "pids.events": "max 0\n",
    "cpu.weight": "100\n",
    "io.weight": "default 100\n",
}


class FakeV2(Files):
    """A cgroup v2 tree of plain files with the kernel's semantics for what
    the supervisor relies on: mkdir makes the interface files and inherits
    the parent's enabled controllers; a pid written to cgroup.procs leaves
    every other group; enabling a controller in a group with processes
    fails (no internal processes) as does one the parent did not enable;
    rmdir fails with EBUSY while a group has processes or children;
    cgroup.kill SIGKILLs and empties the group."""

    def __init__(self, root: Path, controllers: str = "memory pids cpu io") -> None:
        self.root = root
        self._make(root, controllers)

    def _make(self, path: Path, controllers: str) -> None:
        os.mkdir(path)
        for name, text in INTERFACE.items():
            (path / name).write_text(text)
        (path / "cgroup.controllers").write_text(controllers + "\n")

    def mkdir(self, path: Path) -> None:
        if path.exists():
            return
        enabled = (path.parent / "cgroup.subtree_control").read_text().split()
        self._make(path, " ".join(enabled))

    def rmdir(self, path: Path) -> None:
        if (path / "cgroup.procs").read_text().split() or self.children(path):
            raise OSError(errno.EBUSY, "Device or resource busy")
        for name in INTERFACE:
            (path / name).unlink()
        os.rmdir(path)

    def write(self, path: Path, text: str) -> None:
        group, name = path.parent, path.name
        if name == "cgroup.procs":
            self._move(group, text.strip())
        elif name == "cgroup.subtree_control":
            if (group / "cgroup.procs").read_text().split():
                raise OSError(errno.EBUSY, "Device or resource busy")
            have = (group / "cgroup.controllers").read_text().split()
            wanted = [c.lstrip("+") for c in text.split()]
            if any(c not in have for c in wanted):
                raise OSError(errno.ENOENT, "No such file or directory")
            path.write_text(" ".join(wanted) + "\n")
        elif name == "cgroup.kill":
            for pid in (group / "cgroup.procs").read_text().split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            (group / "cgroup.procs").write_text("")
        else:
            if not path.exists():
                raise OSError(errno.ENOENT, "No such file or directory")
            path.write_text(text + "\n")

    def _move(self, group: Path, pid: str) -> None:
        for procs in self.root.rglob("cgroup.procs"):
            pids = procs.read_text().split()
            if pid in pids:
                pids.remove(pid)
                procs.write_text("".join(p + "\n" for p in pids))
        procs = group / "cgroup.procs"
        procs.write_text(procs.read_text() + pid + "\n")


def fake_tree(tmp_path: Path) -> tuple[FakeV2, Path]:
    """A fake v2 root with a unit the supervisor (this test's pid) runs in."""
    fake = FakeV2(tmp_path / "cg")
    fake.write(fake.root / "cgroup.subtree_control", "+memory +pids +cpu +io")
    unit = fake.root / "hermes.service"
    fake.mkdir(unit)
    fake.write(unit / "cgroup.procs", str(os.getpid()))
    return fake, unit


def mountinfo(v2: Path | None = None, v1: dict[str, Path] | None = None) -> str:
    lines = []
    if v2 is not None:
        lines.append(f"41 31 0:38 / {v2} rw,relatime - cgroup2 cgroup2 rw")
    for i, (controller, point) in enumerate((v1 or {}).items()):
        lines.append(
            f"{50 + i} 31 0:{60 + i} / {point} rw,relatime - cgroup cgroup rw,{controller}"
        )
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------- v2


def test_v2_is_found_in_our_own_delegated_cgroup(tmp_path: Path) -> None:
    fake, unit = fake_tree(tmp_path)
    found = cgroupfs.detect("t", mountinfo(fake.root), "0::/hermes.service\n", fake)
    assert isinstance(found, cgroupfs.V2) and found.unit == unit
    assert found.controllers == ("memory", "pids", "cpu", "io")


def test_v2_started_in_the_supervisor_subgroup_uses_its_parent(tmp_path: Path) -> None:
    """systemd's DelegateSubgroup=supervisor starts us in <unit>/supervisor."""
    fake, unit = fake_tree(tmp_path)
    fake.mkdir(unit / "supervisor")
    found = cgroupfs.detect("t", mountinfo(fake.root), "0::/hermes.service/supervisor\n", fake)
    assert isinstance(found, cgroupfs.V2) and found.unit == unit


@pytest.mark.parametrize(
    ("own", "controllers", "why"),
    [
        ("/", "memory pids", "root cgroup"),
        ("/hermes.service", "cpu io", "controllers memory pids not delegated"),
    ],
)
def test_v2_not_usable_says_why(tmp_path: Path, own: str, controllers: str, why: str) -> None:
    fake = FakeV2(tmp_path / "cg", controllers)
    fake.write(fake.root / "cgroup.subtree_control", " ".join(f"+{c}" for c in controllers.split()))
    fake.mkdir(fake.root / "hermes.service")
    found = cgroupfs.detect_v2(cgroupfs.read_mounts(mountinfo(fake.root)), own, fake)
    assert isinstance(found, str) and why in found


def test_v2_setup_moves_us_into_a_leaf_before_enabling_controllers(tmp_path: Path) -> None:
    """The no-internal-process rule: the fake refuses to enable controllers
    in the unit while we are in it; setup must have moved us first."""
    fake, unit = fake_tree(tmp_path)
    h = cgroupfs.V2(unit, fake)
    h.setup()
    assert (unit / "supervisor" / "cgroup.procs").read_text().split() == [str(os.getpid())]
    assert (unit / "cgroup.procs").read_text() == ""
    for group in (unit, unit / "sessions"):
        assert (group / "cgroup.subtree_control").read_text().split() == [
            "memory",
            "pids",
            "cpu",
            "io",
        ]
    h.setup()  # a second start finds it made


def test_v2_session_group_limits_usage_kill_and_removal(tmp_path: Path) -> None:
    fake, unit = fake_tree(tmp_path)
    h = cgroupfs.V2(unit, fake)
    h.setup()
    h.make("wabc", Limits(memory=64 * MIB, pids=32, cpu_weight=50, io_weight=200))
    group = unit / "sessions" / "wabc"
    assert (group / "memory.max").read_text().strip() == str(64 * MIB)
    assert (group / "memory.swap.max").read_text().strip() == "0"
    assert (group / "memory.oom.group").read_text().strip() == "1"
    assert (group / "pids.max").read_text().strip() == "32"
    assert (group / "cpu.weight").read_text().strip() == "50"
    assert (group / "io.weight").read_text().strip() == "default 200"
    assert h.procs_files("wabc") == [str(group / "cgroup.procs")]

    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        h.place("wabc", sleeper.pid)
        assert h.contains("wabc", sleeper.pid) and h.pids("wabc") == [sleeper.pid]
        (group / "memory.current").write_text(f"{5 * MIB}\n")
        (group / "memory.events").write_text("oom 2\noom_kill 1\noom_group_kill 1\n")
        (group / "pids.events").write_text("max 7\n")
        use = h.usage("wabc")
        assert (use.memory, use.memory_max, use.pids_max) == (5 * MIB, 64 * MIB, 32)
        assert (use.oom_kills, use.pids_max_hits) == (1, 7)
        assert not h.remove("wabc"), "a group with a process in it is not removed"
        h.kill_all("wabc")
        assert sleeper.wait(10) == -signal.SIGKILL
    finally:
        sleeper.kill()
        sleeper.wait()
    assert h.remove("wabc") and h.names() == []
    h.teardown()
    assert not (unit / "sessions").exists() and (unit / "supervisor").exists()


def test_v2_a_kernel_without_swap_accounting_or_io_is_fine(tmp_path: Path) -> None:
    fake = FakeV2(tmp_path / "cg", "memory pids")
    fake.write(fake.root / "cgroup.subtree_control", "+memory +pids")
    unit = fake.root / "u"
    fake.mkdir(unit)
    h = cgroupfs.V2(unit, fake)
    h.setup()
    fake.mkdir(unit / "sessions" / "w1")
    (unit / "sessions" / "w1" / "memory.swap.max").unlink()
    h.make("w1", Limits(memory=MIB, pids=4, cpu_weight=10, io_weight=10))
    assert h.controllers == ("memory", "pids")


# ------------------------------------------------------------------- v1

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="cgroup v1 is used as root only")


def v1_or_skip(tag: str) -> cgroupfs.V1:
    found = cgroupfs.detect(tag, proc_cgroup=Path("/proc/self/cgroup").read_text())
    if isinstance(found, cgroupfs.V2):
        pytest.skip("this host delegates cgroup v2: v1 is not used here")
    if isinstance(found, str):
        pytest.skip(f"no cgroups here: {found}")
    return found


def run_in(h: cgroupfs.Hierarchy, name: str, code: str) -> subprocess.Popen[str]:
    """A python child that enters the group itself (as a worker does) first."""
    prelude = f"import os\nfor p in {h.procs_files(name)!r}:\n    open(p, 'w').write('0')\n"
    return subprocess.Popen(
        [sys.executable, "-c", prelude + code], text=True, stdout=subprocess.PIPE
    )


@needs_root
def test_v1_for_real_limits_oom_pids_and_clean_removal() -> None:
    """On the real kernel: a memfd past memory.max is an OOM kill counted in
    the group, a fork past pids.max fails and is counted, and nothing of
    the tree is left after kill_all and teardown."""
    h = v1_or_skip(f"test{os.getpid()}")
    h.setup()
    try:
        h.make("wmem", Limits(memory=32 * MIB, pids=16, cpu_weight=100, io_weight=100))
        hog = run_in(
            h,
            "wmem",
            "fd = os.memfd_create('hog')\n"
            "for _ in range(256):\n"
            "    os.write(fd, b'x' * (1 << 20))\n"
            "print('survived', flush=True)\n",
        )
        out, _ = hog.communicate(timeout=60)
        assert hog.returncode == -signal.SIGKILL and "survived" not in out
        use = h.usage("wmem")
        assert use.oom_kills == 1 and use.memory_max == 32 * MIB

        h.make("wpids", Limits(memory=64 * MIB, pids=8))
        bomb = run_in(
            h,
            "wpids",
            "import time\n"
            "kids, refused = [], 0\n"
            "for _ in range(40):\n"
            "    try:\n"
            "        pid = os.fork()\n"
            "    except BlockingIOError:\n"
            "        refused += 1\n"
            "        continue\n"
            "    if pid == 0:\n"
            "        time.sleep(60)\n"
            "        os._exit(0)\n"
            "    kids.append(pid)\n"
            "print(len(kids), refused, flush=True)\n"
            "time.sleep(60)\n",
        )
        assert bomb.stdout is not None
        forked, refused = map(int, bomb.stdout.readline().split())
        assert forked == 7 and refused == 33  # 8 tasks: the bomb and 7 children
        use = h.usage("wpids")
        assert use.pids == 8 and use.pids_max == 8 and use.pids_max_hits == 33
        assert not h.remove("wpids")
        h.kill_all("wpids")
        assert bomb.wait(10) == -signal.SIGKILL
        deadline = time.monotonic() + 10
        while not h.remove("wpids") and time.monotonic() < deadline:
            time.sleep(0.05)  # the children are reaped by init, a moment later
        assert h.remove("wmem") and h.remove("wpids")
    finally:
        for name in h.names():
            h.kill_all(name)
            h.remove(name)
        h.teardown()
    for base in h.bases.values():
        assert not base.exists(), base


@needs_root
def test_v1_place_moves_a_running_process_into_every_hierarchy() -> None:
    h = v1_or_skip(f"test{os.getpid()}p")
    h.setup()
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        h.make("w1", Limits(memory=64 * MIB, pids=8, cpu_weight=200))
        assert not h.contains("w1", sleeper.pid)
        h.place("w1", sleeper.pid)
        assert h.contains("w1", sleeper.pid) and h.pids("w1") == [sleeper.pid]
        if "cpu" in h.bases:
            shares = (h.bases["cpu"] / "sessions" / "w1" / "cpu.shares").read_text()
            assert int(shares) == 2048
    finally:
        sleeper.kill()
        sleeper.wait()
        for name in h.names():
            h.kill_all(name)
            h.remove(name)
        h.teardown()


# ----------------------------------------------------------- real v2


def test_v2_for_real_where_the_host_delegates_it() -> None:
    mounts = cgroupfs.read_mounts(Path("/proc/self/mountinfo").read_text())
    own, _ = cgroupfs.read_own(Path("/proc/self/cgroup").read_text())
    found = cgroupfs.detect_v2(mounts, own, Files())
    if isinstance(found, str):
        pytest.skip(f"no delegated cgroup v2 subtree here: {found}")
    # Only the parts that leave our own cgroup as it was: no self-move.
    assert "memory" in found.controllers and "pids" in found.controllers


def test_oom_score_adj_of_a_worker_can_always_be_raised() -> None:
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from hermes_sup.local import cgroupfs\n"
            "assert cgroupfs.set_oom_score_adj(cgroupfs.WORKER_OOM_SCORE_ADJ)\n"
            "print(open('/proc/self/oom_score_adj').read().strip())",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    out, _ = child.communicate(timeout=30)
    assert out.strip() == "500"


def test_settings_become_kernel_limits() -> None:
    from hermes_sup.supervisor.cgroups import group_name, limits_for
    from hermes_sup.supervisor.config import Settings

    base = Settings(state_dir=Path("/tmp/s"), data_dir=Path("/tmp/d"))
    limits = limits_for(base)
    assert limits == Limits(memory=2048 * MIB, pids=256, cpu_weight=100, io_weight=100)
    big = limits_for(
        dataclasses.replace(
            base, memory_limit_mb=None, max_procs=None, cpu_weight=50000, io_weight=None
        )
    )
    assert big == Limits(memory=None, pids=None, cpu_weight=10000, io_weight=None)
    # A group's name is made from the routing id only, never from a key.
    assert group_name(b"w" + bytes(range(15))) == "w77" + bytes(range(15)).hex()


def test_a_kernel_ending_is_its_own_exit_category() -> None:
    from hermes_sup.supervisor.metrics import exit_category

    oom = "was ended by the kernel: oom (out of memory at its memory limit of 80 MiB)"
    assert exit_category(oom, None, "SIGKILL", stopped=True) == "oom"
    pids = "was ended after the kernel refused it processes: pids (at its limit of 64, 3 forks refused)"
    assert exit_category(pids, 1, None, stopped=False) == "pids"
