"""What a chat's worker says after its turn: delivered to that chat only, at least once.

A background process started with `notify_on_complete` ends after the turn
that started it. The worker sends a notice; the endpoint keeps a key's
notices until they are acknowledged and streams them (`GET /v1/notices`);
this task, one per gateway, opened when the gateway starts (not at its
first turn), reads them from the last cursor it acknowledged and hands each
to Hermes's own completion delivery, which starts a turn in the chat with
Hermes's notification text (the agent then tells the chat what the process
did), as the in-process gateway does. A notice is acknowledged once it was
handed on, or dropped with a log line: a gateway restarted before that is
handed it again, and one handed twice (a reconnect) is known by its id.

A message the agent sends on its own (a cron job's output) is sent to the
chat as it is.

Which chat: the notice names only the hermes-sup session it came from and
the gateway session key the plugin named that session by (`client_key`).
The chat of that key is the one the plugin recorded as its runs started,
else the one in Hermes's own session store (which survives a restart); a
key the store does not hold routes nowhere (logged). The routing fields of
the worker's event are dropped and the session key set by the plugin, so
a notice claiming another platform or chat reaches only its own.
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
MAX_SEEN = 10_000  # notice ids remembered, to hand each on once
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
        self.seen: dict[str, None] = {}  # ids handed on, oldest first
        self.cursor = 0  # the last cursor acknowledged
        self.connected = asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(self._run())

    def record(self, sup_key: str, gateway_key: str, source: Any) -> None:
        """The session `sup_key` serves the gateway session `gateway_key`,
        whose chat is `source`'s."""
        if len(self.chats) > 100_000:
            self.chats.clear()  # bounded: the next turn of a chat records it again
        self.chats[sup_key] = (gateway_key, source)

    async def _run(self) -> None:
        tries = 0
        while True:  # for as long as the gateway's loop runs
            try:
                async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=None)) as http:
                    url = f"{self.url}/v1/notices"
                    params = {"after": str(self.cursor)}
                    async with http.stream(
                        "GET", url, params=params, headers=self.headers
                    ) as stream:
                        if stream.status_code == 200:
                            tries = 0
                            self.connected.set()
                            async for line in stream.aiter_lines():
                                if line.startswith("data: "):
                                    await self._take(http, json.loads(line[6:]))
                        else:
                            log.warning("hermes-sup notices: %s", stream.status_code)
            except (httpx.HTTPError, ValueError) as exc:
                log.warning("hermes-sup notices: %s", exc)
            self.connected.clear()
            await asyncio.sleep(RETRY[min(tries, len(RETRY) - 1)])
            tries += 1

    async def _take(self, http: httpx.AsyncClient, item: Any) -> None:
        """Hand one notice on (once), then acknowledge it."""
        if not isinstance(item, dict):
            return
        notice_id = str(item.get("id") or "")
        if notice_id not in self.seen:
            await self._deliver(item)
            self.seen[notice_id] = None
            if len(self.seen) > MAX_SEEN:
                del self.seen[next(iter(self.seen))]
        cursor = item.get("cursor")
        if isinstance(cursor, int) and cursor > self.cursor:
            self.cursor = cursor
            # Not acknowledged (the endpoint away a moment): handed again
            # later, and known then by its id.
            acked = await http.post(
                f"{self.url}/v1/notices/ack", json={"cursor": cursor}, headers=self.headers
            )
            if acked.status_code != 200:
                log.warning("hermes-sup notice %s not acknowledged: %s", cursor, acked.status_code)

    def _chat_of(self, sup_key: str, client_key: str) -> tuple[str, Any] | None:
        """The gateway session and chat of a hermes-sup session: recorded by
        a run of this gateway, else from Hermes's session store."""
        known = self.chats.get(sup_key)
        if known is not None:
            return known
        origin = origin_of(self.runner, client_key)
        if origin is None:
            return None
        self.chats[sup_key] = (client_key, origin)
        return client_key, origin

    async def _deliver(self, item: dict[str, Any]) -> None:
        if not isinstance(item.get("notice"), dict):
            return
        notice, sup_key = item["notice"], str(item.get("session_key") or "")
        known = self._chat_of(sup_key, str(item.get("client_key") or ""))
        if known is None:
            log.warning("hermes-sup notice of %s: no chat of this gateway; dropped", sup_key)
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
            log.warning("hermes-sup notice of %s: of no kind known; dropped", sup_key)
            return
        from tools.process_registry import format_process_notification

        event = {name: notice["event"][name] for name in FIELDS if name in notice["event"]}
        event["session_key"] = chat  # the gateway's session: its chat, from its store
        text = format_process_notification(event)
        if not text:
            return
        try:
            delivered = await self.runner._deliver_completion_notification(text, event)
        except Exception as exc:  # the chat's loss, not the gateway's
            log.warning("hermes-sup notice for %s not delivered: %s", chat, exc)
            return
        if delivered is False:
            log.warning("hermes-sup notice for %s not delivered (the platform refused)", chat)

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


def origin_of(runner: Any, session_key: str) -> Any:
    """The chat (Hermes's SessionSource) of the gateway session `session_key`
    in Hermes's own session store, which survives a restart; None if it
    holds none."""
    store: Any = getattr(runner, "session_store", None)
    try:
        store._ensure_loaded()
        entry = store._entries.get(session_key)
    except Exception as exc:  # the store's trouble (or none): no chat found
        log.warning("hermes-sup: session store lookup of %s failed: %s", session_key, exc)
        return None
    return getattr(entry, "origin", None)


def notices_of(runner: Any, layout: Layout, url: str, headers: dict[str, str]) -> Notices:
    """The runner's notice reader (started with the gateway, or at its first turn)."""
    reader: Notices | None = getattr(runner, ATTR, None)
    if reader is None or reader.task.done():
        reader = Notices(runner, layout, url, headers)
        setattr(runner, ATTR, reader)
    return reader
