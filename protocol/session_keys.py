"""Session keys: what front ends may name a session, and where its data lives.

Keys come from outside (chat ids, user ids, UUIDs), so they are validated
against a small character set and are never used as a path component: a
session's directory is named by a digest of its key.
"""

from __future__ import annotations

import hashlib
import re

from .errors import ErrorCode, RemoteProtocolError

MAX_KEY_LENGTH = 128

# A letter or digit first (so no ".", ".." or "-option" lookalikes), then
# letters, digits and . _ : @ + = - . No "/" and no whitespace or controls.
_KEY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+=-]*")

KEY_RULE = (
    f"1 to {MAX_KEY_LENGTH} characters: a letter or digit, then letters, digits and . _ : @ + = -"
)


def check_session_key(key: object) -> str:
    """Return `key` if it is a valid session key, else raise RemoteProtocolError."""
    if not isinstance(key, str):
        raise RemoteProtocolError(
            ErrorCode.BAD_SESSION_KEY, f"session key must be a string, got {type(key).__name__}"
        )
    if not key or len(key) > MAX_KEY_LENGTH or not _KEY_RE.fullmatch(key):
        shown = key if len(key) <= 40 else key[:40] + "..."
        raise RemoteProtocolError(
            ErrorCode.BAD_SESSION_KEY, f"invalid session key {shown!r}: must be {KEY_RULE}"
        )
    return key


def session_dir_name(key: str) -> str:
    """The directory name for a session: a digest, never the raw key."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:32]
