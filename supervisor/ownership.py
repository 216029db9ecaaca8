"""Which sessions are this supervisor's: their leases and the fencing of
every write into their directories, for a data directory shared by
several supervisors (leases.py has the files and the locks).

`claim` takes a session's lease before its worker starts (or answers
`moved`, naming the node that holds it), and a session that is exited with
nothing queued gives it up (`release`). Every write into a session's
directory is fenced (`fenced`): it goes ahead only if the epoch there is
still ours; if not, the session was taken over while we were cut off,
nothing is written, and the session is given up (`on_lease_lost`). A
turn's start is fenced too (by the turns, right after its transition): a
turn writes into the session's files through its worker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from hermes_sup.local.logfmt import kv
from hermes_sup.protocol import ErrorCode, RemoteProtocolError

from .leases import Holder, LeaseHeld, LeaseLost, Leases, data_dir_shared, log_lost, read_holder
from .session import Session
from .spare_dirs import SpareDirs
from .states import State
from .store import SessionStore

log = logging.getLogger("hermes_sup.supervisor")


class Ownership:
    """This supervisor's leases of its sessions, and their fencing."""

    def __init__(self, node: str, store: SessionStore, spare_dirs: SpareDirs) -> None:
        settings = store.ctx.settings
        # Leases that can be lost while held need reading back (leases.py);
        # decided once: the data directory is fixed for the process's life.
        # With node leases (node_lease.py) a lock on a local disk can be
        # broken too, by another node once this one's node lease ran out.
        self.shared = settings.lease_time > 0 or data_dir_shared(
            settings.data_dir, settings.shared_data
        )
        self.leases = Leases(node, self.shared)
        self.store = store
        self.spare_dirs = spare_dirs
        spare_dirs.serve(node, self.leases)
        store.fenced = self.fenced
        # The hooks below are set where the parts are put together
        # (server.connect), the table's own `forget` by the table.
        # Stop the worker of a session whose lease was taken over (why).
        self.on_lease_lost: Callable[[Session, str], None] = lambda session, why: None
        # Forget a new session another node made meanwhile.
        self.forget: Callable[[Session], None] = lambda session: None
        # The session's lease is ours now (its journal is read), or no
        # longer (what was read is dropped).
        self.on_taken: Callable[[Session], None] = lambda session: None
        self.on_released: Callable[[Session], None] = lambda session: None

    def check_not_elsewhere(self, session: Session) -> None:
        """`moved` if another supervisor holds the session's lease now."""
        try:
            holder = self.leases.holder_elsewhere(session.dir)
        except OSError:
            return  # no directory (yet): nobody holds it
        if holder is not None and not (holder.node and self.leases.expired(holder.node)):
            raise moved_error(session.key, holder)  # (an expired holder's is taken: claim)

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
            for attempt in range(3):
                if lease is not None:
                    break
                session.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
                try:
                    lease = self.leases.take(session.dir)
                except FileNotFoundError:
                    # Another supervisor's spare was renamed over the empty
                    # directory we made, between our mkdir and our open: the
                    # lease file is in the new one; look again.
                    if attempt == 2:
                        raise
        except LeaseHeld as exc:
            if session.unsaved and session.state is State.EXITED and not session.queue:
                self.forget(session)  # another node made it: read it from disk next time
            raise moved_error(session.key, exc.holder) from None
        except OSError as exc:
            log.error(kv("lease_failed", session=session.key, error=exc))
            raise RemoteProtocolError(
                ErrorCode.INTERNAL,
                f"cannot take the lease of session {session.key!r} in {session.dir}: "
                f"{exc.strerror or exc}",
            ) from None
        assert lease is not None
        session.lease = lease
        self.on_taken(session)
        taken_over = session.epoch_seen and lease.epoch != session.epoch_seen + 1
        if session.unsaved and lease.epoch > 1 or taken_over:
            self.store.reread_meta(session)  # another supervisor had it since
        session.epoch_seen = lease.epoch
        if session.meta_dirty and not session.unsaved:
            self.store.save_meta(session)

    def release(self, session: Session) -> None:
        """Give the session's lease up (it is exited with nothing queued)."""
        lease, session.lease = session.lease, None
        if lease is not None:
            self.on_released(session)
            self.leases.release(lease)

    def fenced(self, session: Session) -> bool:
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

    def still_ours(self, session: Session) -> bool:
        """`fenced` without acting on a lease found lost: the next fenced
        step (a turn's start, a save) gives the session up."""
        lease = session.lease
        if lease is None:
            return False
        try:
            self.leases.check(lease)
        except LeaseLost:
            return False
        return True

    def holder(self, session: Session) -> Holder | None:
        """Who took a session over from us: whom its lease file names."""
        return read_holder(session.dir)


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
