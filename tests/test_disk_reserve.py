"""A full data disk never makes a turn run unrecorded, so never twice.

The data directory is a 2 MiB tmpfs that one session fills from its own
shell. Another session's turn, whose start the turn journal cannot record,
is not run: its client gets `disk_full`, its id stays unspent, and after a
kill -9 and a restart of the supervisor, sending it again runs it exactly
once. With a reserve, new turns are refused before the disk is full, and
`status` and the log say so.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hermes_sup.client import SupervisorError
from hermes_sup.protocol import ErrorCode, session_dir_name

from . import test_disk_full
from .test_disk_full import fill
from .test_turn_ids import kill_hard

pytestmark = pytest.mark.e2e

# The data directory on a small tmpfs, unmounted at the end (test_disk_full.py).
small_disks = test_disk_full.small_disks


def runs(marks: Path) -> list[str]:
    return marks.read_text().split() if marks.exists() else []


def fill_from_session(client, key: str, data_dir: Path) -> Path:  # noqa: ANN001
    """Session `key` fills the data disk from its own shell (its workspace
    is on it); what its last write could not take is squeezed in after."""
    client.run(key, "sh dd if=/dev/zero of=big bs=64k 2>/dev/null; echo filled")
    workspace = data_dir / "sessions" / session_dir_name(key) / "workspace"
    fill(workspace)
    return workspace


def test_a_turn_that_cannot_be_journaled_is_not_run_and_runs_once_when_sent_again(
    supervisor_factory, small_disks, workdir: Path
) -> None:
    data = small_disks("d")
    marks = workdir / "ran.txt"  # off the full disk: each run of the turn adds a line
    # Unsealed: the turn marks its run outside its own directory.
    sup = supervisor_factory("--sealed", "off", "--disk-reserve", "0", "--min-uptime", "0")
    turn = f"sh echo run >> {marks}; echo done"
    with sup.client() as c:
        assert c.run("victim-warm", "sh echo warm").ok  # the runtime is known to start
        filled = fill_from_session(c, "filler", data)
        with pytest.raises(SupervisorError) as err:
            c.run("victim", turn, turn_id="t-full")
        assert err.value.code == ErrorCode.DISK_FULL.value, err.value
        assert "was not run" in str(err.value) and "No space left" in str(err.value)
        assert runs(marks) == []
        # Still unspent: a retry while full is refused the same way, not `replayed`.
        with pytest.raises(SupervisorError) as again:
            c.run("victim", turn, turn_id="t-full")
        assert again.value.code == ErrorCode.DISK_FULL.value
        assert c.turn_status("victim", "t-full")["state"] == "unknown"
    kill_hard(sup)
    for leftover in filled.iterdir():
        leftover.unlink()
    sup.start()
    with sup.client() as c:
        # "unknown: sending it again runs it once" is the truth now.
        assert c.turn_status("victim", "t-full")["state"] == "unknown"
        assert c.run("victim", turn, turn_id="t-full").ok
        repeat = c.run("victim", turn, turn_id="t-full")  # answered from memory
        assert repeat.ok
    kill_hard(sup)
    sup.start()
    with sup.client() as c:
        assert c.turn_status("victim", "t-full")["state"] == "ended"
        assert c.run("victim", turn, turn_id="t-full").ok  # answered from the journal
    sup.stop()
    assert runs(marks) == ["run"]
    text = sup.log()
    assert "turn_refused_disk_full session=victim turn=t-full" in text
    assert "Traceback" not in text


def test_below_the_reserve_new_turns_are_refused_and_status_says_so(
    supervisor_factory, small_disks
) -> None:
    data = small_disks("d")
    sup = supervisor_factory("--sealed", "off", "--disk-reserve", "1")
    with sup.client() as c:
        assert c.run("bystander", "sh echo hi", turn_id="t-before").ok
        reserve = c.status()["disk"]["reserve"]
        assert reserve["reserve_mb"] == 1 and reserve["refusing_turns"] is False
        # Filled from a session's shell to within the reserve: what it wrote last
        # went through (its turn was running), new turns do not start.
        c.run("filler", "sh dd if=/dev/zero of=big bs=64k count=20 2>/dev/null; echo ok")
        with pytest.raises(SupervisorError) as err:
            c.run("bystander", "sh echo again")
        assert err.value.code == ErrorCode.DISK_FULL.value
        assert "reserve of 1 MiB" in str(err.value)
        status = c.status()["disk"]["reserve"]
        assert status["refusing_turns"] is True and status["free_mb"] < 1
        # A repeat of a turn that ran is still answered (nothing is written).
        assert c.run("bystander", "sh echo hi", turn_id="t-before").ok
        # Room again: new turns run.
        (data / "sessions" / session_dir_name("filler") / "workspace" / "big").unlink()
        assert c.run("bystander", "sh echo back").ok
        assert c.status()["disk"]["reserve"]["refusing_turns"] is False
    sup.stop()
    text = sup.log()
    assert text.count("disk_reserve_low") == 1 and text.count("disk_reserve_ok") == 1
    assert "Traceback" not in text
