"""The lease watch's pass, on real lease files: a session whose epoch is
no longer ours is handed to the fence, one still ours or given up meanwhile
is left alone. (That the fence then kills the worker is proven end to end
in test_leases.py.)"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from hermes_sup.supervisor import leases
from hermes_sup.supervisor.lease_watch import LeaseWatch, read_epochs


class FakeOwnership:
    """Records the sessions the watch asks the fence about."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def fenced(self, session: Any) -> bool:
        self.asked.append(session.key)
        session.lease = None
        return False


def held(tmp_path: Path, key: str) -> SimpleNamespace:
    path = tmp_path / key
    path.mkdir()
    return SimpleNamespace(key=key, lease=leases.Leases("me").take(path))


def test_only_sessions_taken_over_are_handed_to_the_fence(tmp_path: Path) -> None:
    kept, taken, unfenced = (held(tmp_path, k) for k in ("kept", "taken", "unfenced"))
    leases.write_epoch(taken.lease.dir, taken.lease.epoch + 1, "0" * 16)
    unfenced.lease.unfenced = True  # guarded by its lock alone: nothing to compare
    leases.write_epoch(unfenced.lease.dir, 99, "1" * 16)
    gone = SimpleNamespace(key="gone", lease=None)
    sessions = {s.key: s for s in (kept, taken, unfenced, gone)}
    ownership = FakeOwnership()
    watch = LeaseWatch(sessions, ownership)  # type: ignore[arg-type]
    assert asyncio.run(watch.check_all()) == 1
    assert ownership.asked == ["taken"]
    assert kept.lease is not None and asyncio.run(watch.check_all()) == 0


def test_an_unreadable_epoch_is_reported_as_unknown(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    assert read_epochs([tmp_path / "missing", tmp_path / "a-file"]) == [(0, ""), None]
