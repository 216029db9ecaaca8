"""Where a chat turn that names no conversation goes, and what it remembers.

Open WebUI, LibreChat and the plain openai SDK send no session header:
they resend the whole conversation each time. Hermes's own API server then
takes the history from the request. Two things must hold here too: the
model sees exactly the messages this client sent (never another
conversation's that began alike, never its own twice after an edit or a
regenerate), and two such clients never share a worker, while the next
turn of the same conversation still finds its worker warm (a new Hermes
worker costs its imports and agent: about 2.3 s here, against 50 ms for a
turn in a warm one).

So each turn that ends with a reply leaves a note, kept in memory: the
digest of the conversation as its client now holds it (the key, the
session header if any, the system prompt, every user and assistant
message with the reply just sent, spaces at their ends ignored) maps to the
session and the conversation id that hold exactly that. A request whose
messages before its last are such a conversation takes the note and goes
on there, in that conversation, whose history the runtime holds already
(Hermes in its state.db; the history sent with the turn is used only if
the session's data was purged). A note taken before (the client
regenerates its last answer, or edits its last message) still names the
session, but its conversation has moved on: the turn starts a new
conversation there, with the history it sent. Any other request (a first
message, an edit further back, a conversation this endpoint no longer
remembers) starts a conversation of its own with the history it sent: in
a new session of its own when it named none (`api-` and 16 random hex
digits, in the key's namespace), else in the session its
X-Hermes-Session-Key names.

Two conversations in two sessions that are exactly alike (their replies
too) would leave the same note: then the note is spoilt and neither goes
on from it, so they are never joined. A client that knows a
conversation's every message and reply reaches its session, within its own
key only; a front end that serves many people under one key should name
each conversation (X-Hermes-Session-Id). At most LIMIT notes of each key
are kept, the oldest dropped (its conversation then goes on in a new
session).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict

from .sessions import SessionRef

LIMIT = 10_000
SPOILT = None  # the note of conversations in two sessions that are exactly alike


def new_conversation_id() -> str:
    """An id for a conversation no client named (as Hermes derives its own,
    `api-` and 16 hex digits, but never the same for two)."""
    return "api-" + os.urandom(8).hex()


def digest(
    owner: str,
    session: str,
    system: str | None,
    messages: list[dict[str, str]],
) -> bytes:
    """What identifies a conversation as its client holds it."""
    said = [(m["role"], m["content"].strip()) for m in messages]
    text = _ENCODER.encode([owner, session, (system or "").strip(), said])
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


_ENCODER = json.JSONEncoder(ensure_ascii=False)  # made once: json.dumps makes one a call


# A note: the session, the conversation, and whether a turn went on from it.
Note = tuple[SessionRef, str, bool] | None  # None: spoilt


class Continuations:
    """The notes (see the module docstring), by key (its namespace), then
    by digest: at most `limit` of each key's, so that one key's many
    conversations never push out another's."""

    def __init__(self, limit: int = LIMIT) -> None:
        self.limit = limit
        self._notes: dict[str, OrderedDict[bytes, Note]] = {}

    def __len__(self) -> int:
        return sum(len(notes) for notes in self._notes.values())

    def take(self, owner: str, at: bytes) -> tuple[SessionRef, str | None] | None:
        """Where the conversation `at` names goes on: its session, and its
        conversation the first time (None after: a new one there); None
        if no note (or a spoilt one) names it."""
        notes = self._notes.get(owner)
        note = notes.get(at) if notes is not None else None
        if notes is None or note is None:
            return None
        ref, conversation, taken = note
        notes[at] = (ref, conversation, True)
        notes.move_to_end(at)
        return ref, None if taken else conversation

    def leave(self, owner: str, at: bytes, ref: SessionRef, conversation: str) -> None:
        """Note that `conversation` in `ref`'s session now holds what `at`
        names; spoil the note if another session holds it too."""
        notes = self._notes.setdefault(owner, OrderedDict())
        note = notes.get(at)
        if at in notes and (note is None or note[0] != ref):
            notes[at] = SPOILT
        else:
            notes[at] = (ref, conversation, False)
        notes.move_to_end(at)
        while len(notes) > self.limit:
            notes.popitem(last=False)
