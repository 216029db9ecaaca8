"""The front: what clients ask of the supervisor, one handler per request kind.

`on_frames` checks a request before any handler sees it: its signature (by
the key of the socket it came in on), that it is not a replay, and that it
has not outlived its time to live (its sender has given up on it, so it is
not carried out). A bad request gets an error reply that names what is
wrong, and the supervisor goes on serving everyone else. A handler refuses
with `RemoteProtocolError`; any other exception is a bug, logged with its
traceback and answered as `internal`.

Each handler keeps the order of its side effects: for a `send`, the worker
is started before the client is acknowledged, so the fork overlaps the
answer.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable

from hermes_sup.door import remote
from hermes_sup.local.logfmt import kv
from hermes_sup.local.version import version
from hermes_sup.protocol import (
    PROTOCOL_VERSION,
    ErrorCode,
    Kind,
    Message,
    RemoteProtocolError,
    ReplayGuard,
    check_session_key,
    decode,
    error_message,
)
from hermes_sup.protocol.exits import signal_named

from .context import Context
from .endpoints import Endpoints
from .journal import recorded_answer
from .lifecycle import Lifecycle
from .limits import TreeUsage, scan_trees
from .logread import requested_lines
from .orphans import MAX_GRACE
from .pool import WorkerPool
from .reports import Reports
from .resends import SentTurn
from .session import Session, StoredSession, Turn
from .states import State, Stop
from .table import SessionTable
from .turns import Turns
from .watchers import MAX_PER_CLIENT, MAX_WATCHERS, Watchers

log = logging.getLogger("hermes_sup.supervisor")

APPROVAL_CHOICES = ("once", "session", "always", "deny")
# Front socket 0 is the local control socket; others (TCP) are remote.
LOCAL_FRONT = 0


class Front:
    """Client requests, checked and dispatched."""

    def __init__(
        self,
        ctx: Context,
        table: SessionTable,
        turns: Turns,
        lifecycle: Lifecycle,
        watchers: Watchers,
        pool: WorkerPool,
        endpoints: Endpoints,
        reload: Callable[[], tuple[list[str], list[str]]],
    ) -> None:
        self.ctx = ctx
        self.table = table
        self.turns = turns
        self.lifecycle = lifecycle
        self.watchers = watchers
        watchers.per_client_limit = self._watch_limit
        self.pool = pool
        self.endpoints = endpoints
        self.reload = reload
        self.guard = ReplayGuard()
        turns.forget_id = self.guard.forget  # a turn refused before it ran
        # What list, status and inspect answer.
        self.reports = Reports(ctx, table, turns, pool, endpoints)
        # A router's ping arrived (node_lease.py renews the node's lease).
        self.on_router_ping: Callable[[], None] = lambda: None
        self.handlers: dict[Kind, Callable[[bytes, Message], None]] = {
            Kind.PING: self.ping,
            Kind.OPEN: self.open_session,
            Kind.SEND: self.send,
            Kind.CANCEL: self.cancel,
            Kind.LIST: self.list_sessions,
            Kind.KILL: self.kill,
            Kind.WATCH: self.watch,
            Kind.UNWATCH: self.unwatch,
            Kind.LOGS: self.logs,
            Kind.STATUS: self.status,
            Kind.APPROVE: self.approve,
            Kind.RELOAD: self.reload_request,
            Kind.SIGNAL: self.signal_session,
            Kind.INSPECT: self.inspect,
            Kind.TURN_STATUS: self.turn_status,
            Kind.SHUTDOWN: self.shutdown,
            Kind.DRAIN: self.drain,
        }

    def on_frames(self, index: int, frames: list[bytes]) -> None:
        """A request from a client on front socket `index`."""
        if len(frames) < 2:
            return
        client, rest = bytes([index]) + frames[0], frames[1:]
        endpoints = self.endpoints
        try:
            msg = decode(rest, endpoints.client_key(index), endpoints.limits)
            if msg.kind is Kind.SEND and msg.id in self.turns.sends:
                self.turns.sends.resend(client, msg)  # refused (replayed) unless its own client's
                return
            now = time.time()
            self.guard.check(msg.id, msg.ts, now)
            if msg.ttl is not None and now - msg.ts > msg.ttl:
                # Its sender has stopped waiting and told its caller it failed;
                # not carried out, its id may come again (a retry).
                self.guard.forget(msg.id)
                raise RemoteProtocolError(
                    ErrorCode.EXPIRED,
                    f"the {msg.kind.value!r} request arrived {now - msg.ts:.1f}s after it was "
                    f"sent, past its {msg.ttl:g}s time to live; it was not carried out",
                    msg_id=msg.id,
                )
        except RemoteProtocolError as exc:
            log.warning(kv("bad_request", code=exc.code.value, error=exc.message))
            endpoints.error(client, exc.code, exc.message, exc.msg_id, None)
            return
        handler = self.handlers.get(msg.kind)
        if handler is None:
            endpoints.error(
                client,
                ErrorCode.UNKNOWN_KIND,
                f"{msg.kind.value!r} is not a request a client can send",
                msg.id,
                msg.session,
            )
            return
        try:
            handler(client, msg)
        except RemoteProtocolError as exc:
            if exc.code is ErrorCode.MOVED or msg.kind is Kind.SEND:
                # Refused before it did anything (a `send` raises only before
                # its turn is queued): the same message may come again.
                self.guard.forget(msg.id)
            endpoints.to_client(
                client,
                error_message(
                    exc.code.value, exc.message, re=msg.id, session=msg.session, detail=exc.detail
                ),
            )
        except Exception as exc:
            log.exception(kv("bug", kind=msg.kind.value))
            endpoints.error(
                client, ErrorCode.INTERNAL, f"internal error: {exc}", msg.id, msg.session
            )

    def _check_accepting(self) -> None:
        if not self.ctx.accepting:
            raise RemoteProtocolError(
                ErrorCode.SHUTTING_DOWN, "the supervisor is shutting down; try again after restart"
            )

    # ------------------------------------------------------------ sessions

    def ping(self, client: bytes, msg: Message) -> None:
        if client[0] != LOCAL_FRONT and remote.is_router(self.endpoints.peer_name(client)):
            self.on_router_ping()  # a router reaches us: the node lease is renewed
        self.endpoints.to_client(
            client,
            msg.reply(
                Kind.PONG,
                {
                    "version": version(),
                    "protocol": PROTOCOL_VERSION,
                    "pid": os.getpid(),
                    "uptime": time.time() - self.ctx.started,
                },
            ),
        )

    def open_session(self, client: bytes, msg: Message) -> None:
        key = check_session_key(msg.session)
        self._check_accepting()
        existing = self.table.get(key)
        created = existing is None or existing.state is State.EXITED
        session = self.table.find_or_create(key, msg.body.get("options"))
        self.lifecycle.admit(session)
        if session.state is State.EXITED:
            self.lifecycle.start_worker(session)
        session.touch()
        self.endpoints.to_client(
            client,
            msg.reply(
                Kind.OPENED,
                {"pid": session.pid, "state": session.state.value, "created": created},
            ),
        )

    def send(self, client: bytes, msg: Message) -> None:
        key = check_session_key(msg.session)
        grace = orphan_grace(msg.body.get("orphan_grace"))
        self._check_accepting()
        session = self.table.find_or_create(key, msg.body.get("options"))
        s = self.ctx.settings
        turns = self.turns
        # Refuse a full queue before making room: that may evict another session.
        if len(session.queue) >= s.max_queue or turns.queued_total >= s.max_queued_total:
            raise RemoteProtocolError(
                ErrorCode.BUSY,
                f"session {key!r} already has {len(session.queue)} turns waiting "
                f"(limit {s.max_queue}; {turns.queued_total} waiting in all, limit "
                f"{s.max_queued_total}); try again when it catches up",
            )
        self.lifecycle.admit(session)
        known = turns.journal.known(session, msg.id)
        short = turns.reserve.shortfall() if known is None else None
        if short is not None:
            # Below the reserve, new turns wait: the room left is for the
            # records of those running (a repeat is still answered below).
            if session.state is State.EXITED and not session.queue:
                self.table.ownership.release(session)
            raise RemoteProtocolError(ErrorCode.DISK_FULL, short)
        if known is not None:
            # Run before (on another node, or before a restart): never again.
            # Each repeat is answered the same way, so its id stays unspent.
            self.guard.forget(msg.id)
            self.endpoints.to_client(client, recorded_answer(known, key, msg.id))
            if session.state is State.EXITED and not session.queue:
                self.table.ownership.release(session)
            return
        turn = Turn(
            id=msg.id,
            client=client,
            text=msg.body["text"],
            context=msg.body.get("context"),
            orphan_grace=grace,
        )
        turns.note_send(msg)  # `ack: false`: no `running` event when it starts
        turns.enqueue(session, turn)
        turns.sends.remember(msg.id, SentTurn(session=key, turn=turn, client=client))
        session.touch()
        if session.state is State.IDLE and len(session.queue) == 1:
            turns.pump(session)  # runs now: its `running` status is the acknowledgement
            return
        position = len(session.queue)
        if session.state is State.EXITED:
            self.lifecycle.start_worker(session)  # first: the fork starts while we answer
        elif session.state is State.BACKOFF:
            self.lifecycle.schedule_retry(session)
        # Acknowledge at once, so a client can tell a slow turn from a dead supervisor.
        self.endpoints.to_client(
            client,
            msg.reply(
                Kind.EVENT,
                {"type": "status", "data": {"state": "queued", "position": position}},
            ),
        )
        turns.pump(session)

    def cancel(self, client: bytes, msg: Message) -> None:
        key = check_session_key(msg.session)
        session = self.table.require(key)
        cancelled = self.turns.cancel(session, msg.body.get("turn"))
        self.endpoints.to_client(client, msg.reply(Kind.CANCELLED, {"turn": cancelled}))

    def approve(self, client: bytes, msg: Message) -> None:
        """An answer to an approval request of the running turn, for its worker."""
        key = check_session_key(msg.session)
        session = self.table.require(key)
        choice = msg.body["choice"]
        if choice not in APPROVAL_CHOICES:
            raise RemoteProtocolError(
                ErrorCode.BAD_FIELD,
                f"approval choice {choice[:20]!r} is not once, session, always or deny",
            )
        turn = session.current
        if turn is None:
            raise RemoteProtocolError(
                ErrorCode.NOTHING_TO_APPROVE, f"session {key!r} has no running turn to approve"
            )
        if not session.approvals:
            raise RemoteProtocolError(
                ErrorCode.NOTHING_TO_APPROVE,
                f"session {key!r} has no approval request waiting: it was answered or timed "
                "out, or none was asked",
            )
        waiting = session.approvals[0]
        named = msg.body.get("approval")
        if named is not None and named != waiting:
            # A late answer must never approve a different command.
            raise RemoteProtocolError(
                ErrorCode.NOTHING_TO_APPROVE,
                f"approval {named[:40]!r} of session {key!r} is not waiting (it was answered "
                f"or timed out); the one waiting is {waiting!r}",
            )
        body = {"choice": choice, "approval": waiting} if waiting else {"choice": choice}
        if not self.endpoints.to_worker(session, Message(Kind.APPROVE, body, session=key)):
            raise RemoteProtocolError(
                ErrorCode.NOTHING_TO_APPROVE, f"session {key!r} has no running turn to approve"
            )
        session.approvals.pop(0)
        self.watchers.publish(session, "approval_answer", body, turn=turn.id)
        self.endpoints.to_client(client, msg.reply(Kind.APPROVED, {**body, "turn": turn.id}))

    def kill(self, client: bytes, msg: Message) -> None:
        key = check_session_key(msg.session)
        session = self.table.require(key)
        force = bool(msg.body.get("force", False))
        purge = bool(msg.body.get("purge", False))
        # With purge: the session's branch goes too (its worktree always does).
        delete_branch = bool(msg.body.get("delete_branch", False))

        async def kill_and_reply() -> None:
            session.stopping(Stop.REQUEST)  # not for idleness, even if it was asleep
            pid, reason = await self.lifecycle.killer.kill_session(session, force=force)
            if purge and session.state is State.EXITED and self.table.get(key) is session:
                note = await self.lifecycle.preparation.purge(session, delete_branch)
                reason += ", data purged" + note
            self.endpoints.to_client(client, msg.reply(Kind.KILLED, {"pid": pid, "reason": reason}))

        self.ctx.spawn(kill_and_reply())

    # ---------------------------------------------------------- observing

    def list_sessions(self, client: bytes, msg: Message) -> None:
        prefix = msg.body.get("prefix", "")
        state = msg.body.get("state")
        chosen = [
            s
            for key, s in self.table.sessions.items()
            if key.startswith(prefix) and (state is None or s.listed_state == state)
        ]
        # Sessions an earlier run left on disk are exited ones, too.
        stored = [
            s
            for key, s in self.table.store.stored.items()
            if key.startswith(prefix) and state in (None, State.EXITED.value)
        ]
        self.ctx.spawn(self._list_reply(client, msg, chosen, stored))

    async def _list_reply(
        self, client: bytes, msg: Message, chosen: list[Session], stored: list[StoredSession]
    ) -> None:
        """Answer `list` with stats sampled now (psutil, in a thread), never
        from a background stats loop."""
        pids = [s.pid for s in chosen if s.pid is not None]
        usage: dict[int, TreeUsage] = {}
        if pids:
            usage = await asyncio.get_running_loop().run_in_executor(None, scan_trees, pids, True)
        rows = self.reports.session_rows(chosen, stored, usage, time.monotonic())
        self.endpoints.to_client(client, msg.reply(Kind.SESSIONS, {"sessions": rows}))

    def status(self, client: bytes, msg: Message) -> None:
        info = self.reports.supervisor_info()
        self.endpoints.to_client(client, msg.reply(Kind.INFO, {"supervisor": info}))

    def watch(self, client: bytes, msg: Message) -> None:
        session = self.table.get(msg.session) if msg.session else None
        self.watchers.watch(client, msg, session)

    def _watch_limit(self, client: bytes) -> int:
        """How many watches and log follows `client` may have open: a
        router's key (remote.is_router) speaks for many front ends and may
        use every slot; it holds each front end to MAX_PER_CLIENT itself."""
        if client[0] != LOCAL_FRONT and remote.is_router(self.endpoints.peer_name(client)):
            return MAX_WATCHERS
        return MAX_PER_CLIENT

    def unwatch(self, client: bytes, msg: Message) -> None:
        self.watchers.unwatch(client, msg)

    def logs(self, client: bytes, msg: Message) -> None:
        key = check_session_key(msg.session)
        session = self.table.require(key)
        follow = bool(msg.body.get("follow"))
        if follow:
            self.watchers.check_room(client)  # `busy` before any line is sent
        lines = requested_lines(session.log_path, msg.body, self.ctx.settings.log_backups)
        self.endpoints.to_client(client, msg.reply(Kind.LOG_LINES, {"lines": lines}))
        if follow:
            self.watchers.follow(client, msg.id, session)

    # ------------------------------------------------------------- service

    def reload_request(self, client: bytes, msg: Message) -> None:
        changed, restart = self.reload()
        self.endpoints.to_client(
            client, msg.reply(Kind.RELOADED, {"changed": changed, "restart_needed": restart})
        )

    def shutdown(self, client: bytes, msg: Message) -> None:
        """Shut down as SIGTERM does (same stages: no new turns, the grace
        period, then every worker stopped). Local clients only: a remote
        front end may stop sessions, never the service."""
        if client[0] != LOCAL_FRONT:
            raise RemoteProtocolError(
                ErrorCode.UNKNOWN_KIND,
                "shutdown is not accepted from remote front ends; run it on the supervisor's host",
            )
        log.info(kv("shutdown_requested", accepting=self.ctx.accepting))
        self.endpoints.to_client(
            client,
            msg.reply(
                Kind.SHUTDOWN_STARTED,
                {"pid": os.getpid(), "grace": self.ctx.settings.shutdown_grace},
            ),
        )
        # Through the signal handler, so it is the very path SIGTERM takes.
        os.kill(os.getpid(), signal.SIGTERM)

    def drain(self, client: bytes, msg: Message) -> None:
        """Drain this node (`on`, the default) or end a drain (`on: false`):
        no new sessions (`moved`), running turns finish, idle sessions stop.
        Local clients, and a router (a TCP client whose key is enrolled as
        `router` or `router-*`: `hermes-sup route` passes on its operator's
        drain); no other remote front end, which may stop sessions but not
        take the node out of service."""
        if client[0] != LOCAL_FRONT:
            name = self.endpoints.peer_name(client)
            if not remote.is_router(name):
                raise RemoteProtocolError(
                    ErrorCode.UNKNOWN_KIND,
                    f"drain is not accepted from remote front ends other than a router's key "
                    f"(this one is {name or 'unknown'!r}; router keys are named router or "
                    "router-*); run it on the supervisor's host or through its router",
                )
            log.info(kv("drain_by_router", client=name, on=bool(msg.body.get("on", True))))
        named = msg.body.get("node")
        if named is not None and named != self.ctx.node:
            raise RemoteProtocolError(
                ErrorCode.BAD_FIELD,
                f"this supervisor is node {self.ctx.node!r}, not {str(named)[:64]!r}",
            )
        self.lifecycle.drain(bool(msg.body.get("on", True)))
        self.endpoints.to_client(client, msg.reply(Kind.NODE, {"node": self.reports.node_info()}))

    # ------------------------------------------------------ one session, closer

    def signal_session(self, client: bytes, msg: Message) -> None:
        """Send a signal to a session's worker (or its whole process group).
        What follows (an exit, say) goes through the usual exit policy."""
        key = check_session_key(msg.session)
        session = self.table.require(key)
        sig = parse_signal(msg.body["signal"])
        pid, proc = session.pid, session.proc
        if pid is None or proc is None or proc.returncode is not None:
            raise RemoteProtocolError(
                ErrorCode.NO_SUCH_SESSION,
                f"session {key!r} has no running worker to signal (it is {session.state.value})",
            )
        group = bool(msg.body.get("group", False))
        if group:
            proc.signal_group(sig)
        else:
            proc.send_signal(sig)
        log.info(kv("signalled", session=key, pid=pid, signal=sig.name, group=group))
        self.endpoints.to_client(
            client, msg.reply(Kind.SIGNALLED, {"pid": pid, "signal": sig.name})
        )

    def turn_status(self, client: bytes, msg: Message) -> None:
        """What became of a turn (Turns.status): answered for any session,
        held here, elsewhere, or by no one."""
        key = check_session_key(msg.session)
        body = self.turns.status(key, msg.body["turn"])
        self.endpoints.to_client(client, msg.reply(Kind.TURN_STATE, body))

    def inspect(self, client: bytes, msg: Message) -> None:
        """Everything known about one session (reports.session_details)."""
        session = self.table.require(check_session_key(msg.session))
        info = self.reports.session_details(session)
        self.endpoints.to_client(client, msg.reply(Kind.INSPECTED, {"session": info}))


def orphan_grace(value: object) -> float | None:
    """A send's `orphan_grace`: seconds, more than 0 and at most MAX_GRACE."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= MAX_GRACE:
        raise RemoteProtocolError(
            ErrorCode.BAD_FIELD,
            f"orphan_grace must be more than 0 and at most {MAX_GRACE:g} seconds, not {value!r}",
        )
    return float(value)


def parse_signal(value: str) -> signal.Signals:
    """'TERM', 'SIGTERM', 'sigterm' or '15' as a signal; a bad_field error otherwise."""
    try:
        return signal_named(value)
    except ValueError as exc:
        raise RemoteProtocolError(ErrorCode.BAD_FIELD, str(exc)) from None
