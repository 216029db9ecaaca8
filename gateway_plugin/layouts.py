"""Where a Hermes release keeps its gateway's remote-turn method, and how it calls it.

Hermes has no hook for a plugin to run a gateway session's turns; its proxy
mode is one method, `_run_agent_via_proxy`, that the gateway calls for every
turn when GATEWAY_PROXY_URL is set. Releases move it and change what it is
given: 0.19 defines it on `GatewayRunner` itself; 0.21 moved it into
`GatewayTurnExecutionMixin` (gateway/run_turn_execution.py), added
`scheduled_heartbeat` and `input_snapshot`, and finds a chat's adapter with
`_delivery_adapter_for`.

A `Layout` is one such contract: the method's parameters, in order, and
the runner methods the plugin then uses. The installed Hermes is probed,
not trusted by its version number: the layout whose parameters match the
method the runner has, with every helper present, is the one used; a
release keeping a known layout works unchanged, and one that changes it
matches none (pinned.py then refuses every turn, saying why).
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

METHOD = "_run_agent_via_proxy"
# Attribute marking a method as the plugin's (installed once, never wrapped twice).
MARK = "_hermes_sup_plugin"
LAYOUT = "_hermes_sup_layout"  # on the plugin's method: the layout it was made for
# Runner methods both layouts have and the plugin uses.
COMMON_HELPERS = (
    "_get_proxy_url",
    "_thread_metadata_for_source",
    "_is_session_run_current",
    "_deliver_completion_notification",
)
# Module-level helpers of `gateway.run` and `tools.approval` the plugin uses
# (0.21's run_turn_execution.py imports the gateway.run ones from there too).
MODULE_HELPERS = (
    ("tools.approval", "_await_gateway_decision"),
    ("gateway.run", "_format_exec_approval_fallback"),
    ("gateway.run", "_redact_approval_command"),
    ("gateway.run", "_platform_config_key"),
    ("gateway.run", "_load_gateway_config"),
)


class NotPinned(Exception):
    """The installed Hermes has no layout the plugin knows; says why."""


@dataclass(frozen=True)
class TurnCall:
    """One turn as the gateway asked for it, whichever layout asked."""

    message: str
    context_prompt: str
    history: list[dict[str, Any]]
    source: Any
    session_id: str | None
    session_key: str | None = None
    run_generation: int | None = None
    event_message_id: str | None = None
    # 0.21: a scheduled heartbeat is proactive work: no typing indicator and
    # no streamed draft, only its final answer (as upstream's proxy does).
    quiet: bool = False
    # 0.21: the inbound message, prepared; re-rendered just before it is
    # sent (it may have gained context since the turn was queued).
    input_snapshot: Any = None


RunTurn = Callable[[Any, "Layout", TurnCall], Awaitable[dict[str, Any]]]


@dataclass(frozen=True)
class Layout:
    """One release's contract for the remote-turn method."""

    name: str  # for logs and refusals: "hermes-agent 0.19 (GatewayRunner)"
    params: tuple[str, ...]  # the method's parameters, in order, with self
    adapter_method: str  # the runner method that finds a chat's adapter
    make: Callable[[RunTurn, Layout], Callable[..., Awaitable[dict[str, Any]]]]

    @property
    def helpers(self) -> tuple[str, ...]:
        return (*COMMON_HELPERS, self.adapter_method)


def _make_019(run: RunTurn, layout: Layout) -> Callable[..., Awaitable[dict[str, Any]]]:
    # The exact signature of 0.19's GatewayRunner._run_agent_via_proxy
    # (gateway/run.py), which _run_agent_inner calls by keyword.
    async def _run_agent_via_proxy(
        self: Any,
        message: str,
        context_prompt: str,
        history: list[dict[str, Any]],
        source: Any,
        session_id: str,
        session_key: str | None = None,
        run_generation: int | None = None,
        event_message_id: str | None = None,
    ) -> dict[str, Any]:
        call = TurnCall(
            message,
            context_prompt,
            history,
            source,
            session_id,
            session_key,
            run_generation,
            event_message_id,
        )
        return await run(self, layout, call)

    return _run_agent_via_proxy


def _make_021(run: RunTurn, layout: Layout) -> Callable[..., Awaitable[dict[str, Any]]]:
    # The exact signature of 0.21's GatewayTurnExecutionMixin.
    # _run_agent_via_proxy (gateway/run_turn_execution.py).
    async def _run_agent_via_proxy(
        self: Any,
        message: str,
        context_prompt: str,
        history: list[dict[str, Any]],
        source: Any,
        session_id: str | None,
        session_key: str | None = None,
        run_generation: int | None = None,
        event_message_id: str | None = None,
        scheduled_heartbeat: bool = False,
        input_snapshot: Any = None,
    ) -> dict[str, Any]:
        call = TurnCall(
            message,
            context_prompt,
            history,
            source,
            session_id,
            session_key,
            run_generation,
            event_message_id,
            quiet=bool(scheduled_heartbeat),
            input_snapshot=input_snapshot,
        )
        return await run(self, layout, call)

    return _run_agent_via_proxy


_PARAMS_019 = (
    "self",
    "message",
    "context_prompt",
    "history",
    "source",
    "session_id",
    "session_key",
    "run_generation",
    "event_message_id",
)
LAYOUTS = (
    Layout("hermes-agent 0.19 (GatewayRunner)", _PARAMS_019, "_adapter_for_source", _make_019),
    Layout(
        "hermes-agent 0.21 (GatewayTurnExecutionMixin)",
        (*_PARAMS_019, "scheduled_heartbeat", "input_snapshot"),
        "_delivery_adapter_for",
        _make_021,
    ),
)


def params_of(runner_cls: type) -> tuple[str, ...] | None:
    """The parameters of the runner's remote-turn method (None: it has none)."""
    method = getattr(runner_cls, METHOD, None)
    if not callable(method):
        return None
    return tuple(inspect.signature(method).parameters)


def where(runner_cls: type) -> str:
    """Which class of the runner's defines the remote-turn method (for messages)."""
    for cls in runner_cls.__mro__:
        if METHOD in vars(cls):
            return f"{cls.__module__}.{cls.__qualname__}"
    return runner_cls.__qualname__


def find_layout(runner_cls: type, modules: dict[str, Any]) -> Layout:
    """The known layout `runner_cls` has, probed by its method's parameters
    and the helpers the plugin uses. Raises NotPinned naming what differs."""
    params = params_of(runner_cls)
    name = f"{runner_cls.__qualname__}.{METHOD}"
    if params is None:
        raise NotPinned(f"{name} is gone")
    matching = [layout for layout in LAYOUTS if layout.params == params]
    if not matching:
        known = "; ".join(f"{layout.name}: {layout.params[1:]}" for layout in LAYOUTS)
        raise NotPinned(
            f"{name} takes {params} (defined in {where(runner_cls)}), a layout the plugin "
            f"does not know (known: {known})"
        )
    layout = matching[0]
    missing = [h for h in layout.helpers if not callable(getattr(runner_cls, h, None))]
    for module, attr in MODULE_HELPERS:
        if not callable(getattr(modules.get(module), attr, None)):
            missing.append(f"{module}.{attr}")
    if missing:
        raise NotPinned(f"its {layout.name} layout lacks {', '.join(missing)}")
    return layout


def is_ours(runner_cls: type) -> bool:
    """Whether the runner's remote-turn method is already the plugin's."""
    return bool(getattr(getattr(runner_cls, METHOD, None), MARK, False))
