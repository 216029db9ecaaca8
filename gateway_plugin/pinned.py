"""The one place the plugin reaches into Hermes: pinned, and failing closed.

Hermes 0.19 has no way for a plugin to run a gateway session's turns. Its
proxy mode (GATEWAY_PROXY_URL) is one method, `GatewayRunner.
_run_agent_via_proxy`, that sends a turn to a remote Hermes API server and
reads only its text. The plugin replaces that method, and only that one, so
that everything else stays Hermes's own (sessions, slash commands, the stream
consumer, adapters, the final answer's delivery).

Replacing an internal is safe only on the Hermes it was tested with. On any
other version, or if a helper it uses is gone or changed, the replacement
answers every turn with a message naming the reason and runs nothing: plain
proxy mode would silently lose the chat's identity and approvals.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
import os
from typing import Any

log = logging.getLogger("hermes_sup.gateway_plugin")

TESTED = ("0.19.",)  # hermes-agent versions the plugin was tested with (prefixes)
# The replaced method's parameters, in order, as Hermes 0.19 calls it.
PROXY_PARAMS = (
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
# What the replacement uses of Hermes besides the replaced method.
RUNNER_HELPERS = (
    "_get_proxy_url",
    "_adapter_for_source",
    "_thread_metadata_for_source",
    "_is_session_run_current",
)
MARK = "_hermes_sup_plugin"


class NotPinned(Exception):
    """This Hermes is not the one the plugin was tested with; says why."""


def hermes_version() -> str:
    try:
        return importlib.metadata.version("hermes-agent")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def check_pinned() -> None:
    """Raise NotPinned unless this Hermes is one the plugin was tested with."""
    version = hermes_version()
    if not version.startswith(TESTED):
        raise NotPinned(f"not tested with hermes-agent {version} (tested: {', '.join(TESTED)}x)")
    import gateway.run as gateway_run
    import tools.approval as approval

    runner = gateway_run.GatewayRunner
    method = getattr(runner, "_run_agent_via_proxy", None)
    if method is None:
        raise NotPinned("GatewayRunner._run_agent_via_proxy is gone")
    params = tuple(inspect.signature(method).parameters)
    if getattr(method, MARK, False):
        return  # already ours
    if params != PROXY_PARAMS:
        raise NotPinned(f"GatewayRunner._run_agent_via_proxy takes {params}, not {PROXY_PARAMS}")
    missing = [name for name in RUNNER_HELPERS if not callable(getattr(runner, name, None))]
    for module, name in (
        (approval, "_await_gateway_decision"),
        (gateway_run, "_format_exec_approval_fallback"),
        (gateway_run, "_redact_approval_command"),
        (gateway_run, "_platform_config_key"),
        (gateway_run, "_load_gateway_config"),
    ):
        if not callable(getattr(module, name, None)):
            missing.append(f"{module.__name__}.{name}")
    if missing:
        raise NotPinned(f"Hermes lacks {', '.join(missing)}")


def install() -> None:
    """Replace GatewayRunner._run_agent_via_proxy with the plugin's (or with a
    refusal, on a Hermes it was not tested with)."""
    import gateway.run as gateway_run

    runner: Any = gateway_run.GatewayRunner
    try:
        check_pinned()
    except NotPinned as exc:
        reason = f"hermes-sup gateway plugin: {exc}; no turn runs until it is updated or disabled"
        log.error(reason)
        runner._run_agent_via_proxy = _refusal(reason)
        return
    if getattr(runner._run_agent_via_proxy, MARK, False):
        return
    from .turn import run_turn

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
        return await run_turn(
            self,
            message,
            context_prompt,
            history,
            source,
            session_id,
            session_key,
            run_generation,
            event_message_id,
        )

    setattr(_run_agent_via_proxy, MARK, True)
    runner._run_agent_via_proxy = _run_agent_via_proxy
    _deliver_only_what_workers_sent()
    log.info("hermes-sup gateway plugin: turns in proxy mode go to hermes-sup")


def _deliver_only_what_workers_sent() -> None:
    """Every answer now comes from a worker, which cannot read this host's
    files: a path in its text must not make the gateway upload a file of
    this host to the chat (Hermes sends any existing file an answer names,
    outside its denylist, unless in strict mode). Strict mode, without its
    trust in recently written files, keeps deliveries to Hermes's caches
    (where the plugin puts the files workers sent) and the operator's
    HERMES_MEDIA_ALLOW_DIRS. An operator's own setting of either wins."""
    os.environ.setdefault("HERMES_MEDIA_DELIVERY_STRICT", "1")
    os.environ.setdefault("HERMES_MEDIA_TRUST_RECENT_FILES", "0")


def _refusal(reason: str) -> Any:
    async def _run_agent_via_proxy(self: Any, message: str, *args: Any, **kwargs: Any) -> Any:
        return {"final_response": f"⚠️ {reason}", "messages": [], "api_calls": 0, "tools": []}

    setattr(_run_agent_via_proxy, MARK, True)
    return _run_agent_via_proxy
