"""An idle session hibernates: its worker stops, `list` shows it
`hibernated`, and its next turn wakes it with what it had; one with a
process of its own still running does not. Real supervisors and workers."""

from __future__ import annotations

import os
from functools import partial

from . import waiting

wait_for = partial(waiting.wait_for, timeout=60.0, every=0.1)


def rows(sup) -> dict[str, dict]:  # noqa: ANN001
    with sup.client() as c:
        return {row["key"]: row for row in c.sessions()}


def test_an_idle_session_hibernates_and_its_next_turn_wakes_it(supervisor_factory):
    sup = supervisor_factory("--idle-timeout", "1")
    with sup.client() as c:
        assert c.run("alice", "setenv COLOR blue").ok
        # What the session decides of itself is kept; what the supervisor
        # decided for it (its key) is its own again when it wakes.
        assert c.run("alice", "setenv HERMES_SESSION_KEY mallory").ok
        assert c.run("alice", "write notes.txt kept").ok
        first = int(c.run("alice", "pid").text)
        # A background job of its own keeps a session awake.
        assert c.run("bob", "sh sleep 300 >/dev/null 2>&1 &").ok
        bob = rows(sup)["bob"]["pid"]
    wait_for(lambda: rows(sup)["alice"]["state"] == "hibernated", what="alice hibernated")
    assert rows(sup)["alice"]["pid"] is None
    with sup.client() as c:
        assert [r["key"] for r in c.sessions(state="hibernated")] == ["alice"]
    waiting.wait_for(
        lambda: "hibernate_deferred session=bob" in sup.log(), timeout=60, what="bob checked"
    )
    assert rows(sup)["bob"]["state"] == "idle" and rows(sup)["bob"]["pid"] == bob
    wait_for(lambda: not os.path.exists(f"/proc/{first}"), what="alice's worker gone")

    # Woken by its next turn: its environment (what setenv set) and files.
    with sup.client() as c:
        assert c.run("alice", "env COLOR").text == "blue"
        assert c.run("alice", "env HERMES_SESSION_KEY").text == "alice"
        assert c.run("alice", "sh cat notes.txt").ok
        assert rows(sup)["alice"]["state"] == "idle"
        assert int(c.run("alice", "pid").text) != first
    # A hibernated session is killed and purged as any stopped one.
    wait_for(lambda: rows(sup)["alice"]["state"] == "hibernated", what="alice asleep again")
    with sup.client() as c:
        c.kill("alice", purge=True)
        assert "alice" not in {r["key"] for r in c.sessions()}
        c.kill("bob", force=True)
