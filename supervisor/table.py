"""The session table: every session the supervisor knows, by key, and the one
place a session's state changes.

A state change goes through `transition`, which applies the table in
states.py, keeps the count of sessions with a running worker (admission
reads it on every spawn, so it is kept, not counted), and publishes the
change to watchers. It reads no file: what must be fenced (a turn's start,
which writes into the session's files through its worker) is fenced by
its caller, through `ownership`.

Beside it, two parts it stands on: what the data directory holds of
sessions (`store`, store.py: session.json, sessions an earlier run left,
spare directories, peers files, purging) and which sessions are this
supervisor's (`ownership`, ownership.py: leases, and the fencing of every
write into a session's directory).
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import replace

from hermes_sup.local.logfmt import kv
from hermes_sup.protocol import ErrorCode, RemoteProtocolError

from .context import Context
from .environment import SessionOptions, check_policy, parse_options
from .logs import SessionLog
from .ownership import Ownership, moved_error
from .peers import Peer
from .session import (
    Session,
    read_session_meta,
    session_path,
    stored_options,
    stored_worktree,
)
from .spare_dirs import SpareDirs
from .states import LIVE_STATES, Event, State
from .store import SessionStore
from .watchers import Watchers
from .worktrees import branch_for, repository_problem

log = logging.getLogger("hermes_sup.supervisor")

RUNNING_STATES = LIVE_STATES - {State.STOPPING}
# A worker in these states beats, and may hang or go idle.
JUDGED_STATES = frozenset({State.IDLE, State.BUSY})


class SessionTable:
    """Sessions by key and their state transitions."""

    def __init__(self, ctx: Context, watchers: Watchers, spare_dirs: SpareDirs) -> None:
        self.ctx = ctx
        self.watchers = watchers
        self.sessions: dict[str, Session] = {}
        self.running = 0  # sessions with a worker that is not being stopped
        # Sessions whose worker is up (idle or busy): what periodic work
        # looks at, so that its cost follows these, not every session held.
        self.judged: dict[str, Session] = {}
        # Keys whose worktree is being removed before their data is deleted:
        # no new worker for them meanwhile.
        self.purging: set[str] = set()
        # Sessions by the repository they work on, for their peers at each turn.
        self.by_repo: dict[str, dict[str, Session]] = {}
        self.store = SessionStore(ctx, spare_dirs)
        self.ownership = Ownership(ctx.node, self.store, spare_dirs)
        self.ownership.forget = self._forget
        # Set where the parts are put together (server.py): stop a session
        # gone idle while draining (the lifecycle's).
        self.on_drained_idle: Callable[[Session], None] = lambda session: None
        # And health's: a session whose worker became idle or busy (its
        # deadlines change with its state).
        self.on_judged: Callable[[Session], None] = lambda session: None
        self.store.load_stored(self.sessions)

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
            if not self.store.on_disk(key):
                raise RemoteProtocolError(ErrorCode.NO_SUCH_SESSION, f"no session {key!r}")
            session = self.find_or_create(key, None)
        if session.lease is None:
            self.ownership.check_not_elsewhere(session)
        return session

    def _forget(self, session: Session) -> None:
        """Drop an exited session from the table (its data stays)."""
        if session.log is not None:
            session.log.close()
        self.watchers.forget_follows(session)
        self.sessions.pop(session.key, None)
        self.judged.pop(session.key, None)
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
            known = self.store.stored.pop(key, None)
            if known is not None:
                # Loaded from disk is not active: it stays idle since its log last changed.
                session.last_activity = known.last_activity
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
        self.store.save_meta(session)
        if session.lease is None:  # lost while writing: the client must know
            raise moved_error(session.key, self.ownership.holder(session))

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

    def refresh_peers(self, session: Session, checked: bool = False) -> None:
        """Rewrite the session's peers file, if it works on a repository
        (store.write_peers); `checked`: the caller has just fenced it."""
        if session.repo is not None:
            self.store.write_peers(session, self.peers_of(session), checked)

    def transition(self, session: Session, event: Event, reason: str | None = None) -> None:
        """Apply `event` to the session (InvalidTransition if the table has
        no such move), count running workers, and tell watchers."""
        previous = session.state
        session.advance(event)
        self.running += (session.state in RUNNING_STATES) - (previous in RUNNING_STATES)
        if session.state in JUDGED_STATES:
            self.judged[session.key] = session
            self.on_judged(session)
        elif previous in JUDGED_STATES:
            self.judged.pop(session.key, None)
        self.watchers.publish(
            session,
            "state",
            {
                "state": session.state.value,
                "previous": previous.value,
                "pid": session.pid,
                "reason": reason,
                "at": time.time(),
            },
            bound=160 + 4 * len(reason or ""),  # UTF-8: at most 4 bytes a character
        )
        if session.state is State.EXITED and not session.queue:
            self.ownership.release(session)  # nothing waits: another node may take it
        elif self.ctx.draining and session.state is State.IDLE and not session.queue:
            self.on_drained_idle(session)

    def purge(self, session: Session) -> str:
        """Forget a stopped session and delete its data (kill --purge); its
        worktree, if it has one, the lifecycle has removed first. Under its
        lease: one another supervisor took meanwhile is not deleted (the
        note says so)."""
        try:
            self.ownership.claim(session)
        except RemoteProtocolError as exc:
            self._forget(session)
            return f" (data kept: {exc.message})"
        if not self.ownership.fenced(session):
            return " (data kept: the session was taken over)"
        self.store.delete(session)
        self.ownership.release(session)
        self._forget(session)
        log.info(kv("purged", session=session.key))
        return ""

    def live_count(self) -> int:
        """Sessions this node holds the lease of (a worker, or turns waiting
        for one): what a drain waits to reach zero."""
        return sum(1 for s in list(self.sessions.values()) if s.lease is not None)

    def counts_by_state(self) -> dict[str, int]:
        """How many sessions are in each state (only states that occur).
        Copies the session list first: the metrics thread calls this too."""
        return dict(Counter(session.listed_state for session in list(self.sessions.values())))

    def least_recent_idle(self, excluding: Session) -> Session | None:
        """The idle session (nothing queued) used longest ago, other than
        `excluding`: the one to stop when a new worker needs its slot."""
        idle = [
            s
            for s in self.judged.values()
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
