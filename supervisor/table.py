"""The session table: every session the supervisor knows, by key, and the one
place a session's state changes.

A state change goes through `transition`, which applies the table in
states.py, keeps the count of sessions with a running worker (admission
reads it on every spawn, so it is kept, not counted), and publishes the
change to watchers.

Sessions a previous run left on disk are read at start (their
session.json, not their data) into `stored`: `list` shows them as exited,
and a request that names one (`logs`, `kill --purge`, a `send`) loads it as
an exited `Session` of the table, without starting a worker.

The table also keeps the sessions' leases (leases.py), for a data directory
shared by several supervisors: `claim` takes a session's lease before its
worker starts (or answers `moved`, naming the node that holds it), and a
session that is exited with nothing queued gives it up. Every write into a
session's directory is fenced (`_fenced`): it goes ahead only if the epoch
there is still ours; if not, the session was taken over while we were cut
off, nothing is written, and the session is given up (`on_lease_lost`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from hermes_sup.local.logfmt import kv
from hermes_sup.protocol import ErrorCode, RemoteProtocolError

from .context import Context
from .environment import SessionOptions, check_policy, parse_options
from .leases import Holder, LeaseHeld, LeaseLost, Leases, log_lost, read_holder
from .logs import SessionLog
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
from .states import LIVE_STATES, Event, State
from .watchers import Watchers
from .worktrees import Peer, branch_for, peers_text, repository_problem, write_peers

log = logging.getLogger("hermes_sup.supervisor")

RUNNING_STATES = LIVE_STATES - {State.STOPPING}
# Spare session directories taken by sessions started without a turn are
# made again this long after (those with a turn: when it ends).
REFILL_LATER = 0.25


class SessionTable:
    """Sessions by key, their state transitions, and their directories."""

    def __init__(self, ctx: Context, watchers: Watchers, spare_dirs: SpareDirs) -> None:
        self.ctx = ctx
        self.watchers = watchers
        self.spare_dirs = spare_dirs
        self._refill_timer: asyncio.TimerHandle | None = None
        self._refilling = False
        self.sessions: dict[str, Session] = {}
        self.running = 0  # sessions with a worker that is not being stopped
        # Sessions on disk from an earlier run, not loaded yet (never also in `sessions`).
        self.stored: dict[str, StoredSession] = {}
        # Keys whose worktree is being removed before their data is deleted:
        # no new worker for them meanwhile.
        self.purging: set[str] = set()
        # Sessions by the repository they work on, for their peers at each turn.
        self.by_repo: dict[str, dict[str, Session]] = {}
        self.leases = Leases(ctx.node)
        spare_dirs.serve(ctx.node, self.leases)
        # Set by the lifecycle: stop the worker of a session whose lease was
        # taken over (why), and stop a session gone idle while draining.
        self.on_lease_lost: Callable[[Session, str], None] = lambda session, why: None
        self.on_drained_idle: Callable[[Session], None] = lambda session: None
        self.load_stored()

    def load_stored(self) -> None:
        """Read which sessions an earlier run left on disk (see scan_sessions)."""
        started = time.perf_counter()
        found, skipped = scan_sessions(self.ctx.settings.data_dir)
        self.stored = {key: s for key, s in found.items() if key not in self.sessions}
        if found or skipped:
            log.info(
                kv(
                    "sessions_on_disk",
                    found=len(found),
                    skipped=skipped,
                    ms=round((time.perf_counter() - started) * 1000, 1),
                )
            )

    def __len__(self) -> int:
        return len(self.sessions)

    def get(self, key: str) -> Session | None:
        return self.sessions.get(key)

    def require(self, key: str) -> Session:
        """The session `key` (loaded from disk if an earlier run left it
        there), or a `no_such_session` error."""
        session = self.sessions.get(key)
        if session is None:
            # With a shared data directory, another node may have made it since.
            on_disk = (
                key in self.stored
                or (session_path(self.ctx.settings.data_dir, key) / SESSION_FILE).exists()
            )
            if not on_disk:
                raise RemoteProtocolError(ErrorCode.NO_SUCH_SESSION, f"no session {key!r}")
            session = self.find_or_create(key, None)
        if session.lease is None:
            self.check_not_elsewhere(session)
        return session

    # ------------------------------------------------------------- leases

    def check_not_elsewhere(self, session: Session) -> None:
        """`moved` if another supervisor holds the session's lease now."""
        try:
            holder = self.leases.holder_elsewhere(session.dir)
        except OSError:
            return  # no directory (yet): nobody holds it
        if holder is not None:
            raise moved_error(session.key, holder)

    def claim(self, session: Session) -> None:
        """Hold the session's lease before its worker starts: a new
        session's comes with a spare directory (renamed into place), an
        existing one's is taken in its directory. `moved` if another
        supervisor holds it."""
        if session.lease is not None:
            return
        lease = None
        if session.unsaved and not session.dir.exists():
            custom = session.options.workspace is not None
            lease = self.spare_dirs.take_leased(session.dir, with_workspace=not custom)
        try:
            if lease is None:
                session.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
                lease = self.leases.take(session.dir)
        except LeaseHeld as exc:
            if session.unsaved and session.state is State.EXITED and not session.queue:
                self._forget(session)  # another node made it: read it from disk next time
            raise moved_error(session.key, exc.holder) from None
        except OSError as exc:
            log.error(kv("lease_failed", session=session.key, error=exc))
            raise RemoteProtocolError(
                ErrorCode.INTERNAL,
                f"cannot take the lease of session {session.key!r} in {session.dir}: "
                f"{exc.strerror or exc}",
            ) from None
        session.lease = lease
        taken_over = session.epoch_seen and lease.epoch != session.epoch_seen + 1
        if session.unsaved and lease.epoch > 1 or taken_over:
            self._reread_meta(session)  # another supervisor had it since
        session.epoch_seen = lease.epoch
        if session.meta_dirty and not session.unsaved:
            self._save_meta(session)

    def release(self, session: Session) -> None:
        """Give the session's lease up (it is exited with nothing queued)."""
        lease, session.lease = session.lease, None
        if lease is not None:
            self.leases.release(lease)

    def _reread_meta(self, session: Session) -> None:
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

    def _fenced(self, session: Session) -> bool:
        """Whether a write into the session's directory may go ahead: we
        hold its lease and the epoch there is still ours. A lease taken
        over is given up here (logged, the worker stopped): False."""
        lease = session.lease
        if lease is None:
            return False
        try:
            self.leases.check(lease)
        except LeaseLost as exc:
            log_lost(session.key, exc)
            self.release(session)
            self.on_lease_lost(session, str(exc))
            return False
        return True

    def _forget(self, session: Session) -> None:
        """Drop an exited session from the table (its data stays)."""
        if session.log is not None:
            session.log.close()
        self.watchers.forget_follows(session)
        self.sessions.pop(session.key, None)
        if session.repo is not None:
            on_repo = self.by_repo.get(session.repo, {})
            on_repo.pop(session.key, None)
            if not on_repo:
                self.by_repo.pop(session.repo, None)

    def find_or_create(self, key: str, raw_options: object) -> Session:
        """Find or create a session; new options on a running one are a conflict."""
        settings = self.ctx.settings
        options = parse_options(raw_options) if raw_options is not None else None
        if options is not None:
            check_policy(
                options,
                settings.workspace_roots,
                (settings.runtime, *settings.runtimes),
                settings.allow_env,
                settings.repo_roots,
            )
        if key in self.purging:
            raise RemoteProtocolError(
                ErrorCode.BUSY,
                f"session {key!r} is being purged (its worktree removed); try again in a moment",
            )
        session = self.sessions.get(key)
        if session is None:
            path = session_path(settings.data_dir, key)
            fresh = not path.exists()
            meta = None if fresh else read_session_meta(path)
            stored = None if fresh else stored_options(meta, key, path)
            defaults = parse_options(settings.session_defaults or None)
            base = stored or defaults
            if options is not None and _label_only(options):
                # A label alone (as the HTTP endpoint gives a conversation
                # whose id it had to hash) names the session; it does not
                # replace what the operator's defaults or its stored
                # options say.
                options = replace(base, label=options.label)
            session = Session(key=key, dir=path, options=options or base)
            if fresh:
                self._choose_repo(session)
            else:
                bound = stored_worktree(meta)
                session.repo, session.branch = bound["repo"], bound["branch"]
            _check_same_repo(session, options)
            self.stored.pop(key, None)
            created = None if meta is None else meta.get("created")
            if isinstance(created, (int, float)) and not isinstance(created, bool):
                session.created_at = float(created)  # the session's, not this load's
            session.log = SessionLog(session.log_path, settings.log_max_bytes, settings.log_backups)
            session.history = deque(maxlen=settings.history)
            if fresh:
                session.unsaved = True  # written once its worker is asked for
            else:
                session.meta_dirty = options is not None  # written once its lease is ours
            self.sessions[key] = session
            if session.repo is not None:
                self.by_repo.setdefault(session.repo, {})[key] = session
            log.info(kv("session_new", session=key, dir=path.name))
        elif options is not None and options != session.options:
            _check_same_repo(session, options)
            if _label_only(options) or _same_but_label(options, session.options):
                # A label is for people: a new one applies at once, even to
                # a running worker (which never sees it).
                session.options = replace(
                    session.options, label=options.label or session.options.label
                )
                self._save_or_defer(session)
                return session
            if session.state in LIVE_STATES:
                raise RemoteProtocolError(
                    ErrorCode.SESSION_CONFLICT,
                    f"session {key!r} is running with other options; kill it to apply new ones",
                )
            session.options = options
            self._save_or_defer(session)
        return session

    def _save_or_defer(self, session: Session) -> None:
        """New options: written now if the session is ours (`moved` if it
        turns out not to be), else once its lease is (claim)."""
        if session.unsaved:
            return
        if session.lease is None:
            session.meta_dirty = True
            return
        self._save_meta(session)
        if session.lease is None:  # lost while writing: the client must know
            raise moved_error(session.key, self._holder(session))

    def _holder(self, session: Session) -> Holder | None:
        """Who took a session over from us: whom its lease file names."""
        return read_holder(session.dir)

    def _choose_repo(self, session: Session) -> None:
        """A new session's repository: its `repo` option, else the
        supervisor's `repo` unless it chose its own workspace. Fixed from
        now on (session.json keeps it), whatever later settings say."""
        repo = session.options.repo
        if repo is None and session.options.workspace is None and self.ctx.settings.repo:
            repo = self.ctx.settings.repo
            problem = repository_problem(repo)
            if problem is not None:
                raise RemoteProtocolError(
                    ErrorCode.BAD_CONFIG,
                    f"the supervisor's repo setting cannot be used: {problem}",
                )
        if repo is not None:
            session.repo = os.path.realpath(repo)
            session.branch = branch_for(session.key)

    def peers_of(self, session: Session) -> list[Peer]:
        """The other sessions with a running worker on the session's
        repository, by key."""
        if session.repo is None:
            return []
        on_repo = self.by_repo.get(session.repo, {})
        return [
            Peer(s.key, s.branch or "", s.state.value, s.options.label)
            for s in sorted(on_repo.values(), key=lambda s: s.key)
            if s is not session and s.state in RUNNING_STATES
        ]

    def refresh_peers(self, session: Session) -> None:
        """Rewrite the session's peers file (worktrees.write_peers), if it
        works on a repository; a failure is logged, never the turn's."""
        if session.repo is None or session.branch is None:
            return
        text = peers_text(
            session.key, session.repo, session.branch, self.peers_of(session), time.time()
        )
        if not self._fenced(session):
            return
        try:
            write_peers(session.dir, text)
        except OSError as exc:
            log.warning(kv("peers_not_written", session=session.key, error=exc.strerror or exc))

    def _save_meta(self, session: Session) -> None:
        """Rewrite a session's session.json; on a full disk the old one stays
        and the session is served all the same (it is rewritten at the next
        chance), with one line instead of an internal error per request.
        Fenced: written only while the session's lease is ours."""
        if not self._fenced(session):
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
        came with its lease (claim)."""
        if not session.unsaved:
            return
        session.unsaved = False
        self._save_meta(session)
        # The spare directory it took is made again after a turn ends
        # (refill_spare_dirs), not now: four mkdirs and a lease, about half
        # a millisecond, would stand between this worker's hello and the
        # supervisor reading it. A session started without a turn gets it
        # from the timer.
        if self._refill_timer is None and self.spare_dirs.wanted():
            loop = asyncio.get_running_loop()
            self._refill_timer = loop.call_later(REFILL_LATER, self.refill_spare_dirs)

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

    def transition(self, session: Session, event: Event, reason: str | None = None) -> None:
        """Apply `event` to the session (InvalidTransition if the table has
        no such move), count running workers, and tell watchers."""
        previous = session.state
        session.advance(event)
        self.running += (session.state in RUNNING_STATES) - (previous in RUNNING_STATES)
        self.watchers.publish(
            session,
            "state",
            {
                "state": session.state.value,
                "previous": previous.value,
                "pid": session.pid,
                "reason": reason,
            },
            bound=128 + 4 * len(reason or ""),  # UTF-8: at most 4 bytes a character
        )
        if session.state is State.EXITED and not session.queue:
            self.release(session)  # nothing waits: another node may take it
        elif self.ctx.draining and session.state is State.IDLE and not session.queue:
            self.on_drained_idle(session)
        elif event is Event.TURN and session.lease is not None:
            # A turn writes into the session's files (its state.db): a
            # session taken over meanwhile loses its worker, the turn `moved`.
            self._fenced(session)

    def purge(self, session: Session) -> str:
        """Forget a stopped session and delete its data (kill --purge); its
        worktree, if it has one, the lifecycle has removed first. Under its
        lease: one another supervisor took meanwhile is not deleted (the
        note says so)."""
        try:
            self.claim(session)
        except RemoteProtocolError as exc:
            self._forget(session)
            return f" (data kept: {exc.message})"
        if not self._fenced(session):
            return " (data kept: the session was taken over)"
        shutil.rmtree(session.dir, ignore_errors=True)
        self.release(session)
        self._forget(session)
        self.stored.pop(session.key, None)
        log.info(kv("purged", session=session.key))
        return ""

    def live_count(self) -> int:
        """Sessions this node holds the lease of (a worker, or turns waiting
        for one): what a drain waits to reach zero."""
        return sum(1 for s in list(self.sessions.values()) if s.lease is not None)

    def counts_by_state(self) -> dict[str, int]:
        """How many sessions are in each state (only states that occur).
        Copies the session list first: the metrics thread calls this too."""
        return dict(Counter(session.state.value for session in list(self.sessions.values())))

    def least_recent_idle(self, excluding: Session) -> Session | None:
        """The idle session (nothing queued) used longest ago, other than
        `excluding`: the one to stop when a new worker needs its slot."""
        idle = [
            s
            for s in self.sessions.values()
            if s.state is State.IDLE and not s.queue and s is not excluding
        ]
        return min(idle, key=lambda s: s.last_activity) if idle else None


def _check_same_repo(session: Session, options: SessionOptions | None) -> None:
    """Refuse options that name another repository than the session's: a
    session's repository is fixed when it is created."""
    if options is None or options.repo is None:
        return
    if session.repo is None or os.path.realpath(options.repo) != session.repo:
        raise RemoteProtocolError(
            ErrorCode.SESSION_CONFLICT,
            f"session {session.key!r} works "
            + (f"on {session.repo}" if session.repo else "without a repository")
            + "; a session's repository is fixed when it is created "
            "(kill --purge it to start over on another)",
        )


def _label_only(options: SessionOptions) -> bool:
    """Whether `options` set a label and nothing else."""
    return options.label is not None and replace(options, label=None) == SessionOptions()


def _same_but_label(a: SessionOptions, b: SessionOptions) -> bool:
    """Whether two sessions' options differ in their label at most."""
    return replace(a, label=None) == replace(b, label=None)


def moved_error(key: str, holder: Holder | None) -> RemoteProtocolError:
    """`moved`: the session's lease is held by another supervisor (named in
    the error's body as `node` and `endpoint` when its lease file says)."""
    detail: dict[str, Any] = {
        "reason": "leased",
        "node": holder.node if holder else None,
        "endpoint": holder.endpoint if holder else None,
    }
    where = holder.describe() if holder else "another supervisor"
    return RemoteProtocolError(
        ErrorCode.MOVED,
        f"session {key!r} is served by {where}, which holds its lease; "
        "send it there (a router does)",
        detail=detail,
    )
