"""A session kept awake by background processes alone hibernates after
`max_awake`: its processes get SIGTERM (one that ignores it, SIGKILL after
the grace), never its worker by either; it hibernates as usual, the log and
`inspect` say why; an exempt session stays awake. Real supervisors."""

from __future__ import annotations

from functools import partial

from . import waiting

wait_for = partial(waiting.wait_for, timeout=60.0, every=0.1)


def state(sup, key: str) -> str:  # noqa: ANN001
    with sup.client() as c:
        return {row["key"]: row for row in c.sessions()}[key]["state"]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def test_background_processes_are_ended_after_the_awake_cap_and_the_session_hibernates(
    supervisor_factory,
):
    sup = supervisor_factory(
        "--idle-timeout", "1", "--max-awake", "3", "--awake-grace", "2",
        "--awake-exempt", "keep*",
    )  # fmt: skip
    # One that leaves on SIGTERM, one that must be SIGKILLed.
    polite = "sh sleep 1000 >/dev/null 2>&1 & echo started"
    stubborn = "sh sh -c 'trap \"\" TERM; while :; do sleep 1; done' >/dev/null 2>&1 & echo started"
    with sup.client() as c:
        c.run("bob", polite)
        c.run("bob", stubborn)
        c.run("keeper", polite)
        worker = c.inspect("bob")["pid"]
        kept = c.inspect("keeper")["pid"]
    wait_for(lambda: "awake_cap session=bob" in sup.log(), what="bob's processes told")
    wait_for(lambda: state(sup, "bob") == "hibernated", what="bob hibernated")
    wait_for(lambda: not alive(worker), what="bob's worker gone")
    text = sup.log()
    told = next(line for line in text.splitlines() if "awake_cap session=bob" in line)
    # The sleep, the trapping shell and its current sleep: not the worker.
    assert int(told.split("processes=")[1].split()[0]) >= 2 and "signal=SIGTERM" in told, told
    killed = text.split("awake_cap_killed session=bob processes=", 1)[1].split()[0]
    assert int(killed) >= 1  # the one that ignored SIGTERM
    with sup.client() as c:
        capped = c.inspect("bob")["awake_capped"]
        assert capped["processes"] >= 2 and "max_awake" in capped["note"], capped
        history = c.inspect("bob")["state_history"]
        assert any("hibernated" in (h.get("reason") or "") for h in history), history
        # The exempt session is awake, its worker and background process with it.
        assert state(sup, "keeper") == "idle" and alive(kept)
        assert c.inspect("keeper")["awake_capped"] is None
        # Bob wakes as any hibernated session.
        assert c.run("bob", "sh echo back").ok
        c.kill("keeper", force=True)
    assert "awake_cap session=keeper" not in sup.log()
