"""The session table as a table: its transitions read no file, so a state
change costs what the table does, and the fencing of a turn's start (the
one read of a session's epoch file on the way) is the turns' own step,
through the ownership. The real parts, with a fake pool and fake endpoints."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from hermes_sup.protocol import Kind
from hermes_sup.supervisor import leases
from hermes_sup.supervisor.states import Event, State

from .fakes import Rig


@pytest.fixture
def rig(tmp_path, monkeypatch) -> Callable[..., Rig]:
    return lambda **settings: Rig(tmp_path, monkeypatch, **settings)


def count_epoch_reads(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every check of a session's epoch from now on, by directory (a read
    of its file: a new open where the data directory is shared, a pread
    on the lease's descriptor where it is not)."""
    read: list[Path] = []
    real = leases.Leases.check

    def counted(self: leases.Leases, lease: leases.Lease) -> None:
        read.append(Path(lease.dir))
        real(self, lease)

    monkeypatch.setattr(leases.Leases, "check", counted)
    return read


def test_a_transition_reads_no_file(rig, monkeypatch) -> None:
    h = rig()

    async def scenario() -> None:
        h.send("a", "hi")
        await h.started("a")
        h.reply("a", "hello")
        session = h.table.require("a")
        assert session.state is State.IDLE and session.lease is not None
        read = count_epoch_reads(monkeypatch)
        h.table.transition(session, Event.TURN)
        h.table.transition(session, Event.DONE)
        assert read == []
        assert session.lease is not None  # nothing was fenced, nothing given up

    h.run(scenario())


def test_a_turns_start_is_fenced_by_the_turns(rig, monkeypatch) -> None:
    h = rig()

    async def scenario() -> None:
        h.send("a", "hi")
        await h.started("a")
        h.reply("a", "hello")
        session = h.table.require("a")
        read = count_epoch_reads(monkeypatch)
        second = h.send("a", "again")
        assert session.dir in read  # the epoch there was checked before it ran
        assert [m.id for m in h.to_worker("a", Kind.TURN)][-1] == second

    h.run(scenario())


def test_a_session_taken_over_loses_its_turn_at_its_start(rig, monkeypatch) -> None:
    h = rig()

    async def scenario() -> None:
        h.send("a", "hi")
        await h.started("a")
        h.reply("a", "hello")
        session = h.table.require("a")
        lease = session.lease
        assert lease is not None
        # Another supervisor took the session while this one was cut off.
        leases.write_epoch(session.dir, lease.epoch + 1, "theirs")
        h.send("a", "again")
        assert session.lease is None  # given up at the turn's start

    h.run(scenario())
