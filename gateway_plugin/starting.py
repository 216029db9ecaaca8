"""What the plugin does when the gateway starts, not at its first turn.

Hermes calls nothing of a plugin when its gateway starts, so the plugin
wraps `GatewayRunner.start` (a public method in every release it knows):
once the gateway has started, in proxy mode, the notice stream opens
(notices.py: notices kept while the gateway was down reach their chats with
no chat speaking first) and the turns a restart cut are recovered (cut.py).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from .cut import start_recovery
from .layouts import Layout
from .notices import notices_of

STARTED = "_hermes_sup_starts"
RECOVERY = "_hermes_sup_recovery"


def on_gateway_start(runner: Any, layout: Layout) -> asyncio.Task[None] | None:
    """Open the runner's notice stream and recover its cut turns (in proxy
    mode; else nothing); the recovery's task."""
    url = runner._get_proxy_url()
    if not url:
        return None
    key = os.getenv("GATEWAY_PROXY_KEY", "").strip()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    notices_of(runner, layout, url, headers)
    task = start_recovery(runner, url, headers)
    setattr(runner, RECOVERY, task)  # held: a task nothing holds may be collected
    return task


def start_with_gateway(runner_cls: Any, layout: Layout) -> None:
    """Make the runner's `start` call `on_gateway_start` once it has started."""
    if getattr(runner_cls.start, STARTED, False):
        return
    original = runner_cls.start

    async def start(self: Any, *args: Any, **kwargs: Any) -> Any:
        started = await original(self, *args, **kwargs)
        on_gateway_start(self, layout)
        return started

    setattr(start, STARTED, True)
    runner_cls.start = start
