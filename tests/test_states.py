"""The session state table: every state can be left, a session's normal life, and
transitions not in the table."""

from __future__ import annotations

from pathlib import Path

import pytest

from hermes_sup.supervisor.environment import SessionOptions
from hermes_sup.supervisor.session import Session
from hermes_sup.supervisor.states import (
    TRANSITIONS,
    Event,
    InvalidTransition,
    Sleep,
    State,
    Stop,
    listed_state,
    next_sleep,
    next_state,
)


def test_every_state_can_be_left() -> None:
    """No state is a dead end: each has a transition out (or is EXITED, the rest state)."""
    sources = {s for s, _ in TRANSITIONS}
    assert sources == set(State)


def test_normal_life_of_a_session() -> None:
    s = State.EXITED
    for ev, want in [
        (Event.SPAWN, State.STARTING),
        (Event.HELLO, State.IDLE),
        (Event.TURN, State.BUSY),
        (Event.DONE, State.IDLE),
        (Event.KILL, State.STOPPING),
        (Event.EXIT, State.EXITED),
    ]:
        s = next_state(s, ev)
        assert s is want


@pytest.mark.parametrize(
    "state, event",
    [
        (State.EXITED, Event.TURN),
        (State.IDLE, Event.HELLO),
        (State.EXITED, Event.KILL),
        (State.STOPPING, Event.TURN),
        (State.BUSY, Event.TURN),
    ],
)
def test_transitions_not_in_the_table_raise(state: State, event: Event) -> None:
    with pytest.raises(InvalidTransition):
        next_state(state, event)


def test_a_session_stopped_for_idleness_is_listed_hibernated_until_it_spawns() -> None:
    """Sleep is beside the state: the table (and the state events) say
    EXITED; `list` says hibernated; the next spawn wakes it."""
    session = Session(key="k", dir=Path("/nonexistent"), options=SessionOptions())
    for event in (Event.SPAWN, Event.HELLO):
        session.advance(event)
    session.stopping(Stop.IDLE)
    assert session.listed_state == "idle"  # asleep only once its worker is gone
    for event in (Event.KILL, Event.EXIT):
        session.advance(event)
    assert session.state is State.EXITED and session.listed_state == "hibernated"
    session.advance(Event.SPAWN)
    assert session.sleep is Sleep.AWAKE and session.listed_state == "starting"


def test_a_kill_by_request_wakes_a_sleeping_session_and_a_plain_kill_does_not() -> None:
    # health.py stops a sleeping session's worker with an ordinary KILL:
    # that must not undo the sleep it was stopped for.
    assert next_sleep(Sleep.HIBERNATED, Event.KILL) is Sleep.HIBERNATED
    assert next_sleep(Sleep.HIBERNATED, Event.EXIT) is Sleep.HIBERNATED
    assert next_sleep(Sleep.HIBERNATED, Stop.REQUEST) is Sleep.AWAKE
    assert next_sleep(Sleep.AWAKE, Stop.IDLE) is Sleep.HIBERNATED


@pytest.mark.parametrize("state", list(State))
def test_only_an_exited_session_is_listed_hibernated(state: State) -> None:
    want = "hibernated" if state is State.EXITED else state.value
    assert listed_state(state, Sleep.HIBERNATED) == want
    assert listed_state(state, Sleep.AWAKE) == state.value
