"""Files a run's agent made for its user (a TTS voice note, an image).

The worker sends each as a `media` event with the file's bytes (worker/
media.py): the endpoint never opens a path a session names. A run keeps
them in memory while it is kept (at most MAX_RUN_MEDIA_BYTES a run; what
comes after is announced without its bytes), publishes `media.available`
{media_id, name, voice, size, content_type, available}, and serves each at
`GET /v1/runs/{run_id}/media/{media_id}`, to the key that may reach the run.
"""

from __future__ import annotations

import mimetypes
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from starlette.responses import Response

from .errors import ApiError

MAX_RUN_MEDIA_BYTES = 32 * 1024 * 1024
MAX_KEY_MEDIA_BYTES = 64 * 1024 * 1024
_NAME = re.compile(r"[A-Za-z0-9._-]{1,120}")
# What Hermes's TTS and image tools make; anything else is an octet stream.
CONTENT_TYPES = {".ogg": "audio/ogg", ".opus": "audio/ogg", ".mp3": "audio/mpeg"}


@dataclass(frozen=True)
class MediaFile:
    """One file of a run, as its worker sent it."""

    name: str
    voice: bool
    size: int
    data: bytes | None  # None: over a limit, announced only

    @property
    def content_type(self) -> str:
        suffix = "." + self.name.rpartition(".")[2].lower() if "." in self.name else ""
        guessed = CONTENT_TYPES.get(suffix) or mimetypes.guess_type(self.name)[0]
        return guessed or "application/octet-stream"


def media_of(data: Any, room: int) -> MediaFile | None:
    """The worker's `media` event data as a file (its bytes kept only within
    `room`), or None when it is not a file (an error the worker reported,
    or a malformed event: the session's, never the endpoint's trouble)."""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    name = data["name"] if _NAME.fullmatch(data["name"]) else "file"
    blob = data.get("data")
    if not isinstance(blob, bytes):
        blob = None
    size = len(blob) if blob is not None else data.get("size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        return None
    if blob is not None and len(blob) > room:
        blob = None
    return MediaFile(name, data.get("voice") is True, size, blob)


class HasMedia(Protocol):
    """A run, as far as its files go (runs.py's `Run`)."""

    owner: str
    created_at: float
    media: list[MediaFile]


def record_media(runs: Iterable[HasMedia], run: HasMedia, data: Any) -> dict[str, Any] | None:
    """A `media` event: kept with `run`, and its `media.available` event to
    publish (None when it was no file). A key's runs (`runs`: every run
    kept) keep at most MAX_KEY_MEDIA_BYTES: its oldest files' bytes go
    first (fetching one then answers 410), so no key's sessions can fill
    the endpoint's memory."""
    used = sum(len(m.data) for m in run.media if m.data is not None)
    media = media_of(data, MAX_RUN_MEDIA_BYTES - used)
    if media is None:
        return None
    if media.data is not None:
        _make_room(runs, run.owner, len(media.data))
    run.media.append(media)
    return {
        "event": "media.available",
        "media_id": len(run.media) - 1,
        "name": media.name,
        "voice": media.voice,
        "size": media.size,
        "content_type": media.content_type,
        "available": media.data is not None,
    }


def _make_room(runs: Iterable[HasMedia], owner: str, size: int) -> None:
    theirs = sorted((r for r in runs if r.owner == owner and r.media), key=lambda r: r.created_at)
    kept = [(r, i) for r in theirs for i, m in enumerate(r.media) if m.data is not None]
    total = sum(len(r.media[i].data or b"") for r, i in kept)
    for r, i in kept:
        if total + size <= MAX_KEY_MEDIA_BYTES:
            break
        old = r.media[i]
        total -= len(old.data or b"")
        r.media[i] = MediaFile(old.name, old.voice, old.size, None)


def media_response(run_id: str, media: list[MediaFile], raw: str) -> Response:
    """The bytes of file `raw` (its index, as the URL gives it) of a run."""
    index = int(raw) if raw.isdigit() and len(raw) < 6 else -1
    if not 0 <= index < len(media):
        raise ApiError(404, f"Run {run_id} has no media {raw[:20]!r}", "media_not_found")
    found = media[index]
    if found.data is None:
        raise ApiError(
            410,
            f"Media {index} of run {run_id} ({found.size} bytes) was too large to keep",
            "media_too_large",
        )
    disposition = f'attachment; filename="{found.name}"'
    return Response(
        found.data,
        media_type=found.content_type,
        headers={"Content-Disposition": disposition, "X-Content-Type-Options": "nosniff"},
    )
