"""The agent runtime interface a worker runs, and how one is chosen.

A runtime handles one turn at a time: text in, a stream of events out through
`emit`, and a final reply. It runs in a worker process that belongs to one
session, so it may use os.environ, the current directory and module globals
freely: no other session can see them.

`--agent probe` names a built-in runtime; `--agent package.module:factory`
names any callable that takes a `SessionInfo` and returns a runtime.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

# emit(event_type, data): stream one event of the running turn to its client.
Emit = Callable[[str, Any], None]

BUILTIN_RUNTIMES = {
    "probe": "hermes_sup.worker.probe:ProbeRuntime",
    "hermes": "hermes_sup.worker.hermes:HermesRuntime",
}


@dataclass(frozen=True)
class SessionInfo:
    """What a runtime knows about the session it serves."""

    key: str
    workspace: Path
    home: Path
    options: dict[str, Any] = field(default_factory=dict)
    # The runtime's settings: the supervisor's --agent-config with this
    # session's `agent` options on top (secrets resolved, never in os.environ).
    config: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TurnReply:
    """A turn's final answer: text, plus optional structured data."""

    text: str
    data: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Runtime(Protocol):
    """One agent serving one session."""

    def run_turn(self, text: str, emit: Emit) -> TurnReply | str:
        """Handle one message; stream events with `emit`; return the reply."""
        ...


class TakesContext(Protocol):
    """A runtime whose turns can come with a front end's context."""

    def run_turn(
        self, text: str, emit: Emit, context: dict[str, Any] | None = None
    ) -> TurnReply | str: ...


def takes_context(runtime: Runtime) -> bool:
    """Whether the runtime's run_turn takes a turn's `context` (a keyword
    argument: `run_turn(text, emit, context=None)`), which front ends send
    with the text: instructions, conversation history, ... (PROTOCOL.md)."""
    try:
        params = inspect.signature(runtime.run_turn).parameters
    except (TypeError, ValueError):
        return False
    return "context" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


class Cancellable(Protocol):
    """A runtime that can interrupt its running turn (called from another thread)."""

    def cancel(self) -> None: ...


class RuntimeLoadError(Exception):
    """The runtime named by --agent cannot be imported or built."""


def resolve(spec: str) -> Callable[[SessionInfo], Runtime]:
    """Import the factory named by `spec` (a built-in name or module:attr)."""
    target = BUILTIN_RUNTIMES.get(spec, spec)
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise RuntimeLoadError(
            f"agent runtime {spec!r} is neither a built-in ({', '.join(BUILTIN_RUNTIMES)}) "
            "nor module:attr"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise RuntimeLoadError(
            f"cannot import {module_name!r}: {type(exc).__name__}: {exc}"
        ) from exc
    try:
        factory = getattr(module, attr)
    except AttributeError:
        raise RuntimeLoadError(f"{module_name!r} has no attribute {attr!r}") from None
    if not callable(factory):
        raise RuntimeLoadError(f"{target!r} is not callable")
    return factory


def load(spec: str, session: SessionInfo) -> Runtime:
    """Build the runtime for one session."""
    factory = resolve(spec)
    try:
        runtime = factory(session)
    except Exception as exc:
        raise RuntimeLoadError(f"{spec!r} failed to start: {type(exc).__name__}: {exc}") from exc
    if not callable(getattr(runtime, "run_turn", None)):
        raise RuntimeLoadError(f"{spec!r} returned {type(runtime).__name__}, which has no run_turn")
    return runtime
