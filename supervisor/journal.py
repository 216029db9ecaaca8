"""The turn journal: what became of each turn, kept in its session's
directory, so that a turn runs at most once across restarts and nodes.

Theory of operation
-------------------
A turn's id is its `send` message's id, which the client chooses (a fresh
one per call, the same one for a retry). In memory the supervisor already
answers a repeat of an id it took with the same turn (turns.py). That
memory dies with the supervisor, and another node sharing the data
directory never had it: the journal is the part that survives.

Each session's directory holds `turns`, msgpack records appended one
`write` each (O_APPEND):

    {"t": id, "e": "start", "at": wall, "node": node}     before it runs
    {"t": id, "e": "end", "at": wall, "k": kind, "b": body, "n": bytes}

`start` is written before the worker is given the turn (`begin`, or the
spawn request that carries it), `end` with its one final answer (the body
is kept up to KEEP_BODY bytes; beyond, only its size, and a repeat gets
`too_large`). Every write is made by the supervisor holding the session's
lease (leases.py), after the fenced state change that precedes it, and
sealed sessions see the directory read-only.

When a supervisor takes a session's lease, it reads the journal: an id
started and never ended was running when its supervisor died (its worker
went with it, by the parent-death signal), so it is ended there and then
as `interrupted`. What it did before then stays done; it is never run
again. The ids read are kept in memory while the lease is held (a few
dozen bytes each, at most JOURNAL_TURNS), and dropped with it.

A `send` whose id the journal knows is answered from it: the recorded
final answer (as the reply to the new request), or the error it ended
with, or `interrupted`. `turn_status` reads the journal of a session held
by no one, or by another node, straight from disk (a turn started there
and not ended is `running` while that node holds the lease).

Bounded: past 2 x JOURNAL_TURNS records the file is rewritten with the
newest JOURNAL_TURNS turns (a new file renamed over the old one), and the
time of the oldest turn kept is written first, so that an id not found is
`unknown` only for turns sent after it.

Durability: a record is in the page cache once written, so it survives the
supervisor's death (kill -9, a crash); on NFS, close() sends it to the
server (close-to-open), so another node reads it. A power loss may lose
the newest records of a local file system (no fsync per turn: that would
add milliseconds to every turn).
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

from hermes_sup.local.logfmt import kv
from hermes_sup.protocol import ErrorCode, Kind, Message, error_message

from .session import Session

log = logging.getLogger("hermes_sup.supervisor")

JOURNAL_FILE = "turns"
JOURNAL_TURNS = 128
KEEP_BODY = 64 * 1024
MAX_JOURNAL_BYTES = 64 * 1024 * 1024  # a file larger is not read (not ours)


class Entry:
    """One turn as the journal has it."""

    __slots__ = ("id", "started", "node", "ended", "kind", "body", "size")

    def __init__(self, turn_id: str) -> None:
        self.id = turn_id
        self.started: float | None = None
        self.node: str | None = None
        self.ended: float | None = None
        self.kind: str | None = None
        self.body: dict[str, Any] | None = None
        self.size = 0

    def record(self) -> list[dict[str, Any]]:
        """The records that say this entry (for a rewrite)."""
        out: list[dict[str, Any]] = []
        if self.started is not None:
            out.append({"t": self.id, "e": "start", "at": self.started, "node": self.node})
        if self.ended is not None:
            end: dict[str, Any] = {"t": self.id, "e": "end", "at": self.ended, "k": self.kind}
            end["n"] = self.size
            if self.body is not None:
                end["b"] = self.body
            out.append(end)
        return out


def read(session_dir: Path) -> tuple[OrderedDict[str, Entry], float | None, int]:
    """The journal of a session directory: its entries (oldest first), the
    time of the oldest turn kept after a rewrite (None: it was never
    rewritten), and its number of records. A torn last record (a write cut
    short) is ignored."""
    entries: OrderedDict[str, Entry] = OrderedDict()
    since: float | None = None
    count = 0
    try:
        with open(session_dir / JOURNAL_FILE, "rb") as f:
            data = f.read(MAX_JOURNAL_BYTES)
    except FileNotFoundError:
        return entries, None, 0
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=True)
    unpacker.feed(data)
    try:
        for rec in unpacker:
            count += 1
            if not isinstance(rec, dict):
                continue
            if "since" in rec and isinstance(rec["since"], int | float):
                since = float(rec["since"])
                continue
            turn_id = rec.get("t")
            if not isinstance(turn_id, str):
                continue
            entry = entries.get(turn_id) or Entry(turn_id)
            entries[turn_id] = entry
            at = rec.get("at")
            at = float(at) if isinstance(at, int | float) else 0.0
            if rec.get("e") == "start":
                entry.started = at
                entry.node = rec.get("node") if isinstance(rec.get("node"), str) else None
            elif rec.get("e") == "end":
                entry.ended = at
                entry.kind = str(rec.get("k"))
                body = rec.get("b")
                entry.body = body if isinstance(body, dict) else None
                size = rec.get("n")
                entry.size = size if isinstance(size, int) else 0
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        pass  # a torn or damaged tail: what came before stands
    return entries, since, count


def interrupted_message(turn_id: str, session: str, entry: Entry) -> Message:
    where = f"node {entry.node}" if entry.node else "another supervisor"
    return error_message(
        ErrorCode.INTERRUPTED.value,
        f"turn {turn_id!r} started on {where} at "
        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(entry.started or 0))} UTC, and "
        "its supervisor stopped before it ended (its worker went with it); it was not "
        "run again, and what it did before then stays done",
        session=session,
    )


def recorded_answer(entry: Entry, session: str, re: str) -> Message:
    """The answer to a repeat of a turn the journal has: its final answer
    again, `too_large` if that was not kept, or `interrupted`."""
    if entry.ended is None:
        msg = interrupted_message(entry.id, session, entry)
    elif entry.body is None:
        msg = error_message(
            ErrorCode.TOO_LARGE.value,
            f"turn {entry.id!r} has ended; at {entry.size} bytes its answer was too large "
            f"to keep (limit {KEEP_BODY}); the turn was not run again",
            session=session,
        )
    else:
        kind = Kind(entry.kind) if entry.kind in (Kind.REPLY, Kind.ERROR) else Kind.ERROR
        return Message(kind, entry.body, session=session, re=re)
    return Message(msg.kind, msg.body, session=session, re=re)


class TurnJournal:
    """The journals of the sessions whose lease this supervisor holds.

    `fenced(session)` is the ownership's check that the lease is still ours
    (a write goes ahead only then)."""

    def __init__(self, node: str, fenced: Callable[[Session], bool]) -> None:
        self.node = node
        self.fenced = fenced
        # Per session held: the ids the journal has, and its records' count.
        self.held: dict[str, OrderedDict[str, Entry]] = {}
        self.records: dict[str, int] = {}

    # -- the lease ---------------------------------------------------------

    def taken(self, session: Session) -> None:
        """We hold the session's lease now: read its journal, and end as
        `interrupted` each turn a supervisor before us started and never
        ended."""
        try:
            entries, _, count = read(session.dir)
        except OSError as exc:
            log.warning(kv("journal_unread", session=session.key, error=exc.strerror or exc))
            entries, count = OrderedDict(), 0
        for entry in entries.values():
            entry.body = None  # read again from disk if asked for: not kept in memory
        self.held[session.key] = entries
        self.records[session.key] = count
        for entry in list(entries.values()):
            if entry.started is not None and entry.ended is None:
                log.warning(
                    kv("turn_interrupted", session=session.key, turn=entry.id, node=entry.node)
                )
                final = interrupted_message(entry.id, session.key, entry)
                self._end(session, entry.id, final.kind.value, final.body, 0)

    def released(self, session: Session) -> None:
        self.held.pop(session.key, None)
        self.records.pop(session.key, None)

    # -- a turn ----------------------------------------------------------

    def known(self, session: Session, turn_id: str) -> Entry | None:
        """The journal's entry for `turn_id` (its final answer read from
        disk), if the session is held here and the journal has it."""
        entries = self.held.get(session.key)
        if entries is None or turn_id not in entries:
            return None
        try:
            on_disk, _, _ = read(session.dir)
        except OSError:
            on_disk = OrderedDict()
        return on_disk.get(turn_id) or entries[turn_id]

    def started(self, session: Session, turn_id: str) -> None:
        entries = self.held.get(session.key)
        if entries is None:
            return  # not held (a bug elsewhere): nothing is written unfenced
        entry = entries.get(turn_id) or Entry(turn_id)
        entry.started, entry.node = time.time(), self.node
        entries[turn_id] = entry
        self._append(session, {"t": turn_id, "e": "start", "at": entry.started, "node": self.node})

    def ended(self, session: Session, final: Message, size: int) -> None:
        """A turn's final answer (`final.re` is its id), when the session is held."""
        if final.re is None or session.key not in self.held or not self.fenced(session):
            return
        body = final.body if size <= KEEP_BODY else None
        self._end(session, final.re, final.kind.value, body, size)

    def _end(
        self, session: Session, turn_id: str, kind: str, body: dict[str, Any] | None, size: int
    ) -> None:
        entries = self.held[session.key]
        entry = entries.get(turn_id) or Entry(turn_id)
        entry.ended, entry.kind, entry.size = time.time(), kind, size
        entries[turn_id] = entry
        rec: dict[str, Any] = {"t": turn_id, "e": "end", "at": entry.ended, "k": kind, "n": size}
        if body is not None:
            rec["b"] = body
        self._append(session, rec)
        while len(entries) > JOURNAL_TURNS:
            entries.popitem(last=False)

    def _append(self, session: Session, rec: dict[str, Any]) -> None:
        path = session.dir / JOURNAL_FILE
        try:
            data = msgpack.packb(rec, use_bin_type=True)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        except (OSError, TypeError, ValueError) as exc:
            # A full disk, or a body msgpack cannot carry: the turn is served
            # all the same, and a repeat of it is only caught in memory.
            log.warning(kv("journal_unwritten", session=session.key, error=exc))
            return
        count = self.records.get(session.key, 0) + 1
        self.records[session.key] = count
        if count > 2 * JOURNAL_TURNS:
            self._rewrite(session)

    def _rewrite(self, session: Session) -> None:
        """Keep the newest JOURNAL_TURNS turns: a new file renamed over the old."""
        if not self.fenced(session):
            return
        try:
            entries, _, _ = read(session.dir)
            kept = list(entries.values())[-JOURNAL_TURNS:]
            since = min((e.started or e.ended or 0.0) for e in kept) if kept else time.time()
            records = [{"since": since}] + [r for e in kept for r in e.record()]
            tmp = session.dir / f".{JOURNAL_FILE}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, b"".join(msgpack.packb(r, use_bin_type=True) for r in records))
            finally:
                os.close(fd)
            os.replace(tmp, session.dir / JOURNAL_FILE)
        except OSError as exc:
            log.warning(kv("journal_unwritten", session=session.key, error=exc.strerror or exc))
            return
        self.records[session.key] = len(records)


def turn_state(
    session_dir: Path, turn_id: str, holder: str | None
) -> tuple[str, Entry | None, float | None]:
    """What the journal on disk says of a turn: `ended`, `running` (started,
    not ended, its session held by `holder`), `interrupted` (started, not
    ended, held by no one) or `unknown`; its entry; and since when the
    journal is complete (None: from the session's first turn)."""
    entries, since, _ = read(session_dir)
    entry = entries.get(turn_id)
    if entry is None:
        return "unknown", None, since
    if entry.ended is not None:
        return "ended", entry, since
    if entry.started is not None:
        return ("running" if holder else "interrupted"), entry, since
    return "unknown", entry, since
