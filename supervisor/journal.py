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
spawn request that carries it); a turn whose `start` cannot be written (a
full disk) is not run at all but answered `disk_full`, its id left unspent,
since a resend after a restart could not tell that it ran. `end` is written
with its one final answer (the body
is kept up to KEEP_BODY bytes; beyond, only its size, and a repeat gets
`too_large`). Every write is made by the supervisor holding the session's
lease (leases.py), after the fenced state change that precedes it, and
sealed sessions see the directory read-only.

When a supervisor takes a session's lease, it reads the journal: an id
started and never ended was running when its supervisor died (its worker
went with it, by the parent-death signal), so it is ended there and then
as `interrupted`. What it did before then stays done; it is never run
again. The ids read are kept in memory while the lease is held (a few
dozen bytes each, at most 2 x JOURNAL_TURNS), and dropped with it.

A `send` whose id the journal knows is answered from it: the recorded
final answer (as the reply to the new request), or the error it ended
with, or `interrupted`. `turn_status` reads the journal of a session held
by no one, or by another node, straight from disk (a turn started there
and not ended is `running` while that node holds the lease).

Bounded, as a log is rotated: once `turns` holds 2 x JOURNAL_TURNS
records (JOURNAL_TURNS turns), it is renamed `turns.1` (the older one
dropped) and a new `turns` begun, so the newest JOURNAL_TURNS to 2 x
JOURNAL_TURNS turns are kept, for one rename per JOURNAL_TURNS turns. A
new file that follows a dropped one begins with the time of the oldest
record still kept (`since`): an id not found is `unknown` only for turns
sent after it.

Durability: a record is in the page cache once written, so it survives the
supervisor's death (kill -9, a crash); on NFS, close() sends it to the
server (close-to-open), so another node reads it. So where the data
directory is shared (leases.py, "Where the lock can be lost") each record
is one open, write and close; where it is not, the file is kept open while
the lease is held, and a record is one write (O_APPEND) on it. A power loss may lose
the newest records of a local file system (no fsync per turn: that would
add milliseconds to every turn).
"""

from __future__ import annotations

import errno
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
OLDER_FILE = "turns.1"
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


def read(session_dir: Path) -> tuple[OrderedDict[str, Entry], float | None, int]:
    """The journal of a session directory: its entries (oldest first), the
    time of the oldest record kept once older ones were dropped (None:
    none was), and the number of records in its newer file. A torn last
    record (a write cut short) is ignored."""
    entries: OrderedDict[str, Entry] = OrderedDict()
    since: float | None = None
    count = 0
    for name in (OLDER_FILE, JOURNAL_FILE):
        try:
            with open(session_dir / name, "rb") as f:
                data = f.read(MAX_JOURNAL_BYTES)
        except FileNotFoundError:
            continue
        count, marked = _parse(data, entries)
        if marked is not None:
            since = marked if since is None else max(since, marked)
    return entries, since, count


def _parse(data: bytes, entries: OrderedDict[str, Entry]) -> tuple[int, float | None]:
    """Add one file's records to `entries`: their count, and its `since`."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=True)
    unpacker.feed(data)
    count, since = 0, None
    try:
        for rec in unpacker:
            count += 1
            if not isinstance(rec, dict):
                continue
            turn_id = rec.get("t")
            if not isinstance(turn_id, str):
                if isinstance(rec.get("since"), int | float):
                    since = float(rec["since"])
                continue
            entry = entries.get(turn_id)
            if entry is None:
                entry = entries[turn_id] = Entry(turn_id)
            at = rec.get("at")
            at = float(at) if isinstance(at, int | float) else 0.0
            if rec.get("e") == "start":
                entry.started = at
                node = rec.get("node")
                entry.node = node if isinstance(node, str) else None
            elif rec.get("e") == "end":
                entry.ended = at
                entry.kind = str(rec.get("k"))
                body = rec.get("b")
                entry.body = body if isinstance(body, dict) else None
                size = rec.get("n")
                entry.size = size if isinstance(size, int) else 0
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        pass  # a torn or damaged tail: what came before stands
    return count, since


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

    def __init__(self, node: str, fenced: Callable[[Session], bool], shared: bool = True) -> None:
        self.node = node
        self.fenced = fenced
        # A shared data directory: open and close each record's file (see
        # "Durability"); else each held session's file stays open, in `fds`.
        self.shared = shared
        self.fds: dict[str, int] = {}
        # Per session held: the ids the journal has, and its records' count.
        self.held: dict[str, OrderedDict[str, Entry]] = {}
        self.records: dict[str, int] = {}
        self.paths: dict[str, str] = {}  # each held session's journal file
        self.first: dict[str, float] = {}  # the time of its first record

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
        self._close(session.key)
        self.held.pop(session.key, None)
        self.records.pop(session.key, None)
        self.paths.pop(session.key, None)
        self.first.pop(session.key, None)

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

    def started(self, session: Session, turn_id: str) -> OSError | None:
        """Record that a turn starts, before its worker has it. The error
        when the record could not be written (a full disk): the turn must
        then not run, since nothing would stop a resend after a restart
        from running it a second time. The in-memory entry goes too, so a
        retry of the id is a new start, not a repeat of one."""
        entries = self.held.get(session.key)
        if entries is None:
            return None  # not held (a bug elsewhere): nothing is written unfenced
        at = time.time()
        failed = self._append(session, {"t": turn_id, "e": "start", "at": at, "node": self.node})
        if failed is not None:
            return failed
        entry = entries.get(turn_id)
        if entry is None:
            entry = entries[turn_id] = Entry(turn_id)
        entry.started, entry.node = at, self.node
        return None

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
        while len(entries) > 2 * JOURNAL_TURNS:
            entries.popitem(last=False)

    def _append(self, session: Session, rec: dict[str, Any]) -> OSError | None:
        """Append one record; the error if it could not be written whole."""
        key = session.key
        path = self.paths.get(key)
        if path is None:
            path = self.paths[key] = os.path.join(session.dir, JOURNAL_FILE)
        if self.records.get(key, 0) >= 2 * JOURNAL_TURNS:
            self._rotate(session, path)
        try:
            self._write(key, path, msgpack.packb(rec, use_bin_type=True))
        except (TypeError, ValueError) as exc:
            # A body msgpack cannot carry (an end record): that turn's end
            # is kept in memory only, and a repeat of it caught there.
            log.warning(kv("journal_unwritten", session=key, error=exc))
            return OSError(errno.EINVAL, str(exc))
        except OSError as exc:
            log.warning(kv("journal_unwritten", session=key, error=exc.strerror or exc))
            return exc
        if not self.records.get(key):
            self.first[key] = float(rec.get("at") or time.time())
        self.records[key] = self.records.get(key, 0) + 1
        return None

    def _write(self, key: str, path: str, data: bytes) -> None:
        """One record onto the end of the session's journal file."""
        fd = self.fds.get(key)
        if fd is None:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            if not self.shared:
                self.fds[key] = fd
        try:
            written = os.write(fd, data)
            if written != len(data):
                # Cut short by a full disk: a torn record, which read()
                # ignores; the next record must not follow it, so the
                # tail is cut back to where it was.
                os.ftruncate(fd, os.fstat(fd).st_size - written)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        finally:
            if self.shared:
                os.close(fd)

    def _close(self, key: str) -> None:
        """Close the session's kept journal file, if it has one."""
        fd = self.fds.pop(key, None)
        if fd is not None:
            os.close(fd)

    def _rotate(self, session: Session, path: str) -> None:
        """`turns` becomes `turns.1` (the older one dropped); a new `turns`
        follows, saying since when the journal is complete."""
        key = session.key
        if not self.fenced(session):
            return
        older = os.path.join(session.dir, OLDER_FILE)
        dropping = os.path.exists(older)
        self._close(key)  # the kept descriptor would follow the file to turns.1
        try:
            os.replace(path, older)
        except OSError as exc:
            log.warning(kv("journal_unrotated", session=key, error=exc.strerror or exc))
            return
        self.records[key] = 0
        if dropping:
            since = self.first.get(key, time.time())
            data = msgpack.packb({"since": since})
            try:
                self._write(key, path, data)
            except OSError as exc:
                log.warning(kv("journal_unwritten", session=key, error=exc.strerror or exc))
                return
            self.records[key] = 1
            self.first[key] = since


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
