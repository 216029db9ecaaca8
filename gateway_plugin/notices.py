"""What a chat's worker says after its turn: delivered to that chat only.

A background process started with `notify_on_complete` ends after the turn
that started it. The worker sends a notice; the endpoint streams a key's
notices (`GET /v1/notices`); this task, one per gateway, reads them and
hands each to Hermes's own completion delivery, which starts a turn in the
chat with Hermes's notification text (the agent then tells the chat what
the process did), as the in-process gateway does.

A message the agent sends on its own (a cron job's output) is sent to the
chat as it is.

Which chat: the notice names only the hermes-sup session it came from, and
the plugin maps that to the gateway session that ran its turns (recorded
as each run starts). A notice of a session this gateway never ran a turn
for, or one claiming a platform or chat, routes nowhere else: the routing
fields of the worker's event are dropped and the session key set by the
plugin; Hermes then finds the chat in its own session store.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import httpx

from hermes_sup.protocol.messages import PROCESS_NOTICE_FIELDS as FIELDS

from .layouts import Layout

log = logging.getLogger("hermes_sup.gateway_plugin")

RETRY = (0.5, 1.0, 2.0, 5.0, 10.0)  # seconds before reconnecting, backing off
# A session's notices taken per minute; more are dropped (a worker that
# floods its chat, or starts turn after turn in it, is stopped here).
MAX_PER_MINUTE = 20
HOLD = 30.0  # seconds a notice of a session not yet known waits for it
MAX_HELD = 100  # such notices kept, per session, and sessions
ATTR = "_hermes_sup_notices"


class Notices:
    """The gateway's one reader of its key's notices, and the session map."""

    def __init__(self, runner: Any, layout: Layout, url: str, headers: dict[str, str]) -> None:
        self.runner = runner
        self.layout = layout
        self.url = url
        self.headers = headers
        # hermes-sup session key -> the gateway session (key, source) it serves
        self.chats: dict[str, tuple[str, Any]] = {}
        self.recent: dict[str, list[float]] = {}  # notice times, per session
        # Notices of a session not yet recorded (its first run's answer may
        # come after the notice): held a while, for when it is.
        self.held: dict[str, list[tuple[float, Any]]] = {}
        self.connected = asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(self._run())

    def record(self, sup_key: str, gateway_key: str, source: Any) -> None:
        """The session `sup_key` serves the gateway session `gateway_key`,
        whose chat is `source`'s."""
        if len(self.chats) > 100_000:
            self.chats.clear()  # bounded: the next turn of a chat records it again
        self.chats[sup_key] = (gateway_key, source)
        for _, item in self.held.pop(sup_key, []):
            asyncio.get_running_loop().create_task(self._deliver(item))

    async def _run(self) -> None:
        tries = 0
        while True:  # for as long as the gateway's loop runs
            try:
                async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=None)) as http:
                    async with http.stream(
                        "GET", f"{self.url}/v1/notices", headers=self.headers
                    ) as stream:
                        if stream.status_code == 200:
                            tries = 0
                            self.connected.set()
                            async for line in stream.aiter_lines():
                                if line.startswith("data: "):
                                    await self._deliver(json.loads(line[6:]))
                        else:
                            log.warning("hermes-sup notices: %s", stream.status_code)
            except (httpx.HTTPError, ValueError) as exc:
                log.warning("hermes-sup notices: %s", exc)
            self.connected.clear()
            await asyncio.sleep(RETRY[min(tries, len(RETRY) - 1)])
            tries += 1

    async def _deliver(self, item: Any) -> None:
        if not isinstance(item, dict) or not isinstance(item.get("notice"), dict):
            return
        notice, sup_key = item["notice"], str(item.get("session_key") or "")
        known = self.chats.get(sup_key)
        if known is None:
            self._hold(sup_key, item)
            return
        chat, source = known
        if not self._admit(sup_key):
            log.warning(
                "hermes-sup notices of %s: over %d a minute; dropped", sup_key, MAX_PER_MINUTE
            )
            return
        if notice.get("kind") == "message" and isinstance(notice.get("text"), str):
            await self._send(source, notice["text"])
            return
        if notice.get("kind") != "process" or not isinstance(notice.get("event"), dict):
            return
        from tools.process_registry import format_process_notification

        event = {name: notice["event"][name] for name in FIELDS if name in notice["event"]}
        event["session_key"] = chat  # the gateway's session: its chat, from its store
        text = format_process_notification(event)
        if not text:
            return
        try:
            await self.runner._deliver_completion_notification(text, event)
        except Exception as exc:  # the chat's loss, not the gateway's
            log.warning("hermes-sup notice for %s not delivered: %s", chat, exc)

    def _hold(self, sup_key: str, item: Any) -> None:
        """Keep a notice of a session not (yet) known for HOLD seconds."""
        now = time.monotonic()
        for key in [k for k, v in self.held.items() if now - v[-1][0] > HOLD]:
            del self.held[key]  # never recorded: not a session of this gateway
        waiting = self.held.setdefault(sup_key, [])
        if len(waiting) < MAX_HELD and len(self.held) <= MAX_HELD:
            waiting.append((now, item))
        else:
            log.warning("hermes-sup notice of %s: no chat of this gateway; dropped", sup_key)

    def _admit(self, sup_key: str) -> bool:
        now = time.monotonic()
        times = [t for t in self.recent.get(sup_key, []) if now - t < 60.0]
        if len(times) >= MAX_PER_MINUTE:
            self.recent[sup_key] = times
            return False
        times.append(now)
        self.recent[sup_key] = times
        if len(self.recent) > 100_000:
            self.recent.clear()
        return True

    async def _send(self, source: Any, text: str) -> None:
        """A message the agent sends on its own (a cron job's output), to the chat."""
        adapter = getattr(self.runner, self.layout.adapter_method)(source)
        if adapter is None or not text.strip():
            return
        metadata = self.runner._thread_metadata_for_source(source)
        try:
            await adapter.send(source.chat_id, text, metadata=metadata)
        except Exception as exc:  # the chat's loss, not the gateway's
            log.warning("hermes-sup message for %s not delivered: %s", source.chat_id, exc)


def notices_of(runner: Any, layout: Layout, url: str, headers: dict[str, str]) -> Notices:
    """The runner's notice reader (started at its first turn)."""
    reader: Notices | None = getattr(runner, ATTR, None)
    if reader is None or reader.task.done():
        reader = Notices(runner, layout, url, headers)
        setattr(runner, ATTR, reader)
    return reader
