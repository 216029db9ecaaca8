"""Session states and the only transitions allowed between them.

Theory of operation
-------------------
A session is a key with a directory of data and at most one worker process.
It starts EXITED (no process). The first message spawns a worker: STARTING.
The worker proves its token with a `hello`: IDLE. A turn sent to it: BUSY;
its reply: IDLE again. A kill makes it STOPPING until the process is reaped,
then EXITED. Its data stays; the next message spawns a fresh worker on it.

A worker that dies by itself after running a while goes to EXITED and is
restarted lazily, by the next message. One that dies soon after it was
spawned is a fast failure: the session waits in BACKOFF (exponentially
longer each time, capped) before the next spawn, and after too many fast
failures in a row, or a worker that cannot load its runtime at all, it is
FAILED: messages get a clear error until an operator kills it (which clears
it) or a cool-down passes. BACKOFF and FAILED sessions can always be killed.

An exited session may be asleep: its worker was stopped for idleness, and
`list` shows it `hibernated` until its next worker starts (SPAWN wakes
it). To the table, and in its state events, it is EXITED like any other:
sleep is a second, smaller table beside the first (`SLEEPS`), moved by the
same events and by why a worker is stopped (`Stop`).

Every change of state goes through `next_state`, so a transition not in the
table is a bug that raises at once instead of a session stuck in limbo.
"""

from __future__ import annotations

from enum import StrEnum


class State(StrEnum):
    """Where a session is in its life."""

    EXITED = "exited"  # no worker; data on disk; the next message starts one
    STARTING = "starting"  # forked, waiting for the worker's hello
    IDLE = "idle"  # worker ready, no turn running
    BUSY = "busy"  # a turn is running
    STOPPING = "stopping"  # being killed; waiting for the process to be reaped
    BACKOFF = "backoff"  # died soon after start; waiting before the next spawn
    FAILED = "failed"  # keeps failing (or cannot load); refuses turns until cleared


class Event(StrEnum):
    """What happens to a session."""

    SPAWN = "spawn"  # a worker was requested
    HELLO = "hello"  # the worker proved its token
    TURN = "turn"  # a turn was handed to the worker
    DONE = "done"  # the turn ended (reply or error)
    KILL = "kill"  # an operator or shutdown stops it
    EXIT = "exit"  # the process was reaped after running a while (or was killed)
    FAST_EXIT = "fast_exit"  # the process died soon after it was spawned
    GIVE_UP = "give_up"  # too many fast failures, or the runtime cannot load
    CLEAR = "clear"  # an operator kill, or the cool-down, clears backoff/failed


TRANSITIONS: dict[tuple[State, Event], State] = {
    (State.EXITED, Event.SPAWN): State.STARTING,
    (State.STARTING, Event.HELLO): State.IDLE,
    (State.STARTING, Event.EXIT): State.EXITED,
    (State.STARTING, Event.FAST_EXIT): State.BACKOFF,
    (State.STARTING, Event.GIVE_UP): State.FAILED,
    (State.STARTING, Event.KILL): State.STOPPING,
    (State.IDLE, Event.TURN): State.BUSY,
    (State.IDLE, Event.EXIT): State.EXITED,
    (State.IDLE, Event.FAST_EXIT): State.BACKOFF,
    (State.IDLE, Event.GIVE_UP): State.FAILED,
    (State.IDLE, Event.KILL): State.STOPPING,
    (State.BUSY, Event.DONE): State.IDLE,
    (State.BUSY, Event.EXIT): State.EXITED,
    (State.BUSY, Event.FAST_EXIT): State.BACKOFF,
    (State.BUSY, Event.GIVE_UP): State.FAILED,
    (State.BUSY, Event.KILL): State.STOPPING,
    (State.STOPPING, Event.EXIT): State.EXITED,
    # A reply can cross a kill on the wire; the session stays STOPPING.
    (State.STOPPING, Event.DONE): State.STOPPING,
    (State.BACKOFF, Event.SPAWN): State.STARTING,
    (State.BACKOFF, Event.CLEAR): State.EXITED,
    (State.FAILED, Event.CLEAR): State.EXITED,
}

# States in which a worker process exists (or is being created).
LIVE_STATES = frozenset({State.STARTING, State.IDLE, State.BUSY, State.STOPPING})


class InvalidTransition(Exception):
    """A transition not in TRANSITIONS was attempted: a bug in the supervisor."""


def next_state(state: State, event: Event) -> State:
    """The state after `event` happens in `state`, or InvalidTransition."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise InvalidTransition(f"no transition from {state.value} on {event.value}") from None


# ------------------------------------------------------------------- sleep


class Sleep(StrEnum):
    """Whether a session is asleep: stopped for idleness, not woken since."""

    AWAKE = "awake"
    HIBERNATED = "hibernated"  # listed so while EXITED; its next turn wakes it


class Stop(StrEnum):
    """Why a session's worker is being stopped, where that decides how the
    session is listed once it has exited."""

    IDLE = "idle"  # idle past idle_timeout (health.py): it hibernates
    REQUEST = "request"  # an operator's kill: plainly exited, even if asleep


# What sends a session to sleep or wakes it; anything else leaves it be
# (a KILL, say: a hibernating session is killed on its way to sleep).
SLEEPS: dict[Event | Stop, Sleep] = {
    Stop.IDLE: Sleep.HIBERNATED,
    Stop.REQUEST: Sleep.AWAKE,
    Event.SPAWN: Sleep.AWAKE,  # woken: a worker starts for it
}


def next_sleep(sleep: Sleep, cause: Event | Stop) -> Sleep:
    """Whether a session sleeps after `cause`."""
    return SLEEPS.get(cause, sleep)


def listed_state(state: State, sleep: Sleep) -> str:
    """A session's state as `list` shows it and filters by: `hibernated`
    for an exited session that is asleep, else the state itself."""
    if state is State.EXITED and sleep is Sleep.HIBERNATED:
        return Sleep.HIBERNATED.value
    return state.value


# ------------------------------------------------------------ restart policy
#
# What a worker's exit means for its session, beside the table it drives. The
# lifecycle (lifecycle.py) applies these; they decide, it acts.


def exit_event(
    was: State,
    *,
    accepting: bool,
    load_failed: bool,
    uptime: float,
    min_uptime: float,
    fast_failures: int,
    max_fast_failures: int,
) -> tuple[Event, int]:
    """The event a worker's exit is, and the session's fast failures in a
    row after it.

    A worker being stopped (or any, while the supervisor shuts down) simply
    exited. One that cannot load its runtime will never start: give up at
    once rather than retry in a loop. One that died before its hello, or
    sooner than `min_uptime` after its start, is a fast failure: back off,
    and give up after `max_fast_failures` in a row. Any other exit clears
    the count; the next message starts a fresh worker."""
    if was is State.STOPPING or not accepting:
        return Event.EXIT, fast_failures
    if load_failed:
        return Event.GIVE_UP, fast_failures
    if was is State.STARTING or uptime < min_uptime:
        fast_failures += 1
        event = Event.GIVE_UP if fast_failures >= max_fast_failures else Event.FAST_EXIT
        return event, fast_failures
    return Event.EXIT, 0


def backoff_delay(failures: int, base: float, cap: float) -> float:
    """Seconds to wait before the next start after `failures` (>= 1) fast
    failures in a row: doubling from `base`, never more than `cap`."""
    return min(cap, base * 2 ** (failures - 1))
