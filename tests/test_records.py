"""Worker records (supervisor/records.py): a new supervisor stops what an
old one left, and a worker that dies while it looks is simply gone."""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest

from hermes_sup.supervisor.records import WorkerRecords


@pytest.fixture
def sleeper():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_leftover_worker_is_stopped(tmp_path, sleeper) -> None:
    records = WorkerRecords(tmp_path)
    records.add(sleeper.pid, "left", psutil.Process(sleeper.pid).create_time())
    # Not our child's process group: the record's pid is killed by itself.
    report = records.stop_leftovers()
    assert sleeper.wait(timeout=10) != 0
    assert report and "stopped leftover worker of session 'left'" in report[0]
    assert list(records.dir.iterdir()) == []


def test_a_worker_that_dies_while_it_is_looked_at_is_gone_not_a_crash(
    tmp_path, sleeper, monkeypatch
) -> None:
    records = WorkerRecords(tmp_path)
    records.add(sleeper.pid, "dying", psutil.Process(sleeper.pid).create_time())

    def died(self: psutil.Process, recursive: bool = False) -> list[psutil.Process]:
        raise psutil.NoSuchProcess(self.pid)

    monkeypatch.setattr(psutil.Process, "children", died)
    report = records.stop_leftovers()
    gone = f"record of session 'dying' pid {sleeper.pid}: process gone or pid reused; ignored"
    assert report == [gone]
    assert sleeper.poll() is None  # nothing was killed on a guess
    assert list(records.dir.iterdir()) == []
