"""Who a turn is for: the chat identity a front end may send with a turn.

A messaging gateway serves many chats; each chat is one session, and the
people in it (a group chat's users) may change from one message to the next.
Hermes reads a chat's identity from HERMES_SESSION_<NAME> (its platform
decides how TTS encodes a voice note, its chat id where send_message, cron
jobs and background-process notices are delivered). So a turn's `context`
may carry `session_env`, a map of these names to strings, and the worker sets
them in its os.environ before the turn runs.

Only the names below: a turn never sets the session's key (what the
supervisor decided), its home or anything else. Values are short printable
text: each becomes an environment variable of every program the session
runs, and some are shown to people (a chat's name).
"""

from __future__ import annotations

from typing import Any

# The names a turn may set (lower case on the wire; HERMES_SESSION_<NAME> in
# the worker), as Hermes's gateway/session_context.py reads them.
CHAT_IDENTITY_NAMES = (
    "platform",
    "chat_id",
    "chat_name",
    "chat_type",
    "thread_id",
    "user_id",
    "user_name",
)
MAX_IDENTITY_VALUE = 512
ENV_PREFIX = "HERMES_SESSION_"


class ChatIdentityError(ValueError):
    """A turn's `session_env` that may not be used; the message says why."""


def check_chat_identity(raw: Any, where: str = "session_env") -> dict[str, str]:
    """The checked identity map (names lower case), or ChatIdentityError
    naming the first thing wrong. An empty value means "not set"."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ChatIdentityError(f"{where} must be a map of names to strings")
    out: dict[str, str] = {}
    for name, value in raw.items():
        if not isinstance(name, str) or name.lower() not in CHAT_IDENTITY_NAMES:
            shown = repr(name)[:40] if isinstance(name, str) else type(name).__name__
            raise ChatIdentityError(
                f"{where} has an unknown name {shown}; known: {', '.join(CHAT_IDENTITY_NAMES)}"
            )
        if value is None:
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # chat and user ids are numbers on some platforms
        if not isinstance(value, str):
            raise ChatIdentityError(f"{where}.{name} must be a string, got {type(value).__name__}")
        if len(value) > MAX_IDENTITY_VALUE:
            raise ChatIdentityError(
                f"{where}.{name} is {len(value)} characters, over {MAX_IDENTITY_VALUE}"
            )
        if not value.isprintable():
            raise ChatIdentityError(f"{where}.{name} holds a control or non-printable character")
        out[name.lower()] = value
    return out


def identity_environ(identity: dict[str, str]) -> dict[str, str]:
    """The identity as the environment variables Hermes reads."""
    return {ENV_PREFIX + name.upper(): value for name, value in identity.items()}
