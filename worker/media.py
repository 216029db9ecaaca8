"""Files a turn made for its user (a TTS voice note, an image), sent as events.

A `media` event carries the file itself, read by the worker: a front end
never opens a path a session names, so a session can hand on only what it
could read itself (a sealed session cannot make the endpoint read the
operator's files). Bytes, not a path, also reach a front end on another
host. One file is at most MAX_MEDIA_BYTES; a larger one is announced with
its size and no data, so the front end can say so.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

MAX_MEDIA_BYTES = 8 * 1024 * 1024
MAX_NAME = 120
_UNSAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")


def media_event(path: str | Path, voice: bool) -> dict[str, Any]:
    """The `media` event data for a file: {name, voice, size, data} (data
    None when the file is over MAX_MEDIA_BYTES), or {name, error}."""
    name = _UNSAFE_NAME.sub("_", Path(path).name)[-MAX_NAME:] or "file"
    try:
        # O_NOFOLLOW: the file itself, not where a link put in its place leads.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        return {"name": name, "error": f"cannot read {name}: {exc.strerror}"}
    with os.fdopen(fd, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > MAX_MEDIA_BYTES:
            return {"name": name, "voice": voice, "size": size, "data": None}
        data = fh.read(MAX_MEDIA_BYTES + 1)
    if len(data) > MAX_MEDIA_BYTES:  # it grew while read
        return {"name": name, "voice": voice, "size": len(data), "data": None}
    return {"name": name, "voice": voice, "size": len(data), "data": data}
