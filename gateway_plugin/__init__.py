"""The hermes-sup plugin for Hermes's messaging gateway (`hermes-sup[gateway]`).

Enabled in the gateway's config.yaml (`plugins: {enabled: [hermes-sup]}`)
with GATEWAY_PROXY_URL and GATEWAY_PROXY_KEY set to a hermes-sup endpoint and
key, it runs each chat's turns in that chat's own hermes-sup worker with what
the in-process gateway gives a chat: the chat's identity in the worker, tool
progress and approvals in the chat (docs: gateway.md). It loads nothing of
the supervisor: it is a client of the HTTP endpoint, in the gateway's process.
"""

from __future__ import annotations

from typing import Any

from .pinned import install


def register(ctx: Any) -> None:
    """Hermes's plugin entry point (group `hermes_agent.plugins`)."""
    install()


__all__ = ["install", "register"]
