"""Each key's notices, kept until its front end acknowledges them.

A notice (a background process ended, a cron job's output) comes once,
outside any turn, and a messaging gateway may be down or restarting just
then: delivered only to the streams open at that moment, it was lost. The
book reads every notice from the moment the endpoint starts and keeps each
on its key's shelf under a cursor (1, 2, 3, ... per key, never reused) and
an id, until the key acknowledges a cursor (`POST /v1/notices/ack`): then
every notice up to it is gone. A stream opened after a cursor is handed
what came after it, then each new one (notices.py): at least once.

Bounded: a key keeps at most `MAX_KEPT` notices, a session at most
`MAX_PER_SESSION` of them (a session that floods pushes out its own, not
its neighbours'), each at most 64 KiB (the supervisor drops a larger one,
supervisor/turns.py); each dropped unread is logged. Each shelf is a file in
the endpoint's data (`<data dir>/http/notices/`), rewritten when notices
leave it and appended to when one comes, so a restarted endpoint has them
too. Which key a notice is of: the namespace of its session's key
(keys.py); a session outside every key's namespace has no shelf.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import uuid
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hermes_sup.client import ClientError

from .errors import ApiError
from .keys import in_a_namespace
from .logsafe import kv

log = logging.getLogger("hermes_sup.httpapi")

NOTICE = "notice"
MAX_KEPT = 1000  # notices a key keeps unacknowledged
MAX_PER_SESSION = 100  # of them, one session's
RETRY = (0.5, 1.0, 2.0, 5.0)  # seconds before watching again after the supervisor went


@dataclass(frozen=True)
class Entry:
    """One kept notice."""

    cursor: int
    id: str
    session_key: str  # the hermes-sup session's key
    client_key: str  # the id the key's client named that session by
    notice: Any

    def line(self) -> dict[str, Any]:
        """What a stream sends of it (its `data:`)."""
        return {
            "id": self.id,
            "cursor": self.cursor,
            "session_key": self.session_key,
            "client_key": self.client_key,
            "notice": self.notice,
        }


class Shelf:
    """One key's notices, oldest first, and its file."""

    def __init__(self, prefix: str, path: Path | None) -> None:
        self.prefix = prefix
        self.path = path
        self.entries: deque[Entry] = deque()
        self.per_session: Counter[str] = Counter()
        self.acked = 0  # the highest cursor acknowledged
        self.changed = asyncio.Event()  # set, and replaced, when a notice comes
        self._load()

    @property
    def next_cursor(self) -> int:
        """The cursor the next notice gets."""
        return max(self.acked, self.entries[-1].cursor if self.entries else 0) + 1

    def after(self, cursor: int) -> list[Entry]:
        """The notices kept with a cursor past `cursor`, oldest first."""
        return [e for e in self.entries if e.cursor > cursor]

    def add(self, session_key: str, notice: Any) -> Entry:
        """Keep a notice of `session_key` and wake the streams waiting."""
        entry = Entry(
            self.next_cursor,
            uuid.uuid4().hex,
            session_key,
            session_key[len(self.prefix) :],
            notice,
        )
        dropped = self._make_room(session_key)
        self.entries.append(entry)
        self.per_session[session_key] += 1
        if dropped:
            self._save()
        else:
            self._append(entry)
        self.changed.set()
        self.changed = asyncio.Event()
        return entry

    def ack(self, cursor: int) -> int:
        """Forget every notice up to `cursor` (at most the last one given);
        the cursor acknowledged now."""
        cursor = min(cursor, self.next_cursor - 1)
        if cursor <= self.acked:
            return self.acked
        while self.entries and self.entries[0].cursor <= cursor:
            self._forget(self.entries.popleft())
        self.acked = cursor
        self._save()
        return cursor

    def _make_room(self, session_key: str) -> bool:
        """Drop the oldest notice of the session, or of the key, when either
        is at its bound; whether one was dropped."""
        victim: Entry | None = None
        if self.per_session[session_key] >= MAX_PER_SESSION:
            victim = next(e for e in self.entries if e.session_key == session_key)
            self.entries.remove(victim)
        elif len(self.entries) >= MAX_KEPT:
            victim = self.entries.popleft()
        if victim is None:
            return False
        self._forget(victim)
        log.warning(
            kv("http_notice_dropped", session=victim.session_key, cursor=victim.cursor,
               reason="unacknowledged notices over the bound")
        )  # fmt: skip
        return True

    def _forget(self, entry: Entry) -> None:
        self.per_session[entry.session_key] -= 1
        if self.per_session[entry.session_key] <= 0:
            del self.per_session[entry.session_key]

    # ------------------------------------------------------------ the file

    def _load(self) -> None:
        if self.path is None or not self.path.exists():
            return
        try:
            lines = self.path.read_text(errors="replace").splitlines()
        except OSError as exc:
            log.warning(kv("http_notices_unread", path=self.path, error=exc))
            return
        for line in lines:
            try:
                item = json.loads(line)
                if "acked" in item:
                    self.acked = max(self.acked, int(item["acked"]))
                    continue
                entry = Entry(
                    int(item["cursor"]), str(item["id"]), str(item["session_key"]),
                    str(item["client_key"]), item["notice"],
                )  # fmt: skip
            except (ValueError, KeyError, TypeError):
                continue  # a line cut by a crash while it was written
            if entry.cursor > self.acked:
                self.entries.append(entry)
                self.per_session[entry.session_key] += 1

    def _append(self, entry: Entry) -> None:
        if self.path is None:
            return
        try:
            with open(self.path, "a", encoding="utf-8", opener=_private) as file:
                file.write(json.dumps(entry.line()) + "\n")
        except OSError as exc:  # kept in memory still: the disk is the endpoint's trouble
            log.warning(kv("http_notices_unsaved", path=self.path, error=exc))

    def _save(self) -> None:
        if self.path is None:
            return
        lines = [json.dumps({"acked": self.acked})]
        lines += [json.dumps(e.line()) for e in self.entries]
        temp = self.path.with_suffix(".tmp")
        try:
            with open(temp, "w", encoding="utf-8", opener=_private) as file:
                file.write("\n".join(lines) + "\n")
            os.replace(temp, self.path)
        except OSError as exc:
            log.warning(kv("http_notices_unsaved", path=self.path, error=exc))


def _private(path: str, flags: int) -> int:
    return os.open(path, flags, 0o600)


def prefix_of(session_key: str) -> str | None:
    """The key namespace (`NAME+NS+`, keys.py) a session key is in, if any:
    it names the shelf's file, so nothing else does."""
    if not in_a_namespace(session_key):
        return None
    name, namespace, _ = session_key.split("+", 2)
    return f"{name}+{namespace}+"


class NoticeBook:
    """Every key's shelf, filled from the supervisor's notices."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self.shelves: dict[str, Shelf] = {}
        self.task: asyncio.Task[None] | None = None
        if directory is not None:
            try:
                directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            except OSError as exc:  # kept in memory only: lost with the endpoint
                log.warning(kv("http_notices_unsaved", path=directory, error=exc))
                self.directory = None
                return
            for path in sorted(directory.glob("*.jsonl")):
                self.shelf(path.stem)

    def shelf(self, prefix: str) -> Shelf:
        """The shelf of the key whose namespace is `prefix`."""
        shelf = self.shelves.get(prefix)
        if shelf is None:
            path = None if self.directory is None else self.directory / f"{prefix}.jsonl"
            shelf = self.shelves[prefix] = Shelf(prefix, path)
        return shelf

    def add(self, session_key: str, notice: Any) -> Entry | None:
        """Keep a notice of `session_key`, on its key's shelf (None: no key's)."""
        prefix = prefix_of(session_key)
        if prefix is None:
            return None
        return self.shelf(prefix).add(session_key, notice)

    def start(self, client: Any) -> None:
        """Read the supervisor's notices from now on (`client()` is the
        endpoint's supervisor client, made on first use)."""
        self.task = asyncio.get_running_loop().create_task(self._watch(client))

    async def close(self) -> None:
        """Stop reading notices."""
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    async def _watch(self, client: Any) -> None:
        tries = 0
        while True:  # for as long as the endpoint runs
            try:
                async for event in client().watch(None, types=[NOTICE]):
                    tries = 0
                    if event.type == NOTICE and event.session:
                        self.add(event.session, plain(event.data))
            except (ClientError, ApiError) as exc:  # the supervisor not there (yet), or gone
                log.warning(kv("http_notices_unwatched", error=exc))
            await asyncio.sleep(RETRY[min(tries, len(RETRY) - 1)])
            tries += 1


def plain(value: Any) -> Any:
    """JSON-safe: bytes a worker put in a notice are not sent on."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)
