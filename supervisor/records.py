"""Records of live workers in the state directory, for the next supervisor.

A worker should die with its supervisor (parent-death signal, and the
zygote's clean-up), but if a supervisor and its zygote were killed together
while a worker was stopped, that worker can outlive them. Each live worker
has a small file `workers/<pid>` holding its session key and process create
time; a new supervisor stops any worker whose pid AND create time still
match, so a recycled pid is never touched.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import psutil

from .process import kill_processes

RECORDS_DIR = "workers"


class WorkerRecords:
    """The `workers/` directory of one state directory."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir / RECORDS_DIR
        self.dir.mkdir(mode=0o700, exist_ok=True)

    def add(self, pid: int, key: str, create_time: float | None) -> None:
        """Record a live worker. OSError (a full disk) leaves no partial record."""
        path = self.dir / str(pid)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({"key": key, "create_time": create_time}, f)
        except OSError:
            path.unlink(missing_ok=True)
            raise

    def remove(self, pid: int) -> None:
        """Forget a worker that has been reaped."""
        try:
            (self.dir / str(pid)).unlink()
        except FileNotFoundError:
            pass

    def stop_leftovers(self) -> list[str]:
        """Stop workers recorded by a previous supervisor that still run.
        Returns one line per record saying what was done with it."""
        report = []
        for path in sorted(self.dir.iterdir()):
            try:
                pid = int(path.name)
                record = json.loads(path.read_text())
            except (ValueError, OSError):
                path.unlink(missing_ok=True)
                continue
            key, created = record.get("key"), record.get("create_time")
            tree: list[psutil.Process] = []
            try:
                proc = psutil.Process(pid)
                same = created is not None and proc.create_time() == created
                if same:
                    # A worker may die as we look (its zygote, killed with
                    # the old supervisor, is killing it too): then it is gone.
                    tree = proc.children(recursive=True)
            except psutil.Error:
                same = False
            if not same:
                report.append(
                    f"record of session {key!r} pid {pid}: process gone or pid reused; ignored"
                )
            else:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    pass
                kill_processes([proc, *tree])
                report.append(
                    f"stopped leftover worker of session {key!r} pid {pid} and "
                    f"{len(tree)} descendant(s) from a previous supervisor "
                    "(not adopted: its token died with that supervisor)"
                )
            path.unlink(missing_ok=True)
        return report
