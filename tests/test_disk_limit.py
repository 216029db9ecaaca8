"""A session's disk bound, where the kernel cannot enforce it: the sampler
adds up a session's workspace, home and tmp a slice per tick and stops a
session over its limit with the reason `disk`; `status` says which
mechanism is in force and why. Real supervisor, a session's own shell."""

from __future__ import annotations

from functools import partial

import pytest

from hermes_sup.supervisor.disk import Walk, walk_some

from . import waiting

wait_for = partial(waiting.wait_for, timeout=60.0, every=0.1)

pytestmark = pytest.mark.e2e


def test_a_session_writing_past_its_disk_limit_is_stopped_with_the_reason_disk(
    supervisor_factory,
):
    sup = supervisor_factory("--disk-limit", "2", "--disk-interval", "0.2")
    with sup.client() as c:
        limit = c.status()["disk"]["limit"]
        # This machine's data disk has no project quotas: the sampler, and why.
        assert limit["enforced_by"] == "sampler" and "project quotas" in limit["why"], limit
        assert c.run("small", "sh echo hi > note.txt").ok
        # A background writer: the session is stopped while it writes.
        c.run("hog", "sh dd if=/dev/zero of=big bs=64k count=80 2>/dev/null; echo wrote")
        wait_for(lambda: "disk_limit_exceeded session=hog" in sup.log(), what="hog stopped")
        wait_for(lambda: c.inspect("hog")["state"] != "idle", what="hog's worker gone")
        wait_for(lambda: c.inspect("hog")["pid"] is None, what="hog exited")
        inspect = c.inspect("hog")
        assert "disk limit" in (inspect["last_exit"] or ""), inspect["last_exit"]
        assert "reason: disk" in inspect["last_exit"]
        # The neighbour is served; its usage is shown.
        assert c.run("small", "sh cat note.txt").ok
        wait_for(lambda: c.inspect("small")["disk_used"] is not None, what="small sampled")
        assert c.inspect("small")["disk_used"] < 2 * 1024 * 1024
    sup.stop()
    assert "Traceback" not in sup.log()


def test_the_walk_takes_a_slice_at_a_time_and_never_follows_links(tmp_path):
    root = tmp_path / "ws"
    (root / "deep").mkdir(parents=True)
    for i in range(50):
        (root / "deep" / f"f{i}").write_bytes(b"x" * 4096)
    (root / "link").symlink_to("/usr")  # planted: never walked
    (root / "hard").hardlink_to(root / "deep" / "f0")  # counted once
    walk = Walk((root,))
    walk.start()
    slices = 0
    while True:
        looked, done = walk_some(walk, 7)
        assert looked <= 7
        slices += 1
        if done:
            break
    assert slices >= 50 // 7
    assert 50 * 4096 <= walk.total < 60 * 4096


def test_an_idle_session_alone_since_its_last_walk_is_not_walked_again(tmp_path):
    """A round costs the sessions active since their last walk: one idle,
    with no process of its own, since then is walked only every
    SETTLED_ROUNDS rounds (its worker alone could still write)."""
    from types import SimpleNamespace

    from hermes_sup.supervisor.disk import SETTLED_ROUNDS, DiskSampler

    dirs = {name: tmp_path / name for name in ("workspace", "home", "user", "tmp")}
    for path in dirs.values():
        path.mkdir()
    session = SimpleNamespace(**dirs, last_activity=1.0, idle=True, alone=True, disk_used=0)
    sampler = DiskSampler(
        lambda s: 100,
        lambda: 1.0,
        lambda s, why: None,
        idle_since=lambda s: s.last_activity if s.idle else None,
        quiet=lambda s: s.alone,
    )

    def one_round(now: float) -> int:
        sampler.tick(now, {"k": session})
        return session.disk_used

    assert one_round(0.0) == 0
    (dirs["workspace"] / "f").write_bytes(b"x" * 8192)  # as if written meanwhile
    assert one_round(2.0) == 0  # idle and alone since: not walked
    # ... but walked again after SETTLED_ROUNDS all the same (a worker that
    # writes on its own while idle is caught, later).
    now = 2.0
    for _ in range(SETTLED_ROUNDS - 2):
        now += 2.0
        assert one_round(now) == 0
    now += 2.0
    assert one_round(now) >= 8192
    (dirs["workspace"] / "f2").write_bytes(b"x" * 8192)
    session.last_activity = now  # a turn: walked at the next round
    assert one_round(now + 2.0) >= 2 * 8192
    (dirs["workspace"] / "f2").unlink()
    # A turn that left a process of its own running: walked every round.
    session.last_activity, session.alone = 100.0, False
    (dirs["workspace"] / "g").write_bytes(b"x" * 8192)
    assert one_round(102.0) >= 2 * 8192
    (dirs["workspace"] / "h").write_bytes(b"x" * 8192)
    assert one_round(104.0) >= 3 * 8192
