"""Hermes's real GatewayRunner with fake platform adapters (no network), run
as its own process by tests/test_gateway.py: each chat says its lines through
the adapter's real inbound path (`handle_message`), and everything the
gateway sends to any chat is recorded, by chat. Prints one JSON object:
{"sent": {"<platform>:<chat>": [[kind, text], ...]}, "errors": [...]}.

argv[1]: the plan, JSON: {"chats": [{"platform", "chat_id", "user_id",
"steps": [...]}], "plugin": bool}. A step is {"say": TEXT, "wait": KIND,
"match": SUBSTRING}: say TEXT in the chat, then wait until the chat was sent
something of KIND ("text", "approval", "voice", "audio", "document")
holding SUBSTRING; a step whose turn ends without it is recorded in
"errors" and the chat goes on with its next step ("later": true: it may
come after the turn, from the agent on its own; waited for until the
step's timeout; "wait": "busy": on once its turn runs). With "plugin", the hermes-sup plugin is loaded by
Hermes's own plugin discovery (config.yaml's plugins.enabled).

With "restart" (a run on the HERMES_HOME of one that ended without a clean
shutdown), the gateway first does what GatewayRunner.start() does after a
crash: marks the sessions active in the last 120 s `resume_pending`
(`suspend_recently_active`) and continues each with Hermes's own textless
turn (`_schedule_resume_pending_sessions`), waiting for those turns to end;
what the chats were sent then is "resumed" in the report.

With "listen" ({"<platform>:<chat>": [SUBSTRING, ...]}), the gateway does
what the plugin does when GatewayRunner.start() has started it (its notice
stream opens, the turns a restart cut are recovered),
and waits, with no chat speaking, until each chat was sent text holding each
of its substrings (a miss is recorded in "errors"), no turn runs and the
endpoint keeps no notice unacknowledged.

With "crash", the gateway dies (no shutdown of any kind) once every chat's
turn has its run on the endpoint, after printing its report.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from typing import Any

from gateway.config import GatewayConfig, Platform, PlatformConfig
from gateway.platforms.base import BasePlatformAdapter, MessageEvent, MessageType, SendResult
from gateway.run import GatewayRunner
from gateway.session import SessionSource

SENT: dict[str, list[list[str]]] = {}
ERRORS: list[str] = []
TOOK: dict[str, list[float]] = {}  # seconds each step of a chat took
STEP_TIMEOUT = float(os.environ.get("DRIVER_STEP_TIMEOUT", "120"))


class FakeAdapter(BasePlatformAdapter):
    """A platform that sends nowhere: every message, edit, file and prompt
    is recorded under its chat."""

    SUPPORTS_MESSAGE_EDITING = True

    def __init__(self, platform: Platform) -> None:
        super().__init__(PlatformConfig(enabled=True, token="fake"), platform)
        self.count = 0

    def _record(self, chat_id: Any, kind: str, text: str) -> str:
        SENT.setdefault(f"{self.platform.value}:{chat_id}", []).append([kind, text])
        self.count += 1
        return f"m{self.count}"

    async def connect(self, *, is_reconnect: bool = False) -> bool:
        return True

    async def disconnect(self) -> None:
        return None

    async def send(self, chat_id, content, reply_to=None, metadata=None) -> SendResult:
        return SendResult(success=True, message_id=self._record(chat_id, "text", content))

    async def edit_message(self, chat_id, message_id, content, **kwargs) -> SendResult:
        self._record(chat_id, "edit", content)
        return SendResult(success=True, message_id=message_id)

    async def send_typing(self, chat_id, metadata=None) -> None:
        return None

    async def send_voice(self, chat_id, audio_path, caption=None, reply_to=None, **kw):
        kind = "voice" if self.platform == Platform.TELEGRAM else "audio"
        return SendResult(success=True, message_id=self._record(chat_id, kind, str(audio_path)))

    async def send_document(self, chat_id, file_path, caption=None, **kw) -> SendResult:
        return SendResult(success=True, message_id=self._record(chat_id, "document", file_path))

    async def send_exec_approval(self, chat_id, command, session_key, **kw) -> SendResult:
        return SendResult(success=True, message_id=self._record(chat_id, "approval", command))

    async def get_chat_info(self, chat_id) -> dict[str, Any]:
        return {"name": f"chat {chat_id}", "type": "dm"}


def seen(key: str, kind: str, match: str, after: int) -> bool:
    return any(
        k == kind or (kind == "text" and k == "edit")
        for k, text in SENT.get(key, [])[after:]
        if match in text
    )


async def chat(runner: GatewayRunner, adapters: dict[str, FakeAdapter], plan: dict) -> None:
    platform = Platform(plan["platform"])
    adapter = adapters[plan["platform"]]
    key = f"{plan['platform']}:{plan['chat_id']}"
    for n, step in enumerate(plan["steps"]):
        source = SessionSource(
            platform=platform,
            chat_id=plan["chat_id"],
            chat_name=f"chat {plan['chat_id']}",
            chat_type="dm",
            user_id=plan["user_id"],
            user_name=plan.get("user_name"),
        )
        event = MessageEvent(
            text=step["say"],
            message_type=MessageType.TEXT,
            source=source,
            message_id=f"{plan['chat_id']}-{n}",
        )
        after = len(SENT.get(key, []))
        began = time.monotonic()
        await adapter.handle_message(event)
        deadline = time.monotonic() + STEP_TIMEOUT
        session = runner._session_key_for_source(source)
        if step["wait"] == "busy":  # on as soon as the turn runs (to interrupt it)
            while session not in adapter._active_sessions and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            continue
        # A step is over when what it waits for was seen and (unless that is
        # an approval, which holds the turn) the turn is over; or when the
        # turn is over without it: a miss, recorded, and the chat goes on.
        while True:
            matched = seen(key, step["wait"], step["match"], after)
            busy = session in adapter._active_sessions
            if matched and (step["wait"] == "approval" or not busy):
                break
            answered = len(SENT.get(key, [])) > after and not step.get("later")
            if (not busy and answered) or time.monotonic() > deadline:
                ERRORS.append(f"{key} step {n} {step}: not seen; got {SENT.get(key, [])[after:]}")
                break
            await asyncio.sleep(0.05)
        TOOK.setdefault(key, []).append(round(time.monotonic() - began, 2))


async def restart(runner: GatewayRunner, adapters: dict[str, FakeAdapter]) -> None:
    """GatewayRunner.start()'s crash recovery: the sessions cut short are
    marked and continued by Hermes itself; returns when those turns ended
    and their answers were sent."""
    runner.session_store.suspend_recently_active()
    runner._schedule_resume_pending_sessions()
    deadline = time.monotonic() + STEP_TIMEOUT
    while time.monotonic() < deadline and (
        runner._running_agents or any(a._active_sessions for a in adapters.values())
    ):
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)  # the answers' background sends


async def listen(runner: GatewayRunner, adapters: dict[str, FakeAdapter], wanted: dict) -> None:
    """The gateway started, as the plugin's start: the notice stream opens;
    returns when every chat was sent what it waits for and no turn runs."""
    from hermes_sup.gateway_plugin.layouts import LAYOUT
    from hermes_sup.gateway_plugin.starting import on_gateway_start

    on_gateway_start(runner, getattr(GatewayRunner._run_agent_via_proxy, LAYOUT))

    def missing() -> list[str]:
        return [
            f"{key}: {text}"
            for key, texts in wanted.items()
            for text in texts
            if not seen(key, "text", text, 0)
        ]

    deadline = time.monotonic() + STEP_TIMEOUT
    while time.monotonic() < deadline and (
        missing() or any(a._active_sessions for a in adapters.values())
    ):
        await asyncio.sleep(0.05)
    ERRORS.extend(f"not seen: {m}; got {SENT.get(m.split(': ')[0], [])}" for m in missing())
    # and until the plugin acknowledged what it handed on (the endpoint keeps none)
    import httpx

    url = os.environ["GATEWAY_PROXY_URL"] + "/v1/notices/ack"
    auth = {"Authorization": f"Bearer {os.environ['GATEWAY_PROXY_KEY']}"}
    async with httpx.AsyncClient(timeout=30) as http:
        while time.monotonic() < deadline:
            kept = (await http.post(url, json={"cursor": 0}, headers=auth)).json()["kept"]
            if kept == 0:
                return
            await asyncio.sleep(0.05)
    ERRORS.append(f"the endpoint still keeps {kept} notice(s): not acknowledged")


async def crash(runs: int) -> None:
    """Die, once `runs` runs are in flight, as a killed gateway does."""
    from hermes_sup.gateway_plugin.cut import InFlight, ledger_path

    deadline = time.monotonic() + STEP_TIMEOUT
    while len(InFlight(ledger_path()).read()) < runs and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    print(json.dumps({"sent": SENT, "errors": ERRORS, "took": TOOK, "resumed": {}}), flush=True)
    os._exit(0)


async def main() -> None:
    logging.basicConfig(level=os.environ.get("DRIVER_LOG_LEVEL", "WARNING"), stream=sys.stderr)
    plan = json.loads(sys.argv[1])
    if plan.get("plugin"):
        from hermes_cli.plugins import discover_plugins

        discover_plugins()
    runner = GatewayRunner(GatewayConfig())
    adapters = {}
    for name in sorted({c["platform"] for c in plan["chats"]}):
        adapter = FakeAdapter(Platform(name))
        adapter.set_message_handler(runner._handle_message)
        adapter.set_session_store(runner.session_store)
        adapter.set_busy_session_handler(runner._handle_active_session_busy_message)
        runner.adapters[Platform(name)] = adapter
        adapters[name] = adapter
    resumed: dict[str, list[list[str]]] = {}
    if plan.get("restart"):
        await restart(runner, adapters)
        resumed = {key: list(sent) for key, sent in SENT.items()}
    if "listen" in plan:
        await listen(runner, adapters, plan["listen"])
    await asyncio.gather(*(chat(runner, adapters, c) for c in plan["chats"]))
    if plan.get("crash"):
        await crash(len(plan["chats"]))
    # Let the last answers' background sends finish before reporting.
    await asyncio.sleep(0.5)
    print(json.dumps({"sent": SENT, "errors": ERRORS, "took": TOOK, "resumed": resumed}))
    os._exit(0)  # the gateway's background threads are not ours to join


asyncio.run(main())
