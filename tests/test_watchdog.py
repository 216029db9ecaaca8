"""The node agent's watchdog and how Ray nodes are named: the counting on
fakes, and a real supervisor stopped with SIGSTOP, found out and killed."""

from __future__ import annotations

import os
import signal
import time

import pytest

from hermes_sup.cluster.nodes import NodeConfigError
from hermes_sup.cluster.ray_nodes import (
    CAPACITY_LABEL,
    NAME_LABEL,
    name_alive,
    node_address,
    node_capacity,
    plan_agents,
)
from hermes_sup.cluster.watchdog import Watchdog, WatchdogSettings, ping_supervisor

from . import waiting


class Pings:
    """Answers as scripted; records kills."""

    def __init__(self, answers: list[bool]) -> None:
        self.answers = answers
        self.killed: list[tuple[int, int]] = []

    def ping(self, timeout: float) -> bool:
        return self.answers.pop(0)

    def kill(self, pid: int, sig: int) -> None:
        self.killed.append((pid, sig))


def test_misses_in_a_row_kill_and_an_answer_starts_the_count_over() -> None:
    pings = Pings([True, False, False, True, False, False, False])
    dog = Watchdog(42, WatchdogSettings(misses=3), pings.ping, pings.kill)
    outcomes = [dog.check() for _ in range(7)]
    assert outcomes[:6] == [None] * 6 and pings.killed == [(42, signal.SIGKILL)]
    assert outcomes[6] is not None and "missed 3 pings" in outcomes[6]


def test_a_starting_supervisor_has_its_grace() -> None:
    pings = Pings([False] * 5)
    dog = Watchdog(7, WatchdogSettings(misses=1, start_grace=3600), pings.ping, pings.kill)
    assert [dog.check() for _ in range(5)] == [None] * 5 and not pings.killed
    dog.started -= 7200  # an hour past its grace, never having answered
    pings.answers.append(False)
    assert "within 3600s of its start" in (dog.check() or "")


@pytest.mark.parametrize(("field", "value"), [("every", 0.0), ("timeout", -1.0), ("misses", 0)])
def test_unusable_settings_are_named(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field.replace("every", "interval")):
        WatchdogSettings(**{field: value}).check()  # type: ignore[arg-type]


def test_a_stopped_supervisor_is_killed_after_its_misses(supervisor_factory) -> None:  # noqa: ANN001
    sup = supervisor_factory()
    with sup.client() as c:
        worker = int(c.run("k", "pid").text)
    settings = WatchdogSettings(every=0.2, timeout=0.5, misses=3)
    dog = Watchdog(sup.pid, settings, lambda t: ping_supervisor(sup.state_dir, t))
    assert dog.check() is None and dog.answered
    os.kill(sup.pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    why = dog.run(lambda wait: time.sleep(wait) or time.monotonic() - stopped_at > 60)
    assert "missed 3 pings" in why
    assert sup.proc.wait(10 * waiting.load_factor()) == -signal.SIGKILL
    # Its workers follow it (their parent-death signal).
    waiting.wait_for(lambda: not os.path.exists(f"/proc/{worker}"), what="its worker gone")


def node(node_id: str, host: str = "h1", alive: bool = True, **labels: str) -> dict:
    return {"NodeID": node_id, "NodeManagerHostname": host, "Alive": alive,
            "NodeManagerAddress": "127.0.0.1", "Labels": labels}  # fmt: skip


def test_nodes_are_named_by_label_else_host_and_never_twice() -> None:
    nodes = [
        node("a" * 56, "web1.example.org"),
        node("b" * 56, "web2", **{NAME_LABEL: "blue"}),
        node("c" * 56, "web1"),  # another raylet on web1, unlabelled
        node("d" * 56, "web3", alive=False),
        node("e" * 56, "bad host!"),
    ]
    named, problems = name_alive(nodes)
    assert named == {"a" * 56: "web1", "b" * 56: "blue"}
    assert len(problems) == 2
    assert "both named 'web1'" in problems[0] and NAME_LABEL in problems[0]
    assert "no usable name" in problems[1]
    # A restarted raylet (a new NodeID) on the same host keeps the name.
    again, _ = name_alive([node("f" * 56, "web1.example.org")])
    assert again == {"f" * 56: "web1"}


def test_capacity_and_address_come_from_what_ray_says() -> None:
    assert node_capacity(node("a"), 1.0) == 1.0
    assert node_capacity(node("a", **{CAPACITY_LABEL: "250"}), 1.0) == 250.0
    for bad in ("0", "-3", "lots", "inf"):
        with pytest.raises(NodeConfigError, match=CAPACITY_LABEL):
            node_capacity(node("a", **{CAPACITY_LABEL: bad}), 1.0)
    assert node_address([node("x"), {**node("y"), "NodeManagerAddress": "10.1.2.3"}], "y") == (
        "10.1.2.3"
    )
    with pytest.raises(LookupError):
        node_address([node("x")], "z")


def test_with_a_resource_only_nodes_declaring_it_get_an_agent_reserving_all_of_it() -> None:
    nodes = [
        {**node("a" * 8, "h1"), "Resources": {"hermes_sup": 200.0, "CPU": 4.0}},
        {**node("b" * 8, "h2"), "Resources": {"CPU": 4.0}},
        {**node("c" * 8, "h3", **{CAPACITY_LABEL: "50"}), "Resources": {"hermes_sup": 80.0}},
    ]
    plans, problems = plan_agents(nodes, 1.0, "hermes_sup")
    assert [(p.name, p.capacity, p.reserve) for p in plans] == [
        ("h1", 200.0, {"hermes_sup": 200.0}),
        ("h3", 50.0, {"hermes_sup": 80.0}),  # its label weighs it; it still reserves all
    ]
    assert problems == ["node 'h2' declares no 'hermes_sup' resource: no agent there"]
    plans, problems = plan_agents(nodes, 2.0)
    assert [(p.name, p.capacity, p.reserve) for p in plans] == [
        ("h1", 2.0, {}), ("h2", 2.0, {}), ("h3", 50.0, {}),
    ]  # fmt: skip
    assert not problems
