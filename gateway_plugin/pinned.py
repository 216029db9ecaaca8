"""The one place the plugin reaches into Hermes: probed, and failing closed.

Hermes has no way for a plugin to run a gateway session's turns. Its proxy
mode (GATEWAY_PROXY_URL) is one method, `_run_agent_via_proxy`, that sends a
turn to a remote Hermes API server and reads only its text. The plugin
replaces that method, and only that one, so that everything else stays
Hermes's own (sessions, slash commands, the stream consumer, adapters, the
final answer's delivery).

Replacing an internal is safe only where the plugin knows its contract. The
installed Hermes is probed for a known layout (layouts.py); on one it does
not know, or if a helper it uses is gone, the replacement answers every turn
with a message naming the Hermes version, the reason and what to do, and runs
nothing: plain proxy mode would silently lose the chat's identity and
approvals.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
from typing import Any

from .layouts import LAYOUT, MARK, MODULE_HELPERS, Layout, NotPinned, find_layout, is_ours

log = logging.getLogger("hermes_sup.gateway_plugin")

WHAT_TO_DO = (
    "no turn runs until the plugin is updated for it (pip install -U 'hermes-sup[gateway]') "
    "or disabled (hermes-sup taken out of plugins.enabled in the gateway's config.yaml)"
)


def hermes_version() -> str:
    try:
        return importlib.metadata.version("hermes-agent")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def probe(runner_cls: type) -> Layout:
    """The layout of `runner_cls` (Hermes's GatewayRunner, or a stand-in with
    its contract); raises NotPinned naming what the plugin does not know."""
    modules = {name: importlib.import_module(name) for name in {m for m, _ in MODULE_HELPERS}}
    return find_layout(runner_cls, modules)


def install(runner_cls: type | None = None) -> Layout | None:
    """Replace the runner's `_run_agent_via_proxy` with the plugin's, in the
    layout the installed Hermes has (or with a refusal, on one the plugin
    does not know). The layout used; None when refusing."""
    if runner_cls is None:
        import gateway.run as gateway_run

        runner_cls = gateway_run.GatewayRunner
    runner: Any = runner_cls
    if is_ours(runner):
        return getattr(runner._run_agent_via_proxy, LAYOUT, None)
    try:
        layout = probe(runner)
    except NotPinned as exc:
        reason = f"hermes-sup gateway plugin: hermes-agent {hermes_version()}: {exc}; {WHAT_TO_DO}"
        log.error(reason)
        runner._run_agent_via_proxy = _refusal(reason)
        return None
    from .turn import run_turn

    replacement = layout.make(run_turn, layout)
    setattr(replacement, MARK, True)
    setattr(replacement, LAYOUT, layout)
    # Set on the runner class itself: in 0.21 this overrides the mixin's
    # method for the runner, and the mixin stays as Hermes shipped it.
    runner._run_agent_via_proxy = replacement
    if callable(getattr(runner, "start", None)):
        from .starting import start_with_gateway

        # Notices, and the turns a restart cut, from the gateway's start on.
        start_with_gateway(runner, layout)
    _deliver_only_what_workers_sent()
    log.info("hermes-sup gateway plugin: turns in proxy mode go to hermes-sup (%s)", layout.name)
    return layout


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
    # Takes whatever any layout passes: the refusal must answer every turn.
    async def _run_agent_via_proxy(self: Any, message: str, *args: Any, **kwargs: Any) -> Any:
        return {"final_response": f"⚠️ {reason}", "messages": [], "api_calls": 0, "tools": []}

    setattr(_run_agent_via_proxy, MARK, True)
    return _run_agent_via_proxy


__all__ = ["NotPinned", "hermes_version", "install", "probe"]
