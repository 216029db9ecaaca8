"""A full data disk: session logs lose lines, the supervisor loses nothing.

The data directory is a 2 MiB tmpfs, filled to the last byte. A worker that
prints 20,000 lines and dies used to take the supervisor down (the write
error rose from the exit's pipe drain into the main loop), or, when it
survived, log a traceback for every failed read. Now the lines are counted
and dropped, the supervisor's log says so once per interval, every other
session is served, and logging resumes by itself once there is room.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from hermes_sup.client import SupervisorError
from hermes_sup.protocol import session_dir_name

pytestmark = pytest.mark.e2e

RUNTIMES = str(Path(__file__).parent / "runtimes")


def fill(folder: Path) -> Path:
    """Write a file until the file system is full; returns it."""
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as f:
        block = b"\0" * 65536
        while True:
            try:
                f.write(block)
            except OSError:
                break
        # And what a smaller write can still squeeze in.
        while True:
            try:
                f.write(b"\0" * 512)
            except OSError:
                break
    return filler


@pytest.fixture
def small_disks(workdir: Path):
    """mount(name): `workdir/name` (the supervisor's data directory is "d",
    its state directory "s") as a 2 MiB tmpfs, unmounted at the end."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs as the data directory needs root")
    mounted: list[Path] = []

    def mount(name: str) -> Path:
        path = workdir / name
        path.mkdir(mode=0o700)
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(path)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(path)
        return path

    try:
        yield mount
    finally:
        for path in mounted:
            # Workers have their cwd in it: lazily, if they are still going away.
            if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def small_data_dir(small_disks) -> Path:
    """The supervisor's data directory on a 2 MiB tmpfs."""
    return small_disks("d")


def test_a_full_disk_loses_log_lines_not_the_supervisor(
    supervisor_factory, small_data_dir: Path
) -> None:
    env = dict(os.environ, PYTHONPATH=RUNTIMES)
    # Unsealed: hs_printer SIGKILLs itself, which a sealed worker (its PID
    # namespace's init) cannot.
    sup = supervisor_factory(
        "--agent",
        "hs_printer:make",
        "--min-uptime",
        "0",
        "--sealed",
        "off",
        "--disk-reserve",
        "0",
        env=env,
    )
    log_path = small_data_dir / "sessions" / session_dir_name("noisy") / "worker.log"
    try:
        with sup.client() as client:
            assert client.run("noisy", "print 3").text == "printed 3"
            assert client.run("other", "print 3").text == "printed 3"
            filler = fill(small_data_dir)
            for _ in range(3):
                with pytest.raises(SupervisorError, match="SIGKILL"):
                    client.run("noisy", "print-and-die 20000")
            # Alive, and serving another session (which prints too).
            assert client.ping().pid == sup.pid
            assert client.run("other", "print 2000").text == "printed 2000"
            assert client.run("noisy", "print 2000").text == "printed 2000"
            # What fitted in the file's last page went in; the rest did not.
            assert "line 019999 of 20000" not in log_path.read_text()
            # Room again: the next lines reach the log, after a note of what was lost.
            filler.unlink()
            deadline = time.monotonic() + 15
            while "of 7" not in log_path.read_text() and time.monotonic() < deadline:
                time.sleep(0.2)  # a write is tried again at most once a second
                client.run("noisy", "print 7")
            text = log_path.read_text()
            assert client.run("other", "print 1").text == "printed 1"
    finally:
        sup.stop()
    supervisor_log = sup.log()
    assert "Traceback" not in supervisor_log
    about = [line for line in supervisor_log.splitlines() if "session_log_" in line]
    losing = [line for line in about if "session_log_losing_lines session=noisy" in line]
    # Once per interval per session, however many lines and reads failed.
    assert 1 <= len(losing) <= 3, about
    assert len(about) <= 8, about
    assert "line 000006 of 7" in text
    assert "line(s) of this session's output were lost here (No space" in text
    resumed = [line for line in about if "session_log_resumed session=noisy" in line]
    assert len(resumed) == 1 and int(resumed[0].rsplit("lost_lines=", 1)[1]) >= 60000


def test_a_worker_starts_when_its_record_cannot_be_written(supervisor_factory, small_disks) -> None:
    """Each worker's record (in the state directory, for a next supervisor
    to stop leftovers) is written as it is adopted; on a full disk that
    failed the adoption half-way, with a traceback (and, for a spare taken
    while a death was handled, in the main loop, ending the supervisor)."""
    data, state = small_disks("d"), small_disks("s")
    env = dict(os.environ, PYTHONPATH=RUNTIMES)
    # Unsealed: hs_printer SIGKILLs itself, which a sealed worker (its PID
    # namespace's init) cannot.
    sup = supervisor_factory(
        "--agent",
        "hs_printer:make",
        "--min-uptime",
        "0",
        "--sealed",
        "off",
        "--disk-reserve",
        "0",
        # No spares: one made before the disk filled has its record already,
        # and whether one is made after depends on timing; each worker here
        # is forked, and its record written, after the disk is full.
        "--spare-workers",
        "0",
        env=env,
    )
    try:
        with sup.client() as client:
            assert client.run("first", "print 3").text == "printed 3"
            fill(data), fill(state)
            # Its worker starts; its turn, whose start its journal (new, on the
            # full disk) cannot record, is not run (test_disk_reserve.py).
            with pytest.raises(SupervisorError) as full:
                client.run("fresh", "print 3")
            assert full.value.code == "disk_full"
            assert client.inspect("fresh")["state"] == "idle"
            with pytest.raises(SupervisorError, match="SIGKILL"):
                client.run("first", "print-and-die 100")
            assert client.run("first", "print 3").text == "printed 3"
            assert client.ping().pid == sup.pid
    finally:
        sup.stop()
    text = sup.log()
    assert "Traceback" not in text
    assert "worker_record_failed" in text


def test_a_session_json_that_cannot_be_written_does_not_fail_the_request(
    tmp_path, monkeypatch, caplog
) -> None:
    """A session left on disk, whose session.json cannot be rewritten (a full
    disk): its turn runs, with one line saying so, not an internal error."""
    import errno

    from hermes_sup.supervisor import store as store_module

    from .fakes import Rig

    rig = Rig(tmp_path, monkeypatch)
    rig.table.find_or_create("stored", None)
    rig.table.store.save_new(rig.table.require("stored"))  # on disk, as an earlier run left it
    rig.table.sessions.clear()

    def full(session) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_module, "save_session_meta", full)

    async def scenario() -> None:
        req = rig.send("stored", "hi")
        assert not [m for m in rig.finals(req) if m.kind.value == "error"]
        assert rig.table.require("stored").state.value == "starting"

    rig.run(scenario())
    assert "session_meta_failed session=stored" in caplog.text
