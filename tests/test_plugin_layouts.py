"""The gateway plugin against each Hermes layout it knows, and one it does not.

Hermes moves the method the plugin replaces between releases: 0.19 has
`GatewayRunner._run_agent_via_proxy`; 0.21 has it in
`GatewayTurnExecutionMixin` (gateway/run_turn_execution.py) with two more
parameters, and finds a chat's adapter with `_delivery_adapter_for`. Each
layout's contract is copied here as a small stand-in class: the method's
exact signature, the call its `_run_agent_inner` makes, and the runner
attributes the plugin uses, written from the upstream source named on each.
The plugin is installed on the stand-in and its turns run against a real
endpoint (the probe runtime, which echoes what it is given).

Also here: Hermes's own continuation of a turn a gateway crash cut short
(no text; every chat used to get "refused the turn (400)"), through the
stand-ins and through Hermes's real gateway.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests import test_http
from tests.test_gateway import run_gateway

pytest.importorskip("gateway.run", reason="needs hermes-agent (the hermes extra)")

from gateway.config import Platform, StreamingConfig  # noqa: E402
from gateway.session import SessionSource  # noqa: E402

from hermes_sup.gateway_plugin import pinned  # noqa: E402

# test_http's fixtures: a supervisor (probe runtime) serving the endpoint too.
endpoint = test_http.endpoint
endpoint_factory = test_http.endpoint_factory


class RecordingAdapter:
    """A chat platform that records what the gateway sends, edits and types."""

    SUPPORTS_MESSAGE_EDITING = True

    def __init__(self) -> None:
        self.sent: list[tuple[str, str]] = []

    async def send(self, chat_id: str, content: str, **kw: Any) -> Any:
        self.sent.append(("text", content))
        return SimpleNamespace(success=True, message_id=f"m{len(self.sent)}")

    async def edit_message(self, chat_id: str, message_id: str, content: str, **kw: Any) -> Any:
        self.sent.append(("edit", content))
        return SimpleNamespace(success=True, message_id=message_id)

    async def send_typing(self, chat_id: str, metadata: Any = None) -> None:
        self.sent.append(("typing", ""))


class Entry:
    """A session entry of Hermes's SessionStore, as far as the plugin reads it
    (gateway/session.py, SessionEntry: session_id, resume_pending,
    resume_reason)."""

    def __init__(self, session_id: str, resume_reason: str | None) -> None:
        self.session_id = session_id
        self.resume_pending = resume_reason is not None
        self.resume_reason = resume_reason


class Store:
    """Hermes's SessionStore, as far as the plugin reads it
    (`lookup_by_session_id`, both releases)."""

    def __init__(self) -> None:
        self.entries: dict[str, Entry] = {}

    def lookup_by_session_id(self, session_id: str) -> Entry | None:
        return self.entries.get(session_id)


class RunnerBase:
    """What both layouts' runners give the plugin: the proxy URL, thread
    metadata, the run-generation check, the session store and model
    overrides, the completion delivery, and the streaming config."""

    def __init__(self, url: str, streaming: bool = False) -> None:
        self.url = url
        self.adapter = RecordingAdapter()
        self.session_store = Store()
        self._session_model_overrides: dict[str, Any] = {}
        self.config = SimpleNamespace(streaming=StreamingConfig(enabled=streaming))

    def _get_proxy_url(self) -> str | None:
        return self.url

    def _thread_metadata_for_source(self, source: Any, reply_to_message_id: Any = None) -> Any:
        return None

    def _is_session_run_current(self, session_key: str, generation: int) -> bool:
        return True

    async def _deliver_completion_notification(self, synth_text: str, evt: dict) -> bool:
        return True


class Runner019(RunnerBase):
    """hermes-agent 0.19.0, gateway/run.py (the installed wheel):
    `GatewayRunner._run_agent_via_proxy` on the runner itself, called by
    `_run_agent_inner` with keywords; a chat's adapter from
    `_adapter_for_source`."""

    def _adapter_for_source(self, source: Any) -> Any:
        return self.adapter

    async def _run_agent_via_proxy(
        self,
        message: str,
        context_prompt: str,
        history: list[dict[str, Any]],
        source: Any,
        session_id: str,
        session_key: str | None = None,
        run_generation: int | None = None,
        event_message_id: str | None = None,
    ) -> dict[str, Any]:
        raise AssertionError("Hermes's own proxy path ran, not the plugin's")

    async def run_agent(self, message: str, source: Any, session_id: str, **kw: Any) -> Any:
        # gateway/run.py, _run_agent_inner: "Proxy mode: delegate to remote API server"
        return await self._run_agent_via_proxy(
            message=message,
            context_prompt="",
            history=[],
            source=source,
            session_id=session_id,
            session_key=f"agent:main:telegram:dm:{source.chat_id}",
            run_generation=None,
            event_message_id=None,
        )


class GatewayTurnExecutionMixin:
    """NousResearch/hermes-agent (0.21.x), gateway/run_turn_execution.py at
    0f18e32428f7: the method moved into this mixin, gained
    `scheduled_heartbeat` and `input_snapshot` (a PreparedInboundMessage,
    gateway/inbound_context.py, rendered again just before sending), and
    finds a chat's adapter with `_delivery_adapter_for`."""

    async def _run_agent_via_proxy(
        self,
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
        raise AssertionError("Hermes's own proxy path ran, not the plugin's")

    async def run_agent(
        self,
        message: str,
        source: Any,
        session_id: str,
        scheduled_heartbeat: bool = False,
        input_snapshot: Any = None,
    ) -> Any:
        # run_turn_execution.py, _run_agent_inner: the snapshot is rendered,
        # then "if self._get_proxy_url(): return await self._run_agent_via_proxy(...)"
        if input_snapshot is not None:
            await input_snapshot.snapshot.refresh()
            message = input_snapshot.render(self, timestamps=True)
        proxy = self._run_agent_via_proxy
        return await proxy(
            message=message,
            context_prompt="",
            history=[],
            source=source,
            session_id=session_id,
            session_key=f"agent:main:telegram:dm:{source.chat_id}",
            run_generation=None,
            event_message_id=None,
            scheduled_heartbeat=scheduled_heartbeat,
            input_snapshot=input_snapshot,
        )


class Runner021(GatewayTurnExecutionMixin, RunnerBase):
    """0.21's GatewayRunner: the mixin's method; no `_adapter_for_source`
    for the plugin to lean on, only `_delivery_adapter_for` (gateway/run_turn.py)."""

    def _delivery_adapter_for(self, source: Any) -> Any:
        return self.adapter


class Snapshot:
    """A PreparedInboundMessage: its text is what it renders at send time."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.refreshed = 0
        self.snapshot = self

    async def refresh(self) -> None:
        self.refreshed += 1
        self.text += " (refreshed)"

    def render(self, runner: Any, timestamps: bool = False) -> str:
        return self.text


def chat(chat_id: str) -> SessionSource:
    return SessionSource(platform=Platform.TELEGRAM, chat_id=chat_id, chat_type="dm", user_id="u1")


def fresh(cls: type) -> type:
    """A new subclass per test: installing patches a class, and each test
    starts from the layout as Hermes ships it."""
    return type(cls.__name__, (cls,), {})


@pytest.fixture
def gateway_env(endpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HERMES_HOME", str(tmp_path))
    monkeypatch.setenv("GATEWAY_PROXY_KEY", endpoint.key)
    return endpoint


def turn(runner: Any, *args: Any, **kw: Any) -> dict[str, Any]:
    async def run() -> dict[str, Any]:
        try:
            result: dict[str, Any] = await runner.run_agent(*args, **kw)
            return result
        finally:
            reader = getattr(runner, "_hermes_sup_notices", None)
            if reader is not None:
                reader.task.cancel()

    return asyncio.run(run())


# ------------------------------------------------------------------ probing


def test_each_known_layout_is_found_by_its_signature_and_helpers() -> None:
    assert pinned.probe(Runner019).name.startswith("hermes-agent 0.19")
    assert pinned.probe(Runner021).name.startswith("hermes-agent 0.21")
    import gateway.run

    assert pinned.probe(gateway.run.GatewayRunner).name.startswith("hermes-agent 0.19")


def test_a_layout_the_plugin_does_not_know_refuses_every_turn_saying_what_to_do() -> None:
    """A method with other parameters, or a known layout lacking a helper
    the plugin uses: every turn answers why, naming the Hermes version and
    what to do; nothing runs."""

    class Moved(RunnerBase):
        async def _run_agent_via_proxy(self, message, context_prompt, history, source, turn):  # type: ignore[no-untyped-def]
            raise AssertionError("ran")

    lacking = type("Lacking", (GatewayTurnExecutionMixin, RunnerBase), {})
    for cls, said in [
        (Moved, "a layout the plugin does not know"),
        (lacking, "lacks _delivery_adapter_for"),
    ]:
        assert pinned.install(cls) is None
        answer = asyncio.run(cls._run_agent_via_proxy(None, "hi", "", [], chat("1"), "s"))  # type: ignore[attr-defined]
        text = answer["final_response"]
        assert text.startswith("⚠️ hermes-sup gateway plugin: hermes-agent 0.19.0: "), text
        assert said in text, text
        assert "pip install -U 'hermes-sup[gateway]'" in text and "plugins.enabled" in text


# ------------------------------------------------------------------ contracts


@pytest.mark.parametrize("layout", [Runner019, Runner021])
def test_a_turn_runs_in_its_worker_in_each_layout(layout: type, gateway_env) -> None:
    cls = fresh(layout)
    assert pinned.install(cls) is not None
    runner = cls(gateway_env.url, streaming=True)
    result = turn(runner, "env HERMES_SESSION_CHAT_ID", chat("501"), "s-501")
    assert result["final_response"] == "501", result
    assert result["messages"][0] == {"role": "user", "content": "env HERMES_SESSION_CHAT_ID"}
    assert ("typing", "") in runner.adapter.sent
    result = turn(runner, "stream streamed to the chat", chat("501"), "s-501")
    assert result["response_previewed"] is True, result  # Hermes's stream consumer showed it
    assert any("streamed to" in text for _, text in runner.adapter.sent), runner.adapter.sent


def test_0_21_a_heartbeat_shows_only_its_answer_and_a_snapshot_is_rendered_at_send(
    gateway_env,
) -> None:
    """0.21's parameters: a scheduled heartbeat gets no typing indicator and
    no streamed draft (upstream's proxy path skips both); the input snapshot
    is refreshed and rendered just before the run is sent."""
    cls = fresh(Runner021)
    pinned.install(cls)
    runner = cls(gateway_env.url, streaming=True)
    result = turn(runner, "stream a quiet beat", chat("502"), "s-502", scheduled_heartbeat=True)
    assert result["final_response"] == "a quiet beat", result
    assert runner.adapter.sent == [] and result["response_previewed"] is False
    snapshot = Snapshot("stream what was queued")
    result = turn(runner, "stale text", chat("502"), "s-502", input_snapshot=snapshot)
    # Rendered twice (once by _run_agent_inner, once by the proxy path), as upstream.
    assert snapshot.refreshed == 2
    assert result["final_response"] == "what was queued (refreshed) (refreshed)", result


# ------------------------------------------------------------------ restart continuation


@pytest.mark.parametrize("layout", [Runner019, Runner021])
def test_hermes_continuing_a_cut_turn_reaches_the_worker_with_hermes_own_note(
    layout: type, gateway_env
) -> None:
    """The turn Hermes starts itself after a crash has no text: the worker's
    agent gets the recovery note Hermes gives its own agent (never a refusal);
    the transcript keeps the empty message, as Hermes's does. An empty message
    of a session with nothing to continue starts no run and says nothing."""
    cls = fresh(layout)
    pinned.install(cls)
    runner = cls(gateway_env.url)
    runner.session_store.entries["s-503"] = Entry("s-503", "restart_interrupted")
    result = turn(runner, "", chat("503"), "s-503")
    answer = result["final_response"]
    assert answer.startswith("[System note: The previous turn was interrupted by a gateway"), answer
    assert "refused" not in answer
    assert result["messages"][0] == {"role": "user", "content": ""}
    runner.session_store.entries["s-503"] = Entry("s-503", None)
    quiet = turn(runner, "  ", chat("503"), "s-503")
    assert quiet["final_response"] == "" and not runner.adapter.sent[1:], quiet


def test_after_a_gateway_crash_every_chat_continues_and_none_is_refused(endpoint, workdir) -> None:
    """Hermes's real gateway with the plugin: 4 chats speak, the gateway
    process ends without a clean shutdown, and the next one does what
    GatewayRunner.start() does after a crash. Each chat gets its continued
    turn's answer (the probe echoes Hermes's recovery note), in its own chat."""
    chats = [
        {
            "platform": platform,
            "chat_id": chat_id,
            "user_id": "u" + chat_id,
            "steps": [{"say": "pid", "wait": "text", "match": ""}],
        }
        for platform, chat_id in [
            ("telegram", "61"),
            ("telegram", "62"),
            ("discord", "63"),
            ("discord", "64"),
        ]
    ]
    home = workdir / "gateway-home"
    first = run_gateway(endpoint, home, chats)
    assert first["errors"] == [], "\n".join(first["errors"])
    again = [{**c, "steps": []} for c in chats]
    report = run_gateway(endpoint, home, again, restart=True)
    resumed = report["resumed"]
    assert sorted(resumed) == sorted(f"{c['platform']}:{c['chat_id']}" for c in chats), report[
        "log"
    ]
    for got in resumed.values():
        texts = [t for kind, t in got if kind in ("text", "edit")]
        assert not [t for t in texts if "refused" in t or "⚠️" in t], got
        assert any("interrupted by a gateway interruption" in t for t in texts), got
