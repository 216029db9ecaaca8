"""One gateway turn run in the chat's hermes-sup worker, over the endpoint's runs API.

`POST /v1/runs` names the worker by the gateway's session key (one worker
per chat, kept across `/new`: a new session id is a new conversation in the
same worker) and the conversation by the session id, and sends the chat's
identity as `session_env`. `GET /v1/runs/{id}/events` then streams the
turn: text goes to Hermes's own stream consumer (the same edited message as
in-process), tool starts become progress messages as the in-process gateway
sends them (per `display.tool_progress`), and each approval request goes
into Hermes's own approval queue for the chat's session key, with the
adapter's buttons or Hermes's text prompt in that chat; its answer there
(button, /approve, /deny) is posted back with the request's id. A run the
gateway gives up on (/stop, /new, a newer message's interrupt) is stopped.

Hermes calls it in the layout of its release (layouts.py): `run_turn` takes
the turn as a `TurnCall` and finds the chat's adapter by the layout's method.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from .cut import InFlight, ledger_path
from .layouts import Layout, TurnCall
from .notices import notices_of
from .resume import message_to_send

log = logging.getLogger("hermes_sup.gateway_plugin")

# Seconds to wait for the endpoint to accept a run or an answer.
REQUEST_TIMEOUT = 30.0
# How often a run is checked for being superseded (/stop, /new, interrupt).
CURRENT_CHECK = 0.2
# Seconds to wait for an approval prompt to be sent to the chat.
PROMPT_TIMEOUT = 15.0
# Approval requests of one turn waiting at once (each waits in a thread of
# its own); more are denied at once: a worker cannot flood the gateway.
MAX_WAITING_APPROVALS = 8
# The longest identity value the endpoint takes (protocol/chat_identity.py).
MAX_VALUE = 512


def identity_of(source: Any) -> dict[str, str]:
    """The chat's identity as the endpoint's `session_env` (names it knows)."""
    platform = getattr(source, "platform", None)
    values = {
        "platform": getattr(platform, "value", platform),
        "chat_id": source.chat_id,
        "chat_name": getattr(source, "chat_name", None),
        "chat_type": getattr(source, "chat_type", None),
        "thread_id": getattr(source, "thread_id", None),
        "user_id": getattr(source, "user_id", None),
        "user_name": getattr(source, "user_name", None),
    }
    # Every name, every turn: one a message lacks (a user name) is unset. A
    # chat title with a line break (or longer than the endpoint takes) must
    # not fail the chat's every turn: made printable and cut.
    return {
        name: "".join(c if c.isprintable() else " " for c in str(value))[:MAX_VALUE]
        if value is not None
        else ""
        for name, value in values.items()
    }


def _model_override(runner: Any, session_key: str) -> str | None:
    """The model a chat chose with /model (Hermes keeps it per session key),
    if any: only its name goes to the worker, never the gateway's keys."""
    overrides = getattr(runner, "_session_model_overrides", None)
    chosen = overrides.get(session_key) if isinstance(overrides, dict) else None
    model = chosen.get("model") if isinstance(chosen, dict) else None
    return model if isinstance(model, str) and model else None


def _failed(text: str) -> dict[str, Any]:
    return {"final_response": f"⚠️ {text}", "messages": [], "api_calls": 0, "tools": []}


class ChatTurn:
    """One turn of one chat: its run on the endpoint and what it shows in the chat."""

    def __init__(self, runner: Any, layout: Layout, call: TurnCall, metadata: Any) -> None:
        import gateway.run as gateway_run

        self.runner = runner
        self.layout = layout
        self.source = call.source
        source = call.source
        self.session_key = call.session_key or ""
        self.metadata = metadata
        self.adapter = getattr(runner, layout.adapter_method)(source)
        self.gateway_run = gateway_run
        self.loop = asyncio.get_running_loop()
        self.url = runner._get_proxy_url()
        key = os.getenv("GATEWAY_PROXY_KEY", "").strip()
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.run_id: str | None = None
        self.answers: set[asyncio.Task[None]] = set()
        config = gateway_run._load_gateway_config()
        platform_key = gateway_run._platform_config_key(source.platform)
        from gateway.display_config import resolve_display_setting

        mode = resolve_display_setting(config, platform_key, "tool_progress")
        self.progress = str(mode or os.getenv("HERMES_TOOL_PROGRESS_MODE") or "all")
        if call.quiet:
            self.progress = "off"  # a heartbeat shows only its answer, as in Hermes
        self.last_tool: str | None = None
        self.media: list[tuple[str, bool]] = []  # (local path, voice) of fetched files
        self.notes: list[str] = []  # what could not be delivered, said in the chat

    # -------------------------------------------------------------- the run

    async def start(
        self,
        http: httpx.AsyncClient,
        message: str,
        context_prompt: str,
        history: Any,
        sid: str | None,
    ) -> str:
        """Start the run; its id. Raises httpx.HTTPError or RuntimeError."""
        body: dict[str, Any] = {"input": message, "session_env": identity_of(self.source)}
        if sid:
            body["session_id"] = sid
        if context_prompt:
            body["instructions"] = context_prompt
        model = _model_override(self.runner, self.session_key)
        if model:
            body["agent_model"] = model  # the chat's /model, for its worker's agent
        past = [
            {"role": m.get("role"), "content": m.get("content")}
            for m in history or []
            if m.get("role") in ("user", "assistant") and isinstance(m.get("content"), str)
        ]
        if past:
            body["conversation_history"] = past  # used only by a worker that has none
        # The notice reader (opened when the gateway started, or now by a
        # gateway that was started another way): the endpoint keeps the
        # session's notices until it reads them, so no turn waits for it.
        reader = notices_of(self.runner, self.layout, self.url, self.headers)
        headers = dict(self.headers)
        if self.session_key:
            headers["X-Hermes-Session-Key"] = self.session_key
        started = await http.post(f"{self.url}/v1/runs", json=body, headers=headers)
        if started.status_code != 202:
            raise RuntimeError(
                f"hermes-sup refused the turn ({started.status_code}): {started.text[:300]}"
            )
        run_id = started.json()["run_id"]
        self.run_id = str(run_id)
        # Written down until its end is had: a gateway that dies first
        # delivers its answer when it starts again (cut.py).
        InFlight(ledger_path()).add(self.run_id, self.session_key)
        sup_key = started.headers.get("X-Hermes-Sup-Session")
        if sup_key and self.session_key:
            reader.record(sup_key, self.session_key, self.source)
        return self.run_id

    async def follow(self, http: httpx.AsyncClient, consumer: Any) -> dict[str, Any]:
        """Read the run's events to its end; the answer's text and how it ended."""
        text: list[str] = []
        url = f"{self.url}/v1/runs/{self.run_id}/events"
        async with http.stream("GET", url, headers=self.headers, timeout=None) as events:
            if events.status_code != 200:
                raise RuntimeError(f"hermes-sup run events: {events.status_code}")
            async for line in events.aiter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                kind = event.get("event")
                if kind == "message.delta":
                    delta = str(event.get("delta") or "")
                    text.append(delta)
                    if consumer is not None:
                        consumer.on_delta(delta)
                elif kind == "tool.started":
                    await self.show_progress(
                        event.get("tool"), event.get("preview"), event.get("emoji")
                    )
                elif kind == "clarify.request":
                    await self.show_question(event.get("question"), event.get("choices"))
                elif kind == "media.available":
                    await self.fetch_media(http, event)
                elif kind == "approval.request" and len(self.answers) >= MAX_WAITING_APPROVALS:
                    log.warning("hermes-sup: run %s asks too many approvals; denied", self.run_id)
                    await self.answer(http, event, "deny")
                elif kind == "approval.request":
                    task = self.loop.create_task(self.ask(http, event))
                    self.answers.add(task)
                    task.add_done_callback(self.answers.discard)
                elif kind == "run.completed":
                    return {"text": str(event.get("output") or ""), "ended": "completed"}
                elif kind == "run.failed":
                    return {
                        "text": "".join(text),
                        "ended": "failed",
                        "error": str(event.get("error") or "the turn failed"),
                    }
                elif kind == "run.cancelled":
                    return {"text": "".join(text), "ended": "cancelled"}
        return {"text": "".join(text), "ended": "lost"}

    async def fetch_media(self, http: httpx.AsyncClient, event: dict[str, Any]) -> None:
        """A file the agent made (a TTS voice note): fetched into the
        gateway's own media cache, to be sent with the answer as the
        in-process gateway sends it (MEDIA: tags the adapter delivers)."""
        name = str(event.get("name") or "file")
        if not event.get("available"):
            self.notes.append(f"⚠️ {name} ({event.get('size')} bytes) was too large to send.")
            return
        url = f"{self.url}/v1/runs/{self.run_id}/media/{event.get('media_id')}"
        got = await http.get(url, headers=self.headers)
        if got.status_code != 200:
            self.notes.append(f"⚠️ {name} could not be fetched ({got.status_code}).")
            return
        from hermes_constants import get_hermes_dir

        folder = Path(get_hermes_dir("cache/audio", "audio_cache")) / "hermes-sup"
        folder.mkdir(parents=True, exist_ok=True)
        # The name was made safe by the worker and the endpoint; the prefix
        # keeps two chats' files of one name apart.
        path = folder / f"{uuid.uuid4().hex[:12]}-{Path(name).name}"
        path.write_bytes(got.content)
        self.media.append((str(path), bool(event.get("voice"))))

    def with_media(self, text: str) -> str:
        """The answer with its files as MEDIA: tags (and the voice directive).
        Tags and directives in the worker's own text are taken out first, as
        the gateway would take them out before showing it: they name paths
        of the worker's host, and only the files it sent are delivered."""
        from gateway.platforms.base import BasePlatformAdapter

        if "MEDIA:" in text or "[[" in text:
            _, text = BasePlatformAdapter.extract_media(text)
            for directive in ("[[audio_as_voice]]", "[[as_document]]"):
                text = text.replace(directive, "")
        tags = [f"MEDIA:{path}" for path, _ in self.media]
        if any(voice for _, voice in self.media):
            tags.insert(0, "[[audio_as_voice]]")
        return "\n".join([text, *self.notes, *tags]) if tags or self.notes else text

    async def stop(self) -> None:
        """Stop the run in its worker (the gateway gave up on it)."""
        if self.run_id is None:
            return
        try:
            async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT) as http:
                await http.post(f"{self.url}/v1/runs/{self.run_id}/stop", headers=self.headers)
        except httpx.HTTPError as exc:
            log.warning("hermes-sup: could not stop run %s: %s", self.run_id, exc)

    # -------------------------------------------------------------- the chat

    async def show_progress(self, tool: Any, preview: Any, emoji: Any = None) -> None:
        """A tool start as the in-process gateway shows it (one line a tool;
        the tool's emoji as the worker's Hermes knows it)."""
        if self.adapter is None or self.progress == "off" or not isinstance(tool, str):
            return
        if self.progress == "new" and tool == self.last_tool:
            return
        self.last_tool = tool
        from agent.display import get_tool_emoji

        if not isinstance(emoji, str) or not emoji or len(emoji) > 8:
            emoji = get_tool_emoji(tool, default="⚙️")
        line = f"{emoji} {tool}"
        if isinstance(preview, str) and preview:
            line += f': "{preview}"'
        try:
            await self.adapter.send(self.source.chat_id, line, metadata=self.metadata)
        except Exception as exc:  # an adapter's send failing is the chat's loss, not the turn's
            log.warning("hermes-sup: tool progress not sent: %s", exc)

    async def show_question(self, question: Any, choices: Any) -> None:
        """A question the agent asks (Hermes's clarify), as a numbered list
        in the chat. The user's next message is the answer: the worker told
        the agent so, and the gateway passes that message on as a turn."""
        if self.adapter is None or not isinstance(question, str) or not question:
            return
        lines = [f"❓ {question}"]
        if isinstance(choices, list):
            lines += [f"{n}. {choice}" for n, choice in enumerate(choices, 1)]
        try:
            await self.adapter.send(self.source.chat_id, "\n".join(lines), metadata=self.metadata)
        except Exception as exc:  # the chat's loss, not the turn's
            log.warning("hermes-sup: question not sent: %s", exc)

    async def ask(self, http: httpx.AsyncClient, event: dict[str, Any]) -> None:
        """One approval request: asked in this chat through Hermes's own
        queue for its session key; the answer posted with the request's id."""
        import tools.approval as approval

        data = {
            "command": str(event.get("command") or ""),
            "description": str(event.get("description") or "dangerous command"),
            "pattern_key": event.get("pattern_key") or "",
            "pattern_keys": list(event.get("pattern_keys") or []),
            "allow_permanent": bool(event.get("allow_permanent", True)),
        }
        decided = await _in_thread(
            approval._await_gateway_decision, self.session_key, self._prompt, data
        )
        await self.answer(http, event, decided.get("choice") or "deny")  # no answer: denied

    async def answer(self, http: httpx.AsyncClient, event: dict[str, Any], choice: str) -> None:
        """Post the choice for the request `event` asked (by its id)."""
        answer = {"choice": choice, "approval_id": event.get("approval_id")}
        try:
            await http.post(
                f"{self.url}/v1/runs/{self.run_id}/approval", json=answer, headers=self.headers
            )
        except httpx.HTTPError as exc:
            log.warning("hermes-sup: approval answer not delivered: %s", exc)

    def _prompt(self, data: dict[str, Any]) -> None:
        """Send the approval prompt (Hermes's notifier contract: called in
        the waiting thread; raising makes the request a denial)."""
        future = asyncio.run_coroutine_threadsafe(self._send_prompt(data), self.loop)
        future.result(timeout=PROMPT_TIMEOUT)

    async def _send_prompt(self, data: dict[str, Any]) -> None:
        adapter, chat_id = self.adapter, self.source.chat_id
        if adapter is None:
            raise RuntimeError("no adapter for the chat")
        command = self.gateway_run._redact_approval_command(data["command"])
        if getattr(type(adapter), "send_exec_approval", None) is not None:
            sent = await adapter.send_exec_approval(
                chat_id=chat_id,
                command=command,
                session_key=self.session_key,
                description=data["description"],
                metadata=self.metadata,
                allow_permanent=data["allow_permanent"],
                smart_denied=False,
            )
            if getattr(sent, "success", False):
                return
        prefix = getattr(adapter, "typed_command_prefix", "/")
        text = self.gateway_run._format_exec_approval_fallback(
            command,
            data["description"],
            prefix,
            allow_permanent=data["allow_permanent"],
            smart_denied=False,
        )
        await adapter.send(chat_id, text, metadata=self.metadata)


async def run_turn(runner: Any, layout: Layout, call: TurnCall) -> dict[str, Any]:
    """The gateway's remote-turn method (in any known layout), run in the
    chat's hermes-sup worker."""
    if not runner._get_proxy_url():
        return _failed("Proxy URL not configured (GATEWAY_PROXY_URL or gateway.proxy_url)")
    source, session_key, history = call.source, call.session_key, call.history
    metadata = runner._thread_metadata_for_source(source, call.event_message_id)
    turn = ChatTurn(runner, layout, call, metadata)
    message = await message_to_send(runner, turn.adapter, call)
    if message is None:
        # Nothing to say and nothing Hermes would continue: no run (the
        # endpoint, like Hermes's own API server, takes no empty turn).
        log.info("hermes-sup: an empty message for %s; no run", session_key)
        return _answered(call, "", previewed=False)
    consumer = None if call.quiet else _stream_consumer(runner, layout, source, metadata, call)
    streaming = asyncio.get_running_loop().create_task(consumer.run()) if consumer else None

    def current() -> bool:
        if call.run_generation is None or not session_key:
            return True
        return bool(runner._is_session_run_current(session_key, call.run_generation))

    began = time.monotonic()
    try:
        if turn.adapter is not None and not call.quiet:
            try:
                await turn.adapter.send_typing(source.chat_id, metadata=metadata)
            except Exception:
                pass  # typing is a nicety
        async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT, read=None)) as http:
            await turn.start(http, message, call.context_prompt, history, call.session_id)
            result = await _unless_superseded(turn.follow(http, consumer), current)
    except asyncio.CancelledError:
        await turn.stop()
        raise
    except (httpx.HTTPError, RuntimeError, ValueError) as exc:
        log.error("hermes-sup: turn failed: %s", exc)
        return _failed(f"hermes-sup: {exc}")
    finally:
        if turn.run_id is not None:
            InFlight(ledger_path()).remove(turn.run_id)  # its end is had, or it was stopped
        if turn.answers:
            # Requests still waiting in the chat are moot: release them
            # (their answers are never posted) and take their prompts down.
            for task in list(turn.answers):
                task.cancel()
            import tools.approval as approval

            approval.unregister_gateway_notify(turn.session_key)
        if consumer is not None:
            consumer.finish()
        if streaming is not None:
            try:
                await asyncio.wait_for(streaming, timeout=5.0)
            except (TimeoutError, asyncio.CancelledError):
                streaming.cancel()
    if result is None:  # superseded: /stop, /new or a newer message
        await turn.stop()
        superseded = _answered(call, "", previewed=False)
        superseded.update(messages=[], api_calls=0)
        return superseded
    text = turn.with_media(result["text"])
    if result["ended"] == "failed" and not text:
        return _failed(f"hermes-sup: {result['error']}")
    log.info(
        "hermes-sup turn: run=%s %s in %.1fs, %d chars",
        turn.run_id,
        result["ended"],
        time.monotonic() - began,
        len(text),
    )
    answered = _answered(call, text, previewed=consumer is not None and bool(text))
    answered["final_response"] = text or "(No response from remote agent)"
    return answered


def _answered(call: TurnCall, text: str, previewed: bool) -> dict[str, Any]:
    """The result dict Hermes's own proxy path returns. The user's message is
    the one the gateway gave (empty for its restart continuation, as Hermes
    records it), not the note the worker's agent was given for it."""
    return {
        "final_response": text,
        "messages": [
            {"role": "user", "content": call.message},
            {"role": "assistant", "content": text},
        ],
        "api_calls": 1,
        "tools": [],
        "history_offset": len(call.history),
        "session_id": call.session_id,
        "response_previewed": previewed,
    }


async def _in_thread(fn: Any, *args: Any) -> Any:
    """fn(*args) in a thread of its own: an approval waits up to minutes,
    and a shared executor's few threads would hold up other chats' waits."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()

    def run() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the awaiting task
            loop.call_soon_threadsafe(_settle, done, None, exc)
        else:
            loop.call_soon_threadsafe(_settle, done, result, None)

    threading.Thread(target=run, name="hermes-sup-approval", daemon=True).start()
    return await done


def _settle(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.done():
        return  # its task was cancelled meanwhile
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


async def _unless_superseded(work: Any, current: Any) -> dict[str, Any] | None:
    """`work`'s result, or None once the gateway no longer wants this run."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            if not current():
                task.cancel()
                return None
            await asyncio.wait({task}, timeout=CURRENT_CHECK)
        result: dict[str, Any] = task.result()
        return result
    finally:
        if not task.done():
            task.cancel()


def _stream_consumer(
    runner: Any, layout: Layout, source: Any, metadata: Any, call: TurnCall
) -> Any:
    """Hermes's own stream consumer for the chat, if streaming is on for its platform."""
    import gateway.run as gateway_run
    from gateway.config import StreamingConfig
    from gateway.display_config import resolve_display_setting
    from gateway.stream_consumer import GatewayStreamConsumer, StreamConsumerConfig

    adapter = getattr(runner, layout.adapter_method)(source)
    if adapter is None:
        return None
    config = getattr(getattr(runner, "config", None), "streaming", None) or StreamingConfig()
    platform_key = gateway_run._platform_config_key(source.platform)
    chosen = resolve_display_setting(gateway_run._load_gateway_config(), platform_key, "streaming")
    if callable(getattr(config, "enabled_for", None)):
        # 0.21: a global switch, then the platform's choice (StreamingConfig's own rule).
        enabled = bool(getattr(config, "globally_enabled", True)) and config.enabled_for(chosen)
    else:
        enabled = config.enabled and config.transport != "off" if chosen is None else bool(chosen)
    if not enabled:
        return None
    editing = getattr(adapter, "SUPPORTS_MESSAGE_EDITING", True)
    return GatewayStreamConsumer(
        adapter=adapter,
        chat_id=source.chat_id,
        config=StreamConsumerConfig(
            edit_interval=config.edit_interval,
            buffer_threshold=config.buffer_threshold,
            cursor=config.cursor if editing else "",
            transport=config.transport or "edit",
            chat_type=getattr(source, "chat_type", "") or "",
        ),
        metadata=metadata,
        initial_reply_to_id=call.event_message_id,
    )
