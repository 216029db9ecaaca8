"""A Hermes turn's context (PROTOCOL.md), checked: what the front end sent
with the text, as the Hermes runtime (worker/hermes.py) uses it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# A conversation id becomes a state.db key and part of file names: Hermes's
# API server refuses longer ones and those that could leave a directory.
MAX_CONVERSATION_ID = 256
_UNSAFE_ID = re.compile(r"[\x00-\x1f\x7f/\\]|\.\.")
HISTORY_ROLES = ("user", "assistant")


class HermesTurnError(Exception):
    """A turn that hermes could not complete; the message says why."""


@dataclass(frozen=True)
class TurnContext:
    """A turn's context (PROTOCOL.md), checked: what the front end sent."""

    instructions: str | None = None
    history: tuple[dict[str, str], ...] = ()
    conversation: str | None = None
    model: str | None = None  # the model for this turn (a chat's /model), if not the session's

    @classmethod
    def parse(cls, context: dict[str, Any] | None) -> TurnContext:
        """Check the keys this runtime reads (others are ignored); a bad one
        fails the turn with a message that names it."""
        if not context:
            return cls()
        instructions = context.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise HermesTurnError("context instructions must be a string")
        conversation = context.get("conversation")
        if conversation is not None:
            if not isinstance(conversation, str) or not conversation:
                raise HermesTurnError("context conversation must be a non-empty string")
            if len(conversation) > MAX_CONVERSATION_ID:
                raise HermesTurnError(
                    f"context conversation is {len(conversation)} characters, "
                    f"over {MAX_CONVERSATION_ID}"
                )
            if _UNSAFE_ID.search(conversation):
                raise HermesTurnError(
                    "context conversation may not hold control characters, '/', '\\' or '..'"
                )
        model = context.get("model")
        if model is not None and (
            not isinstance(model, str) or not model.isprintable() or not 0 < len(model) <= 200
        ):
            raise HermesTurnError("context model must be 1 to 200 printable characters")
        history = _history(context.get("history"))
        return cls(instructions or None, history, conversation, model or None)


def _history(raw: Any) -> tuple[dict[str, str], ...]:
    """A front end's history as Hermes's conversation messages. Other roles
    than user and assistant (system, tool) are left out, as Hermes's API
    server leaves them out of a chat's history; text parts of a content
    list are joined (images and files are not carried)."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise HermesTurnError("context history must be a list of {role, content} maps")
    messages = []
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict) or not isinstance(entry.get("role"), str):
            raise HermesTurnError(f"context history[{i}] must be a map with a role")
        if entry["role"] not in HISTORY_ROLES:
            continue
        content = entry.get("content")
        if isinstance(content, list):
            parts = [p.get("text") for p in content if isinstance(p, dict)]
            content = "".join(t for t in parts if isinstance(t, str))
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise HermesTurnError(f"context history[{i}].content must be a string or a list")
        messages.append({"role": entry["role"], "content": content})
    return tuple(messages)
