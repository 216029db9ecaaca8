"""The Hermes runtime (`--agent hermes`): a real hermes-agent AIAgent per session.

Hermes reads per-session values from process-global state and captures
HERMES_HOME in module globals at import. So this module imports nothing of
hermes at its top: `HermesRuntime` imports it inside the worker, after the
worker has set its own os.environ (HERMES_HOME, TERMINAL_CWD,
HERMES_SESSION_*) and chdir'd into its workspace. The zygote never imports
hermes; it may preload only third-party libraries that capture nothing per
session (see HERMES_SAFE_PRELOAD).

The agent itself is built at the first turn, so a bad model setting becomes
a failed turn with a readable message and the session stays usable, while a
hermes that cannot even be imported fails the worker at start (it never
could work). Conversation history lives in the session's own state.db, so a
new worker (after kill, culling or a crash) resumes the same conversation.

The agent's model settings are resolved as Hermes's own API server resolves
them (gateway/platforms/api_server.py, `_create_agent`): model, provider,
base_url, credentials, toolsets (`platform_toolsets.api_server`), iteration
budget, reasoning and fallback chain from the session's HERMES_HOME
config.yaml, with Hermes's own helpers. The supervisor's agent config (and
the session's `agent` options) win over it, key by key: an explicit
`base_url` is used as given, with no provider resolution, as before. The
api key of the agent config is handed to the agent, never put in os.environ.

A turn's `context` (PROTOCOL.md) maps onto what the API server takes:
`instructions` becomes the turn's ephemeral system prompt (for that turn
only); `conversation` is the id Hermes records the conversation under in
state.db (its `session_id`, as X-Hermes-Session-Id or a run's `session_id`
is to the API server), the session key when absent; `history` is the
conversation as the front end knows it. state.db is the authority: history
is used only when state.db holds no message of that conversation yet, and
then it is written into state.db before the turn, so that the next turns
find it there (Hermes persists only the messages a turn adds). A front end
that resends its whole history each turn therefore never doubles it.

Hermes's callbacks become events: tokens, the model's reasoning
(`reasoning`, a piece of text, as tokens are), tool start/progress/complete with
every field Hermes gives (and the emoji and label its API server shows),
interim assistant messages (`assistant_message`), approvals, and clarify
questions (`clarify`). The protocol has no way yet to answer a clarify
question, so the agent is told at once that the question was shown and that
the user's next message is the answer.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Any

from hermes_sup.local.addresses import SESSION_MODEL_PATH, SESSION_PROXY_HOST, SESSION_PROXY_PORT

from .hermes_context import HermesTurnError, TurnContext
from .hermes_warnings import quiet_own_terminal_cwd
from .media import media_event
from .runtime import Emit, SessionInfo, TurnReply

log = logging.getLogger("hermes_sup.worker.hermes")

# Libraries hermes uses that capture nothing per session at import: safe to
# import once in the zygote and share copy-on-write (measured in BENCHMARKS).
HERMES_SAFE_PRELOAD = ("openai", "httpx", "pydantic", "yaml", "jinja2", "anyio", "requests")

APPROVAL_CHOICES = ("once", "session", "always", "deny")
# Seconds past hermes's own approval timeout before we report one.
APPROVAL_TIMEOUT_SLACK = 0.25
# The toolsets of a session whose agent config names none: those Hermes's API
# server gives its agents (config.yaml `platform_toolsets.api_server`).
TOOLSET_PLATFORM = "api_server"
# What the agent is built with from the environment (a turn's chat identity).
IDENTITY_ENV = tuple(
    f"HERMES_SESSION_{name}"
    for name in ("PLATFORM", "CHAT_ID", "CHAT_NAME", "THREAD_ID", "USER_ID", "USER_NAME")
)
# Where the supervisor lists the other live sessions on this session's
# repository, rewritten before each turn (supervisor/worktrees.py), and the
# most of it put in front of the agent.
PEERS_PATH = Path(".hermes-sup") / "peers"
MAX_PEERS_TEXT = 4096
# What the clarify tool answers the agent: nobody can reply within the turn.
CLARIFY_SHOWN = (
    "[the question was shown to the user, who cannot answer it during this turn: "
    "end your turn by asking it (the user's next message is the answer), or go on "
    "with a reasonable choice and say which]"
)


def _with_peers(instructions: str | None, workspace: Path) -> str | None:
    """The turn's ephemeral system prompt: the front end's instructions,
    then the peers file when this session works in a git worktree beside
    other live sessions, so that an agent is never unaware that another is
    changing the same repository next to it. The file is the supervisor's,
    fresh for this turn; a missing or unreadable one adds nothing."""
    try:
        with open(workspace / PEERS_PATH, encoding="utf-8", errors="replace") as fh:
            peers = fh.read(MAX_PEERS_TEXT).strip()
    except OSError:
        return instructions
    if not any(line and not line.startswith("#") for line in peers.splitlines()):
        return instructions  # no other session is live on the repository
    note = (
        "Other sessions are working on this same git repository right now, each in its own "
        f"copy of it and on its own branch (listed in {PEERS_PATH}, refreshed every turn). Do not assume "
        "you are alone: coordinate through commits on your own branch.\n" + peers
    )
    return f"{instructions}\n\n{note}" if instructions else note


# The model endpoint a sealed session with a network of its own is given
# (supervisor/model_gate.py): the supervisor's, inside its namespace.
GATE_URL = f"http://{SESSION_PROXY_HOST}:{SESSION_PROXY_PORT}{SESSION_MODEL_PATH}"


def name_the_model_endpoint(config_yaml: Path, cfg: dict[str, Any]) -> None:
    """What Hermes runs besides the agent's turns (a cron job) builds its
    agent from the session's config.yaml, not from the agent config: so
    config.yaml names the agent config's model (`model.default`, else a
    cron job made in a chat fails for want of one) and, where the agent's
    model calls go to the supervisor's model endpoint, that endpoint and
    the placeholder key too (it would call the model directly, which the
    session's network cannot, with whatever key the template held)."""
    url = cfg.get("base_url")
    gated = isinstance(url, str) and url.startswith(GATE_URL)
    name = cfg.get("model")
    if not gated and not (isinstance(name, str) and name):
        return
    import yaml

    try:
        data = yaml.safe_load(config_yaml.read_text()) or {}
    except FileNotFoundError:
        data = {}
    if not isinstance(data, dict):
        return  # not a config Hermes could read either: left to say so itself
    found = data.get("model")
    model: dict[str, Any] = found if isinstance(found, dict) else {}
    wanted: dict[str, Any] = {}
    if isinstance(name, str) and name:
        wanted["default"] = name  # the agent config's model is the session's, cron's too
    if gated:
        wanted.update(provider="custom", base_url=url, api_key=cfg.get("api_key"))
    if all(model.get(k) == v for k, v in wanted.items()):
        return
    data["model"] = {**model, **wanted}
    config_yaml.write_text(yaml.safe_dump(data, sort_keys=False))


class HermesRuntime:
    """One hermes AIAgent serving one session, in that session's own process."""

    def __init__(self, session: SessionInfo) -> None:
        self.session = session
        self.config = dict(session.config)
        # Approvals go to the front end (through us), never to a terminal.
        os.environ.setdefault("HERMES_GATEWAY_SESSION", "1")
        os.environ.setdefault("HERMES_EXEC_ASK", "1")
        home = Path(os.environ["HERMES_HOME"])
        template = self.config.get("template_home")
        if template and not (home / "config.yaml").exists():
            # A new session starts from the shared template (config, skills,
            # SOUL.md); from then on its home is its own.
            shutil.copytree(template, home, dirs_exist_ok=True, symlinks=True)
        name_the_model_endpoint(home / "config.yaml", self.config)
        # Import now: the environment is the session's own, so whatever hermes
        # captures at import is this session's (gateway.run: its HERMES_HOME).
        quiet_own_terminal_cwd()
        import gateway.run  # noqa: F401  (config.yaml resolution, as the API server's)
        import run_agent  # noqa: F401  (the heavy import, done before we say ready)
        import tools.approval as approval
        from hermes_state import SessionDB

        self._approval = approval
        self.db = SessionDB(db_path=home / "state.db")
        self.agent: Any = None
        # The state.db session the agent records into (its `session_id`).
        self._conversation: str | None = None
        self._identity: tuple[str | None, ...] = ()
        self._emit: Emit | None = None
        # Approval requests waiting for an answer, oldest first (hermes
        # resolves them in that order), each with the timer that reports
        # its timeout when hermes stops waiting.
        self._pending: list[tuple[str, dict[str, Any], threading.Timer]] = []
        self._asked = 0
        # Each waiting request's entry in hermes's own queue, by identity.
        self._waits: dict[str, int] = {}
        self._clarified = 0
        # Duration and outcome of the tool call that just completed: Hermes
        # reports them in tool progress, right before its tool_complete.
        self._completed: tuple[str, dict[str, Any]] | None = None
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- agent

    def _agent_settings(self) -> dict[str, Any]:
        """The AIAgent's model settings: the agent config's keys over what
        Hermes's API server would resolve from the session's config.yaml."""
        from gateway.run import (
            GatewayRunner,
            _current_max_iterations,
            _load_gateway_config,
            _resolve_gateway_model,
            _resolve_runtime_agent_kwargs,
            _resolve_runtime_agent_kwargs_for_provider,
        )
        from hermes_cli.tools_config import _get_platform_tools

        cfg = self.config
        user_config = _load_gateway_config()
        runtime: dict[str, Any]
        if cfg.get("base_url"):
            # An endpoint named outright: used as given, nothing to resolve.
            runtime = {"base_url": cfg["base_url"], "provider": cfg.get("provider", "custom")}
        else:
            try:
                if cfg.get("provider"):
                    runtime = _resolve_runtime_agent_kwargs_for_provider(cfg["provider"])
                else:
                    runtime = _resolve_runtime_agent_kwargs()
            except Exception as exc:
                raise HermesTurnError(
                    "the hermes runtime found no model endpoint: set base_url in its agent "
                    "config (--agent-config, or the session's agent options) or "
                    f"model.provider / model.base_url in the session's config.yaml ({exc})"
                ) from exc
        model = (
            cfg.get("model") or runtime.pop("model", None) or _resolve_gateway_model(user_config)
        )
        runtime.pop("model", None)
        if not model:
            raise HermesTurnError(
                "the hermes runtime has no model: set model in its agent config "
                "(--agent-config, or the session's agent options) or model.default in the "
                "session's config.yaml"
            )
        if cfg.get("api_key"):
            runtime["api_key"] = cfg["api_key"]
        elif not runtime.get("api_key"):
            runtime["api_key"] = "none"  # a local endpoint that takes any key
        toolsets = cfg.get("toolsets")
        return {
            **runtime,
            "model": model,
            "max_iterations": (
                int(cfg["max_iterations"]) if "max_iterations" in cfg else _current_max_iterations()
            ),
            "enabled_toolsets": (
                list(toolsets)
                if toolsets
                else sorted(_get_platform_tools(user_config, TOOLSET_PLATFORM))
            ),
            "reasoning_config": GatewayRunner._load_reasoning_config(model),
            "fallback_model": GatewayRunner._load_fallback_model(),
        }

    def _build_agent(self, conversation: str, model: str | None = None) -> Any:
        from run_agent import AIAgent

        env = os.environ
        settings = self._agent_settings()
        if model:
            settings["model"] = model  # on the session's own provider and base URL
        return AIAgent(
            **settings,
            quiet_mode=True,
            session_id=conversation,
            session_db=self.db,
            gateway_session_key=self.session.key,
            platform=self._platform(),
            chat_id=env.get("HERMES_SESSION_CHAT_ID"),
            chat_name=env.get("HERMES_SESSION_CHAT_NAME"),
            thread_id=env.get("HERMES_SESSION_THREAD_ID"),
            user_id=env.get("HERMES_SESSION_USER_ID"),
            user_name=env.get("HERMES_SESSION_USER_NAME"),
            stream_delta_callback=self._on_delta,
            reasoning_callback=self._on_reasoning,
            tool_start_callback=self._on_tool_start,
            tool_complete_callback=self._on_tool_complete,
            tool_progress_callback=self._on_tool_progress,
            interim_assistant_callback=self._on_interim,
            clarify_callback=self._on_clarify,
            status_callback=self._on_status,
        )

    @staticmethod
    def _platform() -> str:
        return os.environ.get("HERMES_SESSION_PLATFORM") or "api"

    def _history(self, conversation: str, given: tuple[dict[str, str], ...]) -> list[Any]:
        """The conversation so far: state.db's; the front end's `given`
        history only if state.db has none of this conversation yet, and then
        written into state.db first, so later turns find it there."""
        stored = self.db.get_messages_as_conversation(conversation)
        if stored or not given:
            if given:
                log.info(
                    "context history of %d message(s) not used: state.db holds %d of %s",
                    len(given),
                    len(stored),
                    conversation,
                )
            return list(stored)
        source = os.environ.get("HERMES_SESSION_SOURCE") or self._platform()
        self.db.ensure_session(conversation, source=source, session_key=self.session.key)
        for message in given:
            self.db.append_message(conversation, message["role"], message["content"])
        return list(self.db.get_messages_as_conversation(conversation))

    # ---------------------------------------------------------------- turns

    def run_turn(self, text: str, emit: Emit, context: dict[str, Any] | None = None) -> TurnReply:
        """Run one conversation turn with the session's history, and the
        front end's context if it sent one (see the module docstring)."""
        turn = TurnContext.parse(context)
        conversation = turn.conversation or self.session.key
        self._emit = emit
        key = self.session.key
        self._approval.register_gateway_notify(key, self._on_approval)
        try:
            identity = (*_identity(), turn.model)
            if self.agent is None or (conversation, identity) != (
                self._conversation,
                self._identity,
            ):
                # A new agent records into the turn's conversation, for the
                # turn's chat and user, with the turn's model (a chat's
                # /model): Hermes fixes all of them at construction.
                self.agent = self._build_agent(conversation, turn.model)
                self._conversation, self._identity = conversation, identity
            else:
                # An interrupt left over from the previous turn (a cancel that
                # came as it ended) must not stop this one. A cancel meant for
                # this turn is repeated by the worker until the turn ends.
                self.agent.clear_interrupt()
            agent = self.agent
            # This turn's only: the front end's instructions, and who else
            # works on this session's repository right now.
            agent.ephemeral_system_prompt = _with_peers(turn.instructions, self.session.workspace)
            history = self._history(conversation, turn.history)
            before = _usage(agent)
            result = agent.run_conversation(text, conversation_history=history or None)
            self._send_media(result, len(history))
        finally:
            self._approval.unregister_gateway_notify(key)
            self._approval_expired()
            with self._lock:
                self._emit = None
        final = result.get("final_response")
        if result.get("interrupted"):
            return TurnReply(final or "interrupted", {"interrupted": True})
        if final is None or result.get("failed"):
            error = result.get("error") or "the agent returned no response"
            raise HermesTurnError(str(error))
        after = _usage(agent)
        return TurnReply(
            str(final),
            {
                "api_calls": result.get("api_calls"),
                "usage": {name: after[name] - before[name] for name in after},
                # Where Hermes recorded the turn: a compression moves a
                # conversation on to a new id, as Hermes's API server reports.
                "session_id": str(getattr(agent, "session_id", conversation)),
            },
        )

    def set_notify(self, notify: Any) -> None:
        """The worker's way to speak outside turns: background processes'
        completions and cron jobs' output go out as notices
        (worker/hermes_notices.py)."""
        from .hermes_notices import start_cron, start_notices

        start_notices(notify)
        start_cron(notify)

    def _send_media(self, result: dict[str, Any], before: int) -> None:
        """The files this turn's tools made for the user (a TTS voice note),
        found as Hermes's gateway finds them, each as a `media` event."""
        from gateway.run import _collect_auto_append_media_tags

        messages = result.get("messages") or []
        tags, voice = _collect_auto_append_media_tags(messages, history_offset=before)
        for path in dict.fromkeys(tag.removeprefix("MEDIA:") for tag in tags):
            self._send("media", media_event(path, voice))

    def cancel(self) -> None:
        """Interrupt the running turn (hermes stops at its next check)."""
        if self.agent is not None:
            self.agent.interrupt("cancelled by the front end")
        while self.answer("deny"):  # a turn blocked on approvals must not wait them out
            pass

    def answer(self, choice: str, approval: str | None = None) -> int:
        """Resolve the oldest waiting approval request (once, session, always
        or deny); with `approval`, only if that is the one waiting. Returns
        how many were resolved: 0 if none was, or another is waiting."""
        if choice not in APPROVAL_CHOICES:
            raise ValueError(f"approval choice must be one of {', '.join(APPROVAL_CHOICES)}")
        with self._lock:
            if not self._pending or approval not in (None, self._pending[0][0]):
                return 0
            answered, _request, timer = self._pending.pop(0)
            self._waits.pop(answered, None)
        timer.cancel()
        return int(self._approval.resolve_gateway_approval(self.session.key, choice))

    # ---------------------------------------------------------------- callbacks

    def _send(self, event_type: str, data: Any) -> None:
        emit = self._emit
        if emit is not None:
            emit(event_type, data)

    def _on_delta(self, delta: str | None) -> None:
        if delta:
            self._send("token", delta)

    def _on_reasoning(self, text: str | None) -> None:
        """A piece of the model's reasoning (its `reasoning_content`, or a
        <think> block), kept apart from the reply's tokens."""
        if text:
            self._send("reasoning", str(text))

    def _on_tool_start(self, call_id: str, name: str, args: Any, *rest: Any) -> None:
        self._send(
            "tool_start",
            {"id": call_id, "name": name, "args": _plain(args), **_display(name, args)},
        )

    def _on_tool_complete(
        self, call_id: str, name: str, args: Any, result: Any, *rest: Any
    ) -> None:
        data = {"id": call_id, "name": name, "result": _plain(result)}
        completed, self._completed = self._completed, None
        if completed is not None and completed[0] == name:
            data.update(completed[1])
        self._send("tool_complete", data)

    def _on_tool_progress(
        self,
        event: str,
        tool: str | None = None,
        preview: Any = None,
        args: Any = None,
        *rest: Any,
        **fields: Any,
    ) -> None:
        """Every field Hermes gives, by name: its event (tool.started,
        tool.completed, tool.output_risk, reasoning.available, _thinking,
        subagent_progress, ...), tool, preview, args, then its keywords
        (duration, is_error, result, tool_call_id, ...)."""
        data: dict[str, Any] = {"event": event, "tool": tool, "preview": preview, "args": args}
        if rest:
            data["more"] = list(rest)
        data.update(fields)
        if event == "tool.started" and tool:
            shown = _display(tool, args)  # Hermes's own preview stays as it gave it
            data.update({k: shown[k] for k in ("emoji", "label") if k in shown})
        elif event == "tool.completed" and tool:
            outcome = {k: fields[k] for k in ("duration", "is_error") if k in fields}
            self._completed = (tool, _plain(outcome))
        self._send("tool_progress", _plain(data))

    def _on_interim(self, text: str, *rest: Any, already_streamed: bool = False, **_: Any) -> None:
        """A message the agent says to the user mid-turn (beside its tool
        calls); `already_streamed`: its text came as tokens too."""
        self._send("assistant_message", {"text": text, "already_streamed": bool(already_streamed)})

    def _on_clarify(self, question: str, choices: list[str] | None) -> str:
        """The agent asks the user something. Show it to the front end; the
        protocol cannot carry an answer back yet, so tell the agent so."""
        with self._lock:
            self._clarified += 1
            clarify = f"clarify-{self._clarified}"
        self._send(
            "clarify", {"id": clarify, "question": question, "choices": _plain(choices or [])}
        )
        return CLARIFY_SHOWN

    def _no_longer_waiting(self) -> list[str]:
        """Our waiting requests that hermes's gateway queue no longer holds
        (it timed them out). Reads hermes's queue (tools.approval, pinned
        range): where that is not there, none are found and the timers report."""
        queues = getattr(self._approval, "_gateway_queues", None)
        lock = getattr(self._approval, "_lock", None)
        if not isinstance(queues, dict) or lock is None:
            return []
        with lock:
            live = {id(entry.data) for entry in queues.get(self.session.key, [])}
        with self._lock:
            return [a for a, _request, _timer in self._pending if self._waits.get(a) not in live]

    def _on_status(self, *args: Any, **kwargs: Any) -> None:
        self._send("status", _plain(list(args)))

    def _on_approval(self, data: dict[str, Any]) -> None:
        """Hermes wants a dangerous command approved: ask the front end, and
        say so the moment hermes stops waiting (its `approvals.timeout`)."""
        # A request hermes has stopped waiting for is over before this one is
        # asked, though its timer may not have fired yet (the agent moved on
        # within the timer's slack): say so first, in order.
        for gone in self._no_longer_waiting():
            self._approval_expired(gone)
        with self._lock:
            self._asked += 1
            approval = f"hermes-{self._asked}"
            self._waits[approval] = id(data)
        request = {
            "id": approval,
            "command": data.get("command"),
            "description": data.get("description"),
            "allow_permanent": bool(data.get("allow_permanent", True)),
            "pattern_keys": _plain(data.get("pattern_keys") or [data.get("pattern_key")]),
            "choices": list(APPROVAL_CHOICES),
        }
        # Hermes starts its own clock after this call returns: ours ends a
        # little later, so a timeout is never reported for a request hermes
        # would still have taken an answer for.
        timeout = float(self._approval._get_approval_timeout()) + APPROVAL_TIMEOUT_SLACK
        timer = threading.Timer(timeout, self._approval_expired, (approval,))
        timer.daemon = True
        with self._lock:
            self._pending.append((approval, request, timer))
        self._send("approval", request)
        timer.start()

    def _approval_expired(self, approval: str | None = None) -> None:
        """Hermes stopped waiting for an answer (its timeout: deny), or the
        turn ended with requests unanswered (all of them, `approval` None).
        Tell the front end, at once, for each."""
        # Sent under the lock: the turn's end takes it too before it stops
        # emitting, so a timeout is never lost nor sent after the reply.
        with self._lock:
            expired = [p for p in self._pending if approval in (None, p[0])]
            self._pending = [p for p in self._pending if p not in expired]
            for approval_id, request, timer in expired:
                timer.cancel()
                self._waits.pop(approval_id, None)
                self._send(
                    "approval_timeout",
                    {
                        "id": approval_id,
                        "command": request["command"],
                        "outcome": "denied: no answer in time",
                    },
                )


def _identity() -> tuple[str | None, ...]:
    """The chat and user the worker serves now (a turn may set them)."""
    return tuple(os.environ.get(name) for name in IDENTITY_ENV)


def _plain(value: Any) -> Any:
    """Something msgpack can carry (tool args and results may be anything)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


def _display(name: str, args: Any) -> dict[str, str]:
    """The emoji, preview and label Hermes's API server shows for a tool
    call (`hermes.tool.progress`): the label is the preview, else the name."""
    try:
        from agent.display import build_tool_preview, get_tool_emoji

        preview = build_tool_preview(name, args if isinstance(args, dict) else {})
        return {
            "emoji": str(get_tool_emoji(name)),
            "preview": preview or "",
            "label": preview or name,
        }
    except Exception:  # a tool hermes cannot describe is still reported
        log.debug("no display for tool %s", name, exc_info=True)
        return {}


def _usage(agent: Any) -> dict[str, int]:
    """The agent's token counts so far (Hermes counts over the agent's life;
    a turn's usage is the difference)."""
    return {
        "input_tokens": int(getattr(agent, "session_prompt_tokens", 0) or 0),
        "output_tokens": int(getattr(agent, "session_completion_tokens", 0) or 0),
        "total_tokens": int(getattr(agent, "session_total_tokens", 0) or 0),
    }
