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
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Any

from .runtime import Emit, SessionInfo, TurnReply

log = logging.getLogger("hermes_sup.worker.hermes")

# Libraries hermes uses that capture nothing per session at import: safe to
# import once in the zygote and share copy-on-write (measured in BENCHMARKS).
HERMES_SAFE_PRELOAD = ("openai", "httpx", "pydantic", "yaml", "jinja2", "anyio", "requests")

APPROVAL_CHOICES = ("once", "session", "always", "deny")
# Seconds past hermes's own approval timeout before we report one.
APPROVAL_TIMEOUT_SLACK = 0.25


class HermesTurnError(Exception):
    """A turn that hermes could not complete; the message says why."""


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
        # Import now: the environment is the session's own, so whatever hermes
        # captures at import is this session's.
        import run_agent  # noqa: F401  (the heavy import, done before we say ready)
        import tools.approval as approval
        from hermes_state import SessionDB

        self._approval = approval
        self.db = SessionDB(db_path=home / "state.db")
        self.agent: Any = None
        self._emit: Emit | None = None
        # Approval requests waiting for an answer, oldest first (hermes
        # resolves them in that order), each with the timer that reports
        # its timeout when hermes stops waiting.
        self._pending: list[tuple[str, dict[str, Any], threading.Timer]] = []
        self._asked = 0
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- agent

    def _build_agent(self) -> Any:
        from run_agent import AIAgent

        cfg = self.config
        missing = [k for k in ("model", "base_url") if not cfg.get(k)]
        if missing:
            raise HermesTurnError(
                f"the hermes runtime needs {' and '.join(missing)} in its agent config "
                "(--agent-config, or the session's agent options)"
            )
        env = os.environ
        toolsets = cfg.get("toolsets")
        return AIAgent(
            base_url=cfg["base_url"],
            api_key=cfg.get("api_key") or "none",
            provider=cfg.get("provider", "custom"),
            model=cfg["model"],
            max_iterations=int(cfg.get("max_iterations", 30)),
            quiet_mode=True,
            session_id=self.session.key,
            session_db=self.db,
            gateway_session_key=self.session.key,
            platform=env.get("HERMES_SESSION_PLATFORM") or "api",
            chat_id=env.get("HERMES_SESSION_CHAT_ID"),
            chat_name=env.get("HERMES_SESSION_CHAT_NAME"),
            thread_id=env.get("HERMES_SESSION_THREAD_ID"),
            user_id=env.get("HERMES_SESSION_USER_ID"),
            user_name=env.get("HERMES_SESSION_USER_NAME"),
            enabled_toolsets=list(toolsets) if toolsets else None,
            stream_delta_callback=self._on_delta,
            tool_start_callback=self._on_tool_start,
            tool_complete_callback=self._on_tool_complete,
            tool_progress_callback=self._on_tool_progress,
            status_callback=self._on_status,
        )

    # ---------------------------------------------------------------- turns

    def run_turn(self, text: str, emit: Emit) -> TurnReply:
        """Run one conversation turn with the session's history."""
        self._emit = emit
        key = self.session.key
        self._approval.register_gateway_notify(key, self._on_approval)
        try:
            if self.agent is None:
                self.agent = self._build_agent()
            else:
                # An interrupt left over from the previous turn (a cancel that
                # came as it ended) must not stop this one. A cancel meant for
                # this turn is repeated by the worker until the turn ends.
                self.agent.clear_interrupt()
            history = self.db.get_messages_as_conversation(key)
            result = self.agent.run_conversation(text, conversation_history=history or None)
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
        return TurnReply(str(final), {"api_calls": result.get("api_calls")})

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
            _id, _request, timer = self._pending.pop(0)
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

    def _on_tool_start(self, call_id: str, name: str, args: Any, *rest: Any) -> None:
        self._send("tool_start", {"id": call_id, "name": name, "args": _plain(args)})

    def _on_tool_complete(
        self, call_id: str, name: str, args: Any, result: Any, *rest: Any
    ) -> None:
        self._send("tool_complete", {"id": call_id, "name": name, "result": _plain(result)})

    def _on_tool_progress(self, *args: Any, **kwargs: Any) -> None:
        self._send("tool_progress", _plain(list(args)))

    def _on_status(self, *args: Any, **kwargs: Any) -> None:
        self._send("status", _plain(list(args)))

    def _on_approval(self, data: dict[str, Any]) -> None:
        """Hermes wants a dangerous command approved: ask the front end, and
        say so the moment hermes stops waiting (its `approvals.timeout`)."""
        with self._lock:
            self._asked += 1
            approval = f"hermes-{self._asked}"
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
                self._send(
                    "approval_timeout",
                    {
                        "id": approval_id,
                        "command": request["command"],
                        "outcome": "denied: no answer in time",
                    },
                )


def _plain(value: Any) -> Any:
    """Something msgpack can carry (tool args and results may be anything)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)
