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
    assert sorted(p.name for p in a.iterdir()) == [
        "home",
        "tmp",
        "user",
        "workspace",
    ]  # no leases here
    assert a.stat().st_mode & 0o777 == 0o700

    b = sessions / "bbbb"
    (b / "workspace").mkdir(parents=True)  # the worker got there first
    assert not spares.take(b)
    assert sorted(p.name for p in b.iterdir()) == ["workspace"] and len(spares.free) == 1

    c = sessions / "cccc"
    assert spares.take(c, with_workspace=False)  # its workspace is elsewhere
    assert sorted(p.name for p in c.iterdir()) == ["home", "tmp", "user"]
    assert not spares.take(sessions / "dddd")  # none left
    spares.refill(5)
    assert len(spares.free) == 2  # up to the target, no further


def test_two_supervisors_on_one_data_dir_never_share_or_remove_each_others_spares(
    tmp_path: Path,
) -> None:
    """Each supervisor keeps its spares under a directory of its own (named
    by its node, and locked while it runs), even two with one node name;
    one that starts removes the spares of those that are gone, never a live
    one's."""
    from hermes_sup.supervisor.leases import Leases
    from hermes_sup.supervisor.spare_dirs import SPARE_DIR, SpareDirs

    base = tmp_path / SPARE_DIR
    a, b = SpareDirs(tmp_path, target=3), SpareDirs(tmp_path, target=3)
    a.serve("node-a", Leases("node-a"))
    b.serve("node-a", Leases("node-a"))  # the same name, by mistake
    a.reset()
    a_spares = sorted(p for p, _ in a.free)
    b.reset()  # must leave a's spares alone
    assert all(p.is_dir() for p in a_spares) and sorted(p for p, _ in a.free) == a_spares
    assert a.root != b.root and a.root.name.startswith("node-a-")
    assert not {p for p, _ in a.free} & {p for p, _ in b.free}
    # Both numbered theirs from 0, each in its own directory.
    assert {p.name for p, _ in a.free} == {p.name for p, _ in b.free} == {"0", "1", "2"}

    # Each spare comes with its session lease taken, and keeps it through the rename.
    dest = tmp_path / "sessions" / "k1"
    lease = a.take_leased(dest)
    assert lease is not None and lease.dir == dest and lease.epoch == 1
    assert b.leases is not None and b.leases.holder_elsewhere(dest) is not None

    # a stops (its locks go with its descriptors): the next to start sweeps a's spares.
    assert a._lock_fd is not None
    os.close(a._lock_fd)
    a.release_all()
    c = SpareDirs(tmp_path, target=1)
    c.serve("node-c", Leases("node-c"))
    c.reset()
    assert not a.root.exists() and b.root.is_dir() and c.root.is_dir()
    assert sorted(p.name for p in base.iterdir()) == sorted(
        [b.root.name, b.root.name + ".lock", c.root.name, c.root.name + ".lock"]
    )


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


def test_a_supervisor_makes_spares_again_after_turns_and_after_sessions_without_one(
    supervisor_factory,
) -> None:
    """Spare session directories taken by new sessions are made again: after
    a turn ends for those that came with one, and a moment later for those
    opened without a turn. More new sessions than there are spares, so each
    batch would run them dry otherwise."""
    from hermes_sup.supervisor.spare_dirs import SPARE_DIR

    from .waiting import wait_for

    sup = supervisor_factory()
    base = sup.data_dir / SPARE_DIR

    def spares() -> int:
        return sum(1 for p in base.glob("*/*") if p.is_dir())

    full = wait_for(spares, what="the first spares")
    with sup.client(timeout=30) as client:
        for i in range(full + 2):
            assert client.run(f"turned{i}", "pid").ok
        wait_for(lambda: spares() == full, what="spares after turns")
        for i in range(full + 2):
            client.open(f"opened{i}")
        wait_for(lambda: spares() == full, what="spares after sessions without a turn")
        made = sorted(p.name for p in (sup.data_dir / "sessions").iterdir())
    assert len(made) == 2 * (full + 2)
