"""Which hermes-sup session an HTTP request belongs to, and what its turn is.

A conversation is one session, so one worker, and every session is the
bearer key's own (keys.py): the ids clients send live in the key's
namespace, `NAME+ID+<id>`, so two keys that send the same id reach two
sessions, and no id one key sends reaches another's session, nor one a
local or CURVE client opened, unless the key was granted it (then the id is
the session key itself). Which id:

1. `X-Hermes-Session-Key` (a stable per-channel scope; hermes-webui sends
   `webui:<id>`), else
2. `X-Hermes-Session-Id` (the Hermes gateway's proxy mode sends its session
   id), else
3. for chat completions from clients that resend the whole history (Open
   WebUI, LibreChat, the openai SDK), a session of their own for each
   conversation (continuity.py).

An id that breaks our key rules (protocol/session_keys.py: no `/`, spaces,
non-ASCII, at most 128 characters with the namespace) is mapped to a key
that keeps a readable part of it: its allowed characters (others become
`_`), cut to fit, then `=` and 16 hex digits of SHA-256 of the whole id.
Different ids never share a session (but for a hash collision), and
`hermes-sup list` still shows what the id looked like; the endpoint logs
the exact mapping (`http_session_key`) and names the id as the session's
`label` with its first turn, which `list` and `inspect` show.

Only the newest user message is sent as the turn: the session's worker
keeps the conversation itself (Hermes in the session's own state.db), but
for a conversation named by no X-Hermes-Session-Id, whose history is the
one the request sends (continuity.py).
"""

from __future__ import annotations

import base64
import hashlib
import re
from dataclasses import dataclass
from typing import Any

from hermes_sup.protocol import MAX_KEY_LENGTH, RemoteProtocolError, check_session_key

from .errors import ApiError
from .keys import Tenant

MAX_HEADER_ID = 256  # as Hermes's API server: longer ids are refused
READABLE_PART = 80
_NOT_KEY_CHAR = re.compile(r"[^A-Za-z0-9._:@+=-]")
_UNSAFE = re.compile(r"[\x00-\x1f\x7f]")

SESSION_KEY_HEADER = "X-Hermes-Session-Key"
SESSION_ID_HEADER = "X-Hermes-Session-Id"


@dataclass(frozen=True)
class SessionRef:
    """A request's session: the key we use, and the id the client sent."""

    key: str
    original: str

    @property
    def mapped(self) -> bool:
        """Whether the key does not show the id as it was sent."""
        return not self.key.endswith(self.original)


TENANT = "hermes_sup.tenant"  # the scope's key for who made a request (app.py's `authed`)


def tenant_of(request: Any) -> Tenant:
    """The tenant an authenticated request was made by."""
    tenant: Tenant = request.scope[TENANT]
    return tenant


def key_for(original: str, room: int = MAX_KEY_LENGTH) -> str:
    """A valid session key for a client's id, at most `room` characters
    long: the id itself when it fits."""
    try:
        if len(original) <= room:
            return check_session_key(original)
    except RemoteProtocolError:
        pass
    part = min(READABLE_PART, room - 17)  # 17: "=" and 16 hex digits
    readable = _NOT_KEY_CHAR.sub("_", original)[:part].lstrip("._:@+=-")
    digest = hashlib.sha256(original.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return f"{readable}={digest}" if readable else f"id={digest}"


def ref_for(tenant: Tenant, original: str) -> SessionRef:
    """The session a client's id names for this key: the id's key itself
    where the key was granted it, else that key in the key's namespace."""
    plain = key_for(original)
    if tenant.granted(plain):
        return SessionRef(plain, original)
    prefix = tenant.prefix
    return SessionRef(prefix + key_for(original, MAX_KEY_LENGTH - len(prefix)), original)


def check_id(raw: str, what: str, where: str) -> str:
    """A client's session id or conversation name, or 400 naming what is
    wrong with it: control characters (a header could not carry them back,
    a log line would break on them), more than MAX_HEADER_ID characters,
    or spaces at either end (an answer's header cannot begin or end with
    one, so a turn would run whose answer could not be sent)."""
    if _UNSAFE.search(raw):
        raise ApiError(400, f"Invalid {what} in {where}: control characters", "invalid_session_id")
    if len(raw) > MAX_HEADER_ID:
        raise ApiError(
            400,
            f"{what.capitalize()} too long in {where} (at most {MAX_HEADER_ID})",
            "invalid_session_id",
        )
    if raw != raw.strip():
        raise ApiError(
            400, f"Invalid {what} in {where}: it begins or ends with a space", "invalid_session_id"
        )
    return raw


def header_id(headers: Any) -> str | None:
    """The session id a request names in its headers, checked; None if none."""
    for name, what in ((SESSION_KEY_HEADER, "session key"), (SESSION_ID_HEADER, "session ID")):
        raw = str(headers.get(name, "")).strip()
        if raw:
            return check_id(raw, what, name)
    return None


MAX_LABEL = 200  # the session option `label`: 1 to 200 printable characters


def label_of(original: str) -> str:
    """A client's id as a session label: printable, at most MAX_LABEL
    characters (others shown as escapes, the end cut with an ellipsis)."""
    shown = "".join(
        ch if ch.isprintable() else ch.encode("unicode_escape").decode() for ch in original
    )
    return shown if len(shown) <= MAX_LABEL else shown[: MAX_LABEL - 1] + "…"


# ------------------------------------------------------------------ content


def text_of(content: Any, where: str) -> str:
    """A message's text: a string, or the text parts of a content array.
    Other parts (images, files) are not passed on yet."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text"):
                text = part.get("text")
                if isinstance(text, str):
                    parts.append(text)
        return "\n".join(parts)
    raise ApiError(400, f"{where} must be a string or an array of content parts", "invalid_content")


@dataclass(frozen=True)
class ChatTurn:
    """What a chat-completions request asks: the newest user message, the
    system prompt, and the user and assistant messages before the newest
    (text only)."""

    text: str
    system: str | None
    history: list[dict[str, str]]


def parse_chat(body: dict[str, Any]) -> ChatTurn:
    """Read `messages` as Hermes's API server does; 400 when there is no turn."""
    messages = body.get("messages")
    if not messages or not isinstance(messages, list):
        raise ApiError(400, "Missing or invalid 'messages' field", "invalid_messages")
    system: str | None = None
    users: list[str] = []
    said: list[dict[str, str]] = []
    last_role = ""
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ApiError(400, f"messages[{i}] must be an object", "invalid_messages")
        role = msg.get("role")
        if role == "system" or role == "developer":
            text = text_of(msg.get("content"), f"messages[{i}].content")
            system = text if system is None else system + "\n" + text
        elif role in ("user", "assistant"):
            last_role = role
            text = text_of(msg.get("content"), f"messages[{i}].content")
            said.append({"role": role, "content": text})
            if role == "user":
                users.append(text)
    if not users or last_role != "user" or not users[-1].strip():
        raise ApiError(400, "No user message found in messages", "no_user_message")
    return ChatTurn(users[-1], system, said[:-1])


# What a runtime may take as a conversation id (the Hermes runtime's rule:
# it becomes a state.db key and part of file names).
MAX_CONVERSATION = 256
_UNSAFE_CONVERSATION = re.compile(r"[\x00-\x1f\x7f/\\]|\.\.")


def conversation_id(original: str) -> str:
    """The conversation id a runtime is given for a client's id: the id
    itself when a runtime can use it as a name, else its session key (the
    same readable part and hash), else only the hash."""
    for candidate in (original, key_for(original)):
        if len(candidate) <= MAX_CONVERSATION and not _UNSAFE_CONVERSATION.search(candidate):
            return candidate
    digest = hashlib.sha256(original.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return f"id={digest}"


def turn_context(
    instructions: str | None, history: list[dict[str, str]], conversation: str
) -> dict[str, Any]:
    """A turn's `context` for the session's runtime (PROTOCOL.md): the
    front end's system prompt and history for this turn, and its
    conversation id (one the runtime can use as a name). The runtime decides
    what to use (Hermes keeps its own history in the session's state.db)."""
    context: dict[str, Any] = {"conversation": conversation_id(conversation)}
    if instructions:
        context["instructions"] = instructions
    if history:
        context["history"] = history
    return context


def history_of(body: dict[str, Any], raw_input: Any) -> list[dict[str, str]]:
    """The conversation the front end sends with a run, as Hermes reads
    it: `conversation_history`, else the messages of an `input` array
    before its last one. Passed to the session's runtime as the turn's
    context; the runtime decides whether it needs it."""
    raw = body.get("conversation_history")
    if raw:
        if not isinstance(raw, list) or not all(
            isinstance(e, dict) and "role" in e and "content" in e for e in raw
        ):
            raise ApiError(
                400,
                "'conversation_history' must be an array of objects with 'role' and 'content'",
                "invalid_conversation_history",
            )
        return [
            {
                "role": str(e["role"]),
                "content": text_of(e["content"], f"conversation_history[{i}]"),
            }
            for i, e in enumerate(raw)
        ]
    if isinstance(raw_input, list):
        return [
            {
                "role": str(m["role"]),
                "content": text_of(m.get("content"), f"input[{i}].content"),
            }
            for i, m in enumerate(raw_input[:-1])
            if isinstance(m, dict) and m.get("role") and m.get("content")
        ]
    return []


def encode_id(original: str) -> str:
    """A session id as a run id's suffix (base64url, unpadded)."""
    raw = original.encode("utf-8", "surrogateescape")
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_id(encoded: str) -> str | None:
    """The session id of a run id's suffix; None if it is not one."""
    try:
        raw = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
        return raw.decode("utf-8", "surrogateescape")
    except (ValueError, UnicodeDecodeError):
        return None


def agent_model_of(body: dict[str, Any]) -> str | None:
    """A run's `agent_model`: the model its session's agent is to use for
    this turn (a chat's /model), on the session's own provider; not
    `model`, which clients send as a name and get echoed back."""
    model = body.get("agent_model")
    if model is None or model == "":
        return None
    if not isinstance(model, str) or not model.isprintable() or len(model) > 200:
        raise ApiError(
            400,
            "'agent_model' must be a model name of at most 200 printable characters",
            "invalid_agent_model",
        )
    return model
