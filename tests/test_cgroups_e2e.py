"""A cgroup per session, proven with real supervisors, workers and shells, as
root on this machine's cgroup v1: every worker is in its session's group
before its first turn; the supervisor survives a session filling a
memory-capped service, and that session alone is ended, with reason
`oom`; a session's 32 setsid'd busy loops leave a neighbour its fair share
of the CPU; a fork bomb stops at pids.max; and no group outlives the
supervisor (nor a previous run's the next start)."""

from __future__ import annotations

import hashlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from hermes_sup.client.errors import SessionKilled, WorkerDied
from hermes_sup.local import cgroupfs

from .test_hostile_session import python, refused, start_lab, tries
from .test_sealed import sh
from .waiting import wait_for

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="cgroup v1 is used as root only"),
]

MIB = 1024 * 1024


def v1_bases(data_dir: Path) -> dict[str, Path]:
    """Where a supervisor with this data directory makes its v1 groups (as
    seen from this process's own cgroups)."""
    tag = hashlib.sha256(str(data_dir.absolute()).encode()).hexdigest()[:12]
    found = cgroupfs.detect(tag)
    if not isinstance(found, cgroupfs.V1):
        pytest.skip(f"no cgroup v1 here: {found}")
    return found.bases


def groups_of(pid: int) -> dict[str, str]:
    """A process's v1 cgroup per controller."""
    found = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        for name in names.split(","):
            found[name] = path
    return found


def can_lower_oom_score() -> bool:
    """Whether we hold CAP_SYS_RESOURCE (bit 24), which lowering needs."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> 24 & 1)
    return False


def oom_score_adj(pid: int) -> int:
    return int(Path(f"/proc/{pid}/oom_score_adj").read_text())


def test_each_worker_is_in_its_sessions_group_and_none_outlives_the_supervisor(
    supervisor_factory,  # noqa: ANN001
) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sup = supervisor_factory("--spare-workers", "1", "--metrics", str(port))
    bases = v1_bases(sup.data_dir)
    with sup.client() as client:
        status = client.status()
        assert status["cgroups"]["active"] and status["cgroups"]["version"] == "v1"
        assert "pids.max" in status["limits"]["processes"]
        pids = {}
        for key in ("a", "b", "c"):  # the first takes the spare, the others forks
            assert client.run(key, "echo hi").ok
            details = client.inspect(key)
            pids[key] = details["pid"]
            cg = details["cgroup"]
            assert cg["pids_max"] == 256 and cg["memory_max"] == 2048 * MIB, cg
            assert cg["pids"] >= 1 and cg["oom_kills"] == 0
        assert len(set(pids.values())) == 3
        for key, pid in pids.items():
            where = groups_of(pid)
            for controller, base in bases.items():
                group = where[controller]
                assert group.startswith("/") and str(base).endswith(group.rsplit("/sessions/")[0])
                assert "/sessions/w" in group, (key, controller, group)
        assert len({groups_of(p)["memory"] for p in pids.values()}) == 3
        # The OOM killer's order: workers first, the supervisor and zygote last.
        # (-900 needs CAP_SYS_RESOURCE, which a container may not give root.)
        low = -900 if can_lower_oom_score() else 0
        assert status["cgroups"]["oom_score_adj"] == {"supervisor": low, "workers": 500}
        assert oom_score_adj(sup.pid) == low and oom_score_adj(status["zygote_pid"]) == low
        assert all(oom_score_adj(pid) == 500 for pid in pids.values())
        rows = {row["key"]: row for row in client.sessions()}
        assert rows["a"]["cgroup"]["pids_max"] == 256
        # `status` says it; metrics show each session against its limits.
        shown = subprocess.run(
            [sys.executable, "-m", "hermes_sup.cli", "--state-dir", str(sup.state_dir), "status"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        assert "cgroups:   v1, one per session" in shown, shown
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            metrics = dict(
                line.rsplit(" ", 1)
                for line in response.read().decode().splitlines()
                if line and not line.startswith("#")
            )
        assert float(metrics['hermes_sup_session_memory_max_bytes{session="a"}']) == 2048 * MIB
        assert float(metrics['hermes_sup_session_tasks_max{session="c"}']) == 256
        assert float(metrics['hermes_sup_session_oom_kills{session="a"}']) == 0
        # A session's group goes with its worker.
        name_b = groups_of(pids["b"])["memory"].rsplit("/", 1)[1]
        client.kill("b")
        wait_for(lambda: not (bases["memory"] / "sessions" / name_b).exists())
    assert "cgroups version=v1" in sup.log()
    sup.stop()
    for base in bases.values():
        assert not base.exists(), f"{base} outlived the supervisor"


def test_a_previous_runs_groups_are_cleared_at_start(supervisor_factory) -> None:  # noqa: ANN001
    """A supervisor killed outright leaves its groups (and what ran in
    them): the next start with the same data directory kills and removes them."""
    sup = supervisor_factory(start=False)
    bases = v1_bases(sup.data_dir)
    stale = {c: base / "sessions" / "wdeadbeef" for c, base in bases.items()}
    left = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        for group in stale.values():
            group.mkdir(parents=True)
            (group / "cgroup.procs").write_text(str(left.pid))
        sup.start()
        assert left.wait(20) == -signal.SIGKILL
        assert not any(group.exists() for group in stale.values())
    finally:
        left.kill()
        left.wait()
    sup.stop()
    assert not any(base.exists() for base in bases.values())


# ------------------------------------------------- a memory-capped service


@pytest.fixture
def capped_cgroup() -> Iterator[Path]:
    """A v1 memory cgroup of 400 MiB (what a unit's MemoryMax= gives), for
    a supervisor to be started in; removed after (ask for it before
    supervisor_factory: the supervisor is stopped first)."""
    own = cgroupfs.read_own(Path("/proc/self/cgroup").read_text())[1]["memory"]
    path = Path("/sys/fs/cgroup/memory") / own.lstrip("/") / f"hst-cap-{secrets.token_hex(4)}"
    path.mkdir()
    (path / "memory.limit_in_bytes").write_text(str(400 * MIB))
    try:
        yield path
    finally:
        for proc in (path / "cgroup.procs").read_text().split():
            try:
                os.kill(int(proc), signal.SIGKILL)
            except ProcessLookupError:
                pass
        wait_for(lambda: not (path / "cgroup.procs").read_text().split())
        # Whatever the supervisor left beneath (nothing, it is asserted).
        for sub in sorted(path.rglob("*"), key=lambda p: -len(p.parts)):
            if sub.is_dir():
                sub.rmdir()
        path.rmdir()


FILL_MEMFD = python(
    """
    import os, sys
    pid = os.fork()
    if pid == 0:
        os.setsid()
        # Unmapped memfd pages: in nobody's RSS, the sampler's blind spot.
        fd = os.memfd_create("fill")
        for _ in range(1200):
            os.write(fd, b"x" * (1 << 20))
        os._exit(0)
    print("started", pid, flush=True)
    """
)


@pytest.mark.parametrize("cgroups", ["auto", "off"])
def test_a_session_filling_a_capped_service_is_ended_alone_with_reason_oom(
    capped_cgroup: Path,
    supervisor_factory,  # noqa: ANN001
    cgroups: str,
) -> None:
    """With cgroups the session's own memory.max stops it (reason `oom`);
    without, the service's cap is hit, and the OOM killer takes a worker
    (oom_score_adj 500), never the supervisor (0 or -900)."""
    sup = supervisor_factory("--memory-limit", "150", "--cgroups", cgroups, start=False)

    def enter() -> None:
        (capped_cgroup / "cgroup.procs").write_text("0")

    sup.start(preexec_fn=enter)
    with sup.client(timeout=120) as client:
        assert client.run("bystander", "echo hi").ok
        assert client.run("hog", "echo hi").ok
        hog_pid = client.inspect("hog")["pid"]
        # 1200 MiB of memfd from the hog's shell, in the background; then
        # tmpfs writes in its /tmp for good measure.
        for fill in (FILL_MEMFD, "head -c 600M /dev/zero > /tmp/fill; echo done"):
            try:
                sh(client, "hog", fill)
            except (WorkerDied, SessionKilled) as exc:
                # The turn it ran in says why: the worker died (the kernel's
                # kill came first), or the session was ended (v1: the
                # supervisor saw the OOM kill and ended it whole).
                assert cgroups == "off" or "oom" in str(exc)
        wait_for(lambda: not psutil.pid_exists(hog_pid), timeout=60)
        details = wait_for(lambda: _ended(client, "hog"), timeout=60)
        if cgroups == "auto":
            assert "by the kernel: oom" in details["last_exit"], details["last_exit"]
        # The supervisor and the bystander answer; the hog starts afresh.
        assert sup.proc.poll() is None
        assert client.run("bystander", "echo still here").ok
        assert client.run("hog", "echo back").ok
    assert cgroups == "off" or "by the kernel: oom" in sup.log()


def _ended(client, key: str) -> dict | None:  # noqa: ANN001
    details = client.inspect(key)
    return details if details.get("last_exit") else None


# --------------------------------------------------------------- CPU share

HOGS = 32
# How long the neighbour's turn computes, wall time (a window, not a deadline).
WINDOW = 4.0
NEIGHBOUR_TURN = python(
    f"""
    import time
    wall, cpu = time.monotonic(), time.process_time()
    while time.monotonic() - wall < {WINDOW}:
        sum(range(10000))
    print("cpu", time.process_time() - cpu, "wall", time.monotonic() - wall, flush=True)
    """
)


def group_cpu(pids_group: Path) -> float:
    """CPU seconds the processes now in a v1 pids group have used."""
    total = 0.0
    for pid in (pids_group / "cgroup.procs").read_text().split():
        try:
            times = psutil.Process(int(pid)).cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def test_setsid_busy_loops_leave_a_neighbour_its_fair_share(supervisor_factory) -> None:  # noqa: ANN001
    """32 busy loops, each in a session of its own (setsid: out of the
    autogroup the kernel would otherwise give them), against one CPU-bound
    turn of a neighbour: the two sessions share the CPU about evenly, as
    their equal cpu weights say. Compared as CPU time in the same wall
    window, so a loaded machine slows both alike."""
    sup = supervisor_factory()
    with sup.client(timeout=120) as client:
        assert client.run("neighbour", "echo ready").ok
        assert client.run("hogs", "echo ready").ok
        hog_pid = client.inspect("hogs")["pid"]
        pids_group = Path("/sys/fs/cgroup/pids") / groups_of(hog_pid)["pids"].lstrip("/")
        sh(
            client,
            "hogs",
            f"for i in $(seq {HOGS}); do setsid sh -c 'while :; do :; done' "
            ">/dev/null 2>&1 & done; echo started",
        )
        wait_for(lambda: len((pids_group / "cgroup.procs").read_text().split()) > HOGS)
        before = group_cpu(pids_group)
        _, lines = sh(client, "neighbour", NEIGHBOUR_TURN)
        hogs = group_cpu(pids_group) - before
        fields = lines[-1].split()
        mine = float(fields[1])
        share = mine / (mine + hogs)
        print(f"neighbour {mine:.2f}s CPU, hogs {hogs:.2f}s, share {share:.2f}")
        # Fair is 1/2 on 2 CPUs (the neighbour can use one, the hogs the
        # other); without weights it was 1/33 of what the hogs got.
        assert share >= 1 / 3, f"neighbour {mine:.2f}s CPU against hogs' {hogs:.2f}s"
        client.kill("hogs", force=True)


# --------------------------------------------------------------- fork bomb

FORK_BOMB = python(
    """
    import os, time
    if os.fork() == 0:
        os.setsid()
        null = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)  # the turn ends without waiting for the bomb
        end = time.monotonic() + 3
        while time.monotonic() < end:
            try:
                if os.fork() == 0:
                    time.sleep(0.2)  # and then fork on too
            except OSError:
                time.sleep(0.01)
        time.sleep(120)
        os._exit(0)
    print("lit", flush=True)
    """
)


def test_a_fork_bomb_stops_at_pids_max(supervisor_factory) -> None:  # noqa: ANN001
    sup = supervisor_factory("--max-procs", "64")
    with sup.client(timeout=120) as client:
        assert client.run("neighbour", "echo ready").ok
        assert client.run("bomb", "echo ready").ok
        sh(client, "bomb", FORK_BOMB)
        cg = wait_for(lambda: (c := client.inspect("bomb")["cgroup"]) and c["pids_max_hits"] and c)
        assert cg["pids_max"] == 64 and cg["pids"] <= 64, cg
        # Held at the limit, the bomb leaves the others (and us) forking.
        assert sh(client, "neighbour", "echo fine")[1] == ["fine"]
        for _ in range(5):
            assert client.inspect("bomb")["cgroup"]["pids"] <= 64
        rows = {row["key"]: row for row in client.sessions()}
        assert rows["bomb"]["cgroup"]["pids_max_hits"] > 0
        client.kill("bomb", force=True)
        assert client.inspect("bomb")["cgroup"] is None  # its group went with it


def test_a_session_cannot_loosen_or_leave_its_group(supervisor_factory) -> None:  # noqa: ANN001
    """From the session's own shell: its limits cannot be raised, and it
    cannot move itself out of its group (or into another's)."""
    sup = supervisor_factory()
    with sup.client(timeout=60) as client:
        assert client.run("other", "echo hi").ok
        assert client.run("s", "echo hi").ok
        pid = client.inspect("s")["pid"]
        other = groups_of(client.inspect("other")["pid"])
        mine = groups_of(pid)
        memory = Path("/sys/fs/cgroup/memory") / mine["memory"].lstrip("/")
        pids = Path("/sys/fs/cgroup/pids") / mine["pids"].lstrip("/")
        attempts = tries(
            client,
            "s",
            {
                "raise memory": f"echo 9223372036854771712 > {memory}/memory.limit_in_bytes",
                "raise pids": f"echo max > {pids}/pids.max",
                "leave": f"echo $$ > {pids.parent.parent.parent}/cgroup.procs",
                "to root": "echo $$ > /sys/fs/cgroup/pids/cgroup.procs",
                "into another's": "echo $$ > /sys/fs/cgroup/pids" + other["pids"] + "/cgroup.procs",
                "remove": f"rmdir {memory}",
            },
        )
        for name, lines in attempts.items():
            assert refused(lines), (name, lines)
        assert groups_of(pid) == mine
        cg = client.inspect("s")["cgroup"]
        assert cg["memory_max"] == 2048 * MIB and cg["pids_max"] == 256


def test_the_cgroups_bench_runs_and_leaves_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    """bench/cgroups_ab.py, tiny: both sides measured, paired."""
    from bench import cgroups_ab

    cgroups_ab.run(3, 20, ["--spare-workers", "0"])
    out = capsys.readouterr().out
    assert "this: cgroups v1" in out
    assert "round trip (this: cgroups)" in out and "spawn (this: cgroups)" in out


def test_unprivileged_without_a_delegated_v2_tree_says_why(supervisor_factory, workdir) -> None:  # noqa: ANN001
    """As a service user on this host (v1, and an empty v2 root) there are
    no cgroups: `status` says so and why, and the rlimit and sampler stay."""
    lab = start_lab(supervisor_factory, workdir, "user")
    with lab.client() as client:
        status = client.status()
        assert client.run("s", "echo hi").ok
        assert client.inspect("s")["cgroup"] is None
    groups = status["cgroups"]
    assert not groups["active"] and "never delegated to an unprivileged user" in groups["reason"]
    assert "RLIMIT_NPROC" in status["limits"]["processes"]
    assert "cgroups_unavailable" in lab.sup.log()


def test_a_supervisor_killed_outright_leaves_no_group(supervisor_factory) -> None:  # noqa: ANN001
    """SIGKILL gives the supervisor no chance to clean up: its zygote,
    which outlives it a moment to kill its workers, removes the groups."""
    sup = supervisor_factory("--spare-workers", "1")
    bases = v1_bases(sup.data_dir)
    with sup.client() as client:
        assert client.run("a", "echo hi").ok
        assert client.run("b", "echo hi").ok
    assert any((base / "sessions").iterdir() for base in bases.values())
    sup.proc.kill()
    sup.proc.wait()
    wait_for(lambda: not any(base.exists() for base in bases.values()))


def test_an_oom_kill_under_the_worker_is_noticed_without_polling(supervisor_factory) -> None:  # noqa: ANN001
    """v1 has no memory.oom.group: the supervisor ends a session whose group
    saw an OOM kill. It learns of it from the group's OOM notice (an
    eventfd), not by reading every group's counters every tick: a process
    under the worker running out of memory still ends the session `oom`,
    and its neighbour is left alone."""
    sup = supervisor_factory("--memory-limit", "120")
    with sup.client(timeout=120) as client:
        assert client.run("neighbour", "echo ready").ok
        assert client.run("hog", "echo ready").ok
        hog_pid = client.inspect("hog")["pid"]
        eat = f"{sys.executable} -c 'b = bytearray(400 << 20); b[::4096] = b\"x\" * (400 << 8)'"
        try:
            sh(client, "hog", eat)
        except (WorkerDied, SessionKilled) as exc:
            assert "oom" in str(exc)
        wait_for(lambda: not psutil.pid_exists(hog_pid), timeout=60)
        details = wait_for(lambda: _ended(client, "hog"), timeout=60)
        assert "oom" in details["last_exit"], details["last_exit"]
        assert client.run("neighbour", "echo still here").ok
    assert "oom_kill session=hog" in sup.log()  # ended by the supervisor, on the notice
