"""The session state table: every state can be left, a session's normal life, and
transitions not in the table."""

from __future__ import annotations

import pytest

from hermes_sup.supervisor.states import (
    TRANSITIONS,
    Event,
    InvalidTransition,
    State,
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
