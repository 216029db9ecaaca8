"""Leases on a data directory only this host uses: the epoch and the turn
journal are kept open while the lease is held (a turn opens neither), the
fence still catches an epoch that is not ours, the journal still rotates,
and there is no lease watch. And how a data directory is known to be
shared."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hermes_sup.protocol import Kind, Message, session_dir_name
from hermes_sup.supervisor import leases
from hermes_sup.supervisor.journal import JOURNAL_FILE, JOURNAL_TURNS, OLDER_FILE, TurnJournal, read
from hermes_sup.supervisor.lease_watch import LeaseWatch


def open_files(pid: int) -> set[str]:
    """The paths of the files a process holds open."""
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            found.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue  # closed meanwhile
    return found


def test_a_local_lease_reads_its_epoch_on_the_descriptor_it_keeps(tmp_path: Path) -> None:
    lease = leases.Leases("me", shared=False).take(tmp_path)
    assert lease.epoch_fd is not None
    assert str(tmp_path / leases.EPOCH_FILE) in open_files(os.getpid())
    owner = leases.Leases("me", shared=False)
    owner.check(lease)  # ours
    # Something that ignored the lock wrote another epoch: the fence sees it.
    leases.write_epoch(tmp_path, lease.epoch + 1, "f" * 16)
    with pytest.raises(leases.LeaseLost, match="taken over"):
        owner.check(lease)
    owner.release(lease)
    assert lease.epoch_fd is None
    assert str(tmp_path / leases.EPOCH_FILE) not in open_files(os.getpid())
    # The next taker counts on from what the file says.
    again = owner.take(tmp_path)
    assert again.epoch == lease.epoch + 2
    owner.release(again)


def test_a_shared_lease_keeps_no_epoch_descriptor(tmp_path: Path) -> None:
    owner = leases.Leases("me", shared=True)
    lease = owner.take(tmp_path)
    assert lease.epoch_fd is None
    assert leases.read_epoch(tmp_path) == (lease.epoch, lease.token)
    owner.check(lease)
    owner.release(lease)


def test_which_data_directories_count_as_shared(tmp_path: Path) -> None:
    assert leases.file_system_type(tmp_path) in leases.LOCAL_FILE_SYSTEMS
    assert leases.data_dir_shared(tmp_path) is False
    assert leases.data_dir_shared(tmp_path / "not" / "made" / "yet") is False
    assert leases.data_dir_shared(tmp_path, "yes") is True
    assert leases.data_dir_shared(Path("/proc/self"), "no") is False
    # A type not known to be local is taken to be shared: the safe side.
    assert leases.data_dir_shared(Path("/proc/self")) is True


def test_a_local_journal_is_kept_open_and_still_rotates(tmp_path: Path) -> None:
    session: Any = SimpleNamespace(key="k", dir=tmp_path)
    journal = TurnJournal("me", lambda s: True, shared=False)
    journal.taken(session)
    for i in range(JOURNAL_TURNS + 5):  # past one rotation
        assert journal.started(session, f"t{i}") is None
        assert str(tmp_path / JOURNAL_FILE) in open_files(os.getpid())
        journal.ended(session, Message(Kind.REPLY, {"text": str(i)}, re=f"t{i}"), 10)
    assert (tmp_path / OLDER_FILE).exists()
    entries, _, _ = read(tmp_path)
    assert all(entries[f"t{i}"].ended is not None for i in range(JOURNAL_TURNS + 5))
    journal.released(session)
    assert not journal.fds
    assert not {p for p in open_files(os.getpid()) if p.startswith(str(tmp_path))}


def test_there_is_no_lease_watch_where_leases_cannot_be_lost() -> None:
    watch = LeaseWatch({}, SimpleNamespace(shared=False), every=0.001)  # type: ignore[arg-type]
    # It returns instead of looping (a loop would never end this wait).
    asyncio.run(asyncio.wait_for(watch.run(), timeout=60))


@pytest.mark.e2e
def test_a_live_session_on_a_local_disk_holds_its_epoch_and_journal_open(
    supervisor_factory: Any,
) -> None:
    """What a turn no longer opens: the supervisor keeps both files open for
    as long as it holds the session, and lets them go with the lease."""
    sup = supervisor_factory()
    with sup.client() as client:
        client.run("kept", "x")
        client.run("kept", "x")
        path = sup.data_dir / "sessions" / session_dir_name("kept")
        held = open_files(sup.pid)
        assert str(path / leases.EPOCH_FILE) in held
        assert str(path / JOURNAL_FILE) in held
        client.kill("kept")
        assert not {p for p in open_files(sup.pid) if p.startswith(str(path) + "/")}
