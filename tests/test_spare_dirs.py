"""Spare session directories: the supervisor moves them into place, never over a
real one, and a worker making its own directories survives a spare renamed over them."""

from __future__ import annotations

import os
from pathlib import Path


def test_spare_session_dirs_move_into_place_and_never_over_a_real_one(tmp_path: Path) -> None:
    from hermes_sup.supervisor.spare_dirs import SpareDirs

    sessions = tmp_path / "sessions"
    (tmp_path / ".spare-sessions" / "old").mkdir(parents=True)  # left by an earlier run
    spares = SpareDirs(tmp_path, target=2)
    spares.reset()
    assert not (tmp_path / ".spare-sessions" / "old").exists() and len(spares.free) == 2
    assert (tmp_path / ".spare-sessions").stat().st_mode & 0o077 == 0
    assert list(sessions.iterdir()) == []  # only sessions live there

    a = sessions / "aaaa"
    assert spares.take(a)
    assert sorted(p.name for p in a.iterdir()) == ["home", "tmp", "workspace"]
    assert a.stat().st_mode & 0o777 == 0o700

    b = sessions / "bbbb"
    (b / "workspace").mkdir(parents=True)  # the worker got there first
    assert not spares.take(b)
    assert sorted(p.name for p in b.iterdir()) == ["workspace"] and len(spares.free) == 1

    c = sessions / "cccc"
    assert spares.take(c, with_workspace=False)  # its workspace is elsewhere
    assert sorted(p.name for p in c.iterdir()) == ["home", "tmp"]
    assert not spares.take(sessions / "dddd")  # none left
    spares.refill(5)
    assert len(spares.free) == 2  # up to the target, no further


def test_a_worker_making_its_dirs_survives_a_spare_renamed_over_them(tmp_path, monkeypatch):
    """The supervisor may rename a spare session directory over the empty
    parent a starting worker has just made; the worker's next mkdir inside
    the replaced directory then fails with ENOENT (what the kernel answers
    for a mkdir in a deleted directory). The worker tries again and finds
    the spare's directories."""
    from hermes_sup.worker import main as worker_main

    spare, session = tmp_path / "spare", tmp_path / "sessions" / "s1"
    (spare / "workspace").mkdir(parents=True)
    session.parent.mkdir()
    real_mkdir, raced = os.mkdir, []

    def mkdir_losing_the_race(path, mode=0o777, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        if Path(path) == session / "workspace" and session.exists() and not raced:
            raced.append(path)
            os.rename(spare, session)  # the supervisor's rename, over the empty parent
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real_mkdir(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir_losing_the_race)
    worker_main._make_dir(session / "workspace")
    assert raced and (session / "workspace").is_dir() and not spare.exists()
