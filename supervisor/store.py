"""What the data directory holds of sessions: their session.json, the
sessions an earlier run left there, the spare directories made ahead, the
peers file of a session on a repository, and deleting a session's data.

Sessions a previous run left on disk are read at start (their
session.json, not their data) into `stored`: `list` shows them as exited,
and a request that names one (`logs`, `kill --purge`, a `send`) loads it as
an exited `Session` of the table (table.py), without starting a worker.

Every write into a session's directory is fenced: it goes ahead only while
the session is this supervisor's (`fenced`, given by ownership.py); a
session taken over meanwhile gets no write of ours.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Callable
from typing import Any

from hermes_sup.local.logfmt import kv

from .context import Context
from .peers import Peer, peers_text, write_peers
from .session import (
    SESSION_FILE,
    Session,
    StoredSession,
    read_session_meta,
    save_session_meta,
    scan_sessions,
    session_path,
    stored_options,
    stored_worktree,
)
from .spare_dirs import SpareDirs

log = logging.getLogger("hermes_sup.supervisor")

# Spare session directories taken by sessions started without a turn are
# made again this long after (those with a turn: when it ends).
REFILL_LATER = 0.25


class SessionStore:
    """Sessions' files in the data directory."""

    def __init__(self, ctx: Context, spare_dirs: SpareDirs) -> None:
        self.ctx = ctx
        self.spare_dirs = spare_dirs
        # Sessions on disk from an earlier run, not loaded yet (never also
        # in the table's sessions).
        self.stored: dict[str, StoredSession] = {}
        # Whether a session's directory may be written now (ownership.py).
        self.fenced: Callable[[Session], bool] = lambda session: True
        self._refill_timer: asyncio.TimerHandle | None = None
        self._refilling = False

    def load_stored(self, loaded: set[str] | dict[str, Any]) -> None:
        """Read which sessions an earlier run left on disk (see
        scan_sessions), but those `loaded` already."""
        started = time.perf_counter()
        found, skipped = scan_sessions(self.ctx.settings.data_dir)
        self.stored = {key: s for key, s in found.items() if key not in loaded}
        if found or skipped:
            log.info(
                kv(
                    "sessions_on_disk",
                    found=len(found),
                    skipped=skipped,
                    ms=round((time.perf_counter() - started) * 1000, 1),
                )
            )

    def on_disk(self, key: str) -> bool:
        """Whether a session of this key is in the data directory (an
        earlier run's, or another node's on a shared one)."""
        return (
            key in self.stored
            or (session_path(self.ctx.settings.data_dir, key) / SESSION_FILE).exists()
        )

    # --------------------------------------------------------- session.json

    def reread_meta(self, session: Session) -> None:
        """Another supervisor held the session since we last did: what its
        session.json says now (options, repository) replaces ours, unless
        this request brought options of its own."""
        meta = read_session_meta(session.dir)
        if meta is None:
            session.meta_dirty = True  # purged meanwhile, made again: write ours
            return
        session.unsaved = False
        try:
            stored = stored_options(meta, session.key, session.dir)
        except RuntimeError:
            stored = None
        if stored is not None and not session.meta_dirty:
            session.options = stored
        bound = stored_worktree(meta)
        session.repo, session.branch = bound["repo"], bound["branch"]
        created = meta.get("created")
        if isinstance(created, (int, float)) and not isinstance(created, bool):
            session.created_at = float(created)

    def save_meta(self, session: Session) -> None:
        """Rewrite a session's session.json; on a full disk the old one stays
        and the session is served all the same (it is rewritten at the next
        chance), with one line instead of an internal error per request.
        Fenced: written only while the session's lease is ours."""
        if not self.fenced(session):
            session.meta_dirty = True
            return
        session.meta_dirty = False
        try:
            save_session_meta(session)
        except OSError as exc:
            log.warning(kv("session_meta_failed", session=session.key, error=exc.strerror or exc))

    def save_new(self, session: Session) -> None:
        """Write a new session's session.json, once its first worker has
        been asked for (the fork need not wait for the disk); its directory
        came with its lease (ownership.claim)."""
        if not session.unsaved:
            return
        session.unsaved = False
        self.save_meta(session)
        # The spare directory it took is made again after a turn ends
        # (refill_spare_dirs), not now: four mkdirs and a lease, about half
        # a millisecond, would stand between this worker's hello and the
        # supervisor reading it. A session started without a turn gets it
        # from the timer.
        if self._refill_timer is None and self.spare_dirs.wanted():
            loop = asyncio.get_running_loop()
            self._refill_timer = loop.call_later(REFILL_LATER, self.refill_spare_dirs)

    # ------------------------------------------------------ spare directories

    def refill_spare_dirs(self) -> None:
        """Make the spare session directories taken since the last time, in
        a thread: making them is system calls (mkdir, open, fcntl, write),
        which let go of the interpreter, so the loop serves meanwhile. One
        refill at a time; the spares list is only appended to there and
        only popped from here, each atomic under the GIL."""
        if self._refill_timer is not None:
            self._refill_timer.cancel()
            self._refill_timer = None
        # Not while shutting down: the next start sweeps what is left.
        if self._refilling or not self.ctx.accepting or not self.spare_dirs.wanted():
            return
        self._refilling = True
        loop = asyncio.get_running_loop()
        done = loop.run_in_executor(None, self.spare_dirs.refill, self.spare_dirs.target)
        done.add_done_callback(self._refilled)

    def _refilled(self, done: asyncio.Future[None]) -> None:
        self._refilling = False
        if not done.cancelled() and done.exception() is not None:
            log.error("making spare session directories failed", exc_info=done.exception())

    # ----------------------------------------------------------------- peers

    def write_peers(self, session: Session, peers: list[Peer], checked: bool = False) -> None:
        """Rewrite the session's peers file (peers.write_peers), if it
        works on a repository; a failure is logged, never the turn's.
        `checked`: the caller has just made sure the session is ours."""
        if session.repo is None or session.branch is None:
            return
        text = peers_text(session.key, session.repo, session.branch, peers, time.time())
        if session.lease is None or (not checked and not self.fenced(session)):
            return  # not ours (a failed check releases the lease)
        try:
            write_peers(session.dir, text)
        except OSError as exc:
            log.warning(kv("peers_not_written", session=session.key, error=exc.strerror or exc))

    # ------------------------------------------------------------------ purge

    def delete(self, session: Session) -> None:
        """Delete the session's data (its lease is ours: the caller checked)."""
        shutil.rmtree(session.dir, ignore_errors=True)
        self.stored.pop(session.key, None)
