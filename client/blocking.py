"""The blocking client: one `Client` shared by any number of threads.

Each thread talks through its own DEALER socket (zmq sockets are not
thread-safe), created on first use, so threads never wait on each other. A
turn's stream must be read in the thread that sent it.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import zmq

from hermes_sup.local.frames import EVENTS, NOBLOCK, POLLIN, recv_frames, send_frames
from hermes_sup.protocol import Kind, Message

from . import core
from .connection import Connection, session_options
from .core import ClientCore, Killed, Opened, Pending, Pong, Signalled
from .errors import AccessDenied, ClientError, NotRunning, Timeout
from .events import Event, Reply, to_event
from .sockets import LIVENESS_SLICE, close_socket, make_socket, refused

# A supervisor that answered this recently is not checked for before a request.
RECENTLY = 1.0


class _Link:
    """One thread's socket and protocol state."""

    def __init__(self, ctx: zmq.Context[Any], conn: Connection, epoch: int) -> None:
        self.conn = conn
        self.epoch = epoch
        self.thread = threading.current_thread()
        self.sock, self.monitor = make_socket(ctx, conn)
        self.core = ClientCore(conn.key)
        self.raw: deque[Message] = deque()  # answers to `submit`, in arrival order
        self.heard = 0.0  # monotonic time of the last answer

    def pump(self, timeout: float) -> int:
        """Wait up to `timeout` for input, then take everything waiting;
        returns how many messages arrived."""
        if self.sock.closed:  # retired after a timeout or a lost supervisor
            raise NotRunning("the connection to the supervisor was closed")
        if not self.sock.poll(max(0, int(timeout * 1000))):
            return 0
        count = 0
        while True:
            try:
                frames = recv_frames(self.sock, NOBLOCK)
            except zmq.Again:
                break
            self.core.receive(frames)
            count += 1
            if not int(self.sock.getsockopt(EVENTS)) & POLLIN:
                break  # cheaper than the exception of one recv too many
        for frames in self.core.take_outbox():
            send_frames(self.sock, frames)  # a turn's send again, after a `dropped`
        if count:
            self.heard = time.monotonic()
        return count

    def close(self) -> None:
        close_socket(self.sock, self.monitor)


class Client:
    """Talks to one supervisor. Timeouts on everything; typed events and errors.

    `Client()` uses this user's supervisor, `Client(state_dir)` another local
    one, `Client.from_connection_file(path)` a remote one over CURVE.
    """

    def __init__(
        self,
        state_dir: Path | str | None = None,
        *,
        connection: Connection | None = None,
        timeout: float = 10.0,
    ) -> None:
        self.connection = connection or Connection.local(state_dir)
        self.state_dir = self.connection.state_dir
        self.timeout = timeout
        self.ctx: zmq.Context[Any] = zmq.Context()
        self._local = threading.local()
        self._links: list[_Link] = []
        self._lock = threading.Lock()
        self._epoch = 0

    @classmethod
    def from_connection_file(cls, path: Path | str, timeout: float = 10.0) -> Client:
        """A client of a remote supervisor (file from `hermes-sup keys generate`)."""
        return cls(connection=Connection.from_file(path), timeout=timeout)

    def close(self) -> None:
        """Close every thread's socket and the context."""
        with self._lock:
            for link in self._links:
                link.close()
            self._links.clear()
        self.ctx.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ connection

    def _link(self) -> _Link:
        link: _Link | None = getattr(self._local, "link", None)
        if link is not None and link.epoch == self._epoch:
            return link
        with self._lock:
            if link is not None and link in self._links:
                link.close()
                self._links.remove(link)
            if self.connection.alive() is False:
                raise NotRunning(f"no hermes-sup supervisor is running on {self.state_dir}")
            if self._epoch and self.connection.state_dir is not None:
                self.connection = self.connection.refreshed()  # a restart may bring a new key
            # Threads come and go (a thread per HTTP request, say): close the
            # sockets of those that ended, so their number stays bounded.
            for gone in [k for k in self._links if not k.thread.is_alive()]:
                gone.close()
                self._links.remove(gone)
            link = _Link(self.ctx, self.connection, self._epoch)
            self._links.append(link)
        self._local.link = link
        return link

    def _lost(self, link: _Link, why: str) -> ClientError:
        """The connection is unusable: every thread starts afresh on its next
        request, and this thread's socket is closed now."""
        if link.epoch == self._epoch:
            self._epoch += 1
        self._retire(link)
        return NotRunning(why)

    def _retire(self, link: _Link) -> None:
        """Close this thread's socket now (linger 0), with any request still
        queued on it: one queued while there was no connection would
        otherwise go out on reconnection, after its caller was told it failed."""
        with self._lock:
            if link in self._links:
                self._links.remove(link)
                link.close()
        if getattr(self._local, "link", None) is link:
            self._local.link = None

    def _timed_out(self, link: _Link, waited: float) -> ClientError:
        reason = refused(link.monitor)
        if reason:
            return AccessDenied(reason)
        if self.connection.alive() is False:
            return self._lost(link, "the supervisor went away before it answered")
        return Timeout(f"the supervisor did not answer within {waited:g}s")

    @property
    def socket(self) -> zmq.Socket[Any]:
        """This thread's socket, to poll alongside other input (as `attach` does)."""
        return self._link().sock

    # ------------------------------------------------------------- low level

    def submit(
        self,
        kind: Kind,
        body: dict[str, Any] | None = None,
        session: str | None = None,
        msg_id: str | None = None,
        ttl: float | None = None,
    ) -> str:
        """Send one request without waiting; its answers come from `next` or
        `answer`. Returns the request id. Passing the id of an earlier `send`
        resends it: the supervisor never runs a turn twice. With `ttl`, the
        supervisor refuses it (`expired`) if it arrives more than `ttl`
        seconds after it was sent."""
        link, pending = self._start(kind, body or {}, session, msg_id=msg_id, ttl=ttl)
        pending.inbox = link.raw  # raw answers share one queue, in arrival order
        return pending.id

    def next(self, timeout: float | None = None) -> Message:
        """The next answer to any request this thread submitted."""
        link = self._link()
        wait = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        while not link.raw:
            left = max(0.0, deadline - time.monotonic())
            got = link.pump(min(left, LIVENESS_SLICE))
            if link.raw:
                break
            if time.monotonic() >= deadline:
                raise self._timed_out(link, wait)
            if not got and self.connection.alive() is False:
                raise self._lost(link, "the supervisor went away")
        return link.raw.popleft()

    def answer(self, req_id: str, timeout: float | None = None) -> Message:
        """The next answer to one submitted request (others stay for `next`).
        An `error` answer raises its typed error."""
        link = self._link()
        wait = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        scanned = False  # look at the socket at least once, even with no time left
        while True:
            for i, msg in enumerate(link.raw):
                if msg.re == req_id:
                    del link.raw[i]
                    return core.check(msg)
            if time.monotonic() >= deadline and scanned:
                raise self._timed_out(link, wait)
            scanned = True
            left = max(0.0, deadline - time.monotonic())
            if not link.pump(min(left, LIVENESS_SLICE)) and self.connection.alive() is False:
                raise self._lost(link, "the supervisor went away")

    def request(
        self,
        kind: Kind,
        body: dict[str, Any] | None = None,
        session: str | None = None,
        timeout: float | None = None,
    ) -> Message:
        """Send a request and return its single answer (errors raise)."""
        wait = self.timeout if timeout is None else timeout
        return self.answer(self.submit(kind, body, session, ttl=wait), wait)

    # ------------------------------------------------------------- the calls

    def _start(
        self,
        kind: Kind,
        body: dict[str, Any],
        session: str | None,
        msg_id: str | None = None,
        ttl: float | None = None,
    ) -> tuple[_Link, Pending]:
        """Send a request on this thread's socket; its answers wait in `pending`
        (only this thread reads the socket, so they cannot arrive before it)."""
        link = self._link()
        # Is it still there? Not asked (a lock-file check) when it answered
        # just now; a supervisor gone since is noticed while waiting anyway.
        if time.monotonic() - link.heard > RECENTLY and self.connection.alive() is False:
            raise self._lost(link, f"no hermes-sup supervisor is running on {self.state_dir}")
        pending, frames = link.core.request(kind, body, session, msg_id=msg_id, ttl=ttl)
        send_frames(link.sock, frames)
        return link, pending

    def _wait(self, link: _Link, pending: Pending, timeout: float | None) -> Message:
        """The next answer to `pending`; None timeout waits for ever (checking
        that the supervisor is still there)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            msg = pending.pop()
            if msg is not None:
                return core.check(msg)
            left = LIVENESS_SLICE if deadline is None else deadline - time.monotonic()
            if left <= 0:
                link.core.forget(pending)
                error = self._timed_out(link, timeout or 0.0)
                if not link.core.pending:
                    self._retire(link)  # nobody else waits on it
                raise error
            if link.pump(min(left, LIVENESS_SLICE)):
                continue
            reason = refused(link.monitor)
            if reason:
                link.core.forget(pending)
                raise AccessDenied(reason)
            if self.connection.alive() is False:
                link.core.forget(pending)
                raise self._lost(link, "the supervisor went away before it answered")

    def _call(self, call: core.Call, timeout: float | None) -> Any:
        wait = self.timeout if timeout is None else timeout
        link, pending = self._start(call.kind, call.body, call.session, ttl=wait)
        return call.read(self._wait(link, pending, wait))

    def ping(self, timeout: float | None = None) -> Pong:
        """The supervisor's version, pid and uptime."""
        return self._call(core.ping(), timeout)

    def open(
        self,
        session: str,
        *,
        workspace: str | Path | None = None,
        session_env: dict[str, str] | None = None,
        env: dict[str, str] | None = None,
        runtime: str | None = None,
        agent: dict[str, Any] | None = None,
        options: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> Opened:
        """Open (and start) a session with its options: a workspace under one
        of the supervisor's workspace roots, `session_env` (platform, chat_id,
        user_id, ... as HERMES_SESSION_*), plain `env`, a runtime the
        supervisor allows, agent settings. `options` is the raw wire map."""
        opts = options or session_options(
            workspace=workspace, session_env=session_env, env=env, runtime=runtime, agent=agent
        )
        return self._call(core.open_session(session, opts), timeout)

    def send(
        self,
        session: str,
        text: str,
        *,
        options: dict[str, Any] | None = None,
        turn_timeout: float | None = None,
        context: dict[str, Any] | None = None,
        turn_id: str | None = None,
        orphan_grace: float | None = None,
    ) -> Turn:
        """Send a turn; iterate the result for its events as they stream. The
        last one is the `Reply`; an error raises its typed exception.
        `context` goes to the session's runtime with the text (PROTOCOL.md).
        `turn_id` (default: a fresh one, `Turn.id`) is the turn's id: sending
        the same id again, even after a restart or on another node, never
        runs the turn twice; see `turn_status`. With `orphan_grace`, the turn
        is cancelled once this client has been gone that many seconds
        without sending it again (PROTOCOL.md)."""
        link, pending = self._start(
            Kind.SEND,
            core.send_body(text, options, context, orphan_grace),
            session,
            msg_id=turn_id,
            ttl=self.timeout,
        )
        return Turn(self, link, pending, turn_timeout)

    def run(self, session: str, text: str, **kw: Any) -> Reply:
        """Send a turn and wait for it: its `Reply`, with `.events` streamed."""
        return self.send(session, text, **kw).collect()

    def approve(
        self,
        session: str,
        choice: str,
        timeout: float | None = None,
        approval: str | None = None,
    ) -> str:
        """Answer the session's waiting approval: once, session, always, deny.
        With `approval` (an ApprovalRequest's id), only if that one waits."""
        return self._call(core.approve(session, choice, approval), timeout)

    def cancel(self, session: str, turn: str | None = None, timeout: float | None = None) -> Any:
        """Cancel the running turn, or a queued one by its id."""
        return self._call(core.cancel(session, turn), timeout)

    def sessions(self, prefix: str = "", state: str | None = None) -> list[dict[str, Any]]:
        """Every session the supervisor knows (fields in PROTOCOL.md)."""
        return self._call(core.sessions(prefix, state), None)

    def kill(
        self, session: str, force: bool = False, purge: bool = False, timeout: float = 30.0
    ) -> Killed:
        """Kill a session's worker and everything it started; waits until gone.
        With `purge`, also delete the session's data."""
        return self._call(core.kill(session, force, purge), timeout)

    def status(self) -> dict[str, Any]:
        """The supervisor's own pid, uptime, endpoints, session counts, memory."""
        return self._call(core.status(), None)

    def logs(self, session: str, lines: int = 50) -> list[str]:
        """The last `lines` lines of a session's log."""
        return self._call(core.logs(session, lines), None)

    def reload(self) -> dict[str, Any]:
        """Re-read the configuration file: what changed, what needs a restart."""
        return self._call(core.reload(), None)

    def signal(
        self, session: str, sig: str, group: bool = False, timeout: float | None = None
    ) -> Signalled:
        """Send a signal (a name such as TERM or HUP, or a number) to the
        session's worker, or with `group` to its whole process group."""
        return self._call(core.signal(session, sig, group), timeout)

    def inspect(self, session: str, timeout: float | None = None) -> dict[str, Any]:
        """One session in full: directories, log files, options, the names
        of its worker's environment variables, state history (PROTOCOL.md)."""
        return self._call(core.inspect(session), timeout)

    def turn_status(self, session: str, turn: str, timeout: float | None = None) -> dict[str, Any]:
        """What became of a turn (the id of its `send`): {turn, state,
        node, outcome, started, ended, since}; `state` is queued, running,
        ended, interrupted or unknown (PROTOCOL.md, "Turn ids")."""
        return self._call(core.turn_status(session, turn), timeout)

    def shutdown(self, timeout: float | None = None) -> dict[str, Any]:
        """Shut the supervisor down as SIGTERM does (local clients only):
        {pid, grace}. It is gone once `connection.alive()` is False."""
        return self._call(core.shutdown(), timeout)

    def watch(self, session: str | None = None, replay: int = 0) -> Generator[Event, None, None]:
        """Every event of one session (or of all): states, turns from any
        client, streamed events, final answers. Stops when the iterator is closed."""
        link, pending = self._start(Kind.WATCH, {"replay": replay}, session, ttl=self.timeout)
        try:
            self._wait(link, pending, self.timeout)  # the `watching` acknowledgement
            while True:
                yield to_event(self._wait(link, pending, None))
        finally:
            link.core.forget(pending)
            if link.epoch == self._epoch and not link.sock.closed:
                send_frames(link.sock, link.core.notice(Kind.UNWATCH, {"watch": pending.id}))


class Turn:
    """A running turn: iterate it for events; `reply` is set at the end."""

    def __init__(
        self, client: Client, link: _Link, pending: Pending, turn_timeout: float | None
    ) -> None:
        self.client = client
        self.id = pending.id
        self.session = pending.session or ""
        self.reply: Reply | None = None
        self._link = link
        self._pending = pending
        self._turn_timeout = turn_timeout

    def __iter__(self) -> Iterator[Event]:
        deadline = None if self._turn_timeout is None else time.monotonic() + self._turn_timeout
        # The supervisor acknowledges at once; then the turn may take long.
        first = self.client._wait(self._link, self._pending, self.client.timeout)
        msg: Message | None = first
        while True:
            assert msg is not None
            event = to_event(msg)
            if isinstance(event, Reply):
                self.reply = event
                yield event
                return
            yield event
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise self._give_up()
            try:
                msg = self.client._wait(self._link, self._pending, left)
            except Timeout:
                if deadline is None:
                    raise
                raise self._give_up() from None

    def _give_up(self) -> Timeout:
        """The turn ran over its turn_timeout: cancel it (best effort)."""
        self._link.core.forget(self._pending)
        try:
            self.client.cancel(self.session, self.id, timeout=min(5.0, self.client.timeout))
            outcome = "it was cancelled"
        except ClientError as exc:
            outcome = f"cancelling it failed: {exc}"
        return Timeout(f"the turn did not finish within {self._turn_timeout:g}s; {outcome}")

    def collect(self) -> Reply:
        """Wait for the end: the reply, with every event it streamed."""
        events = [event for event in self if not isinstance(event, Reply)]
        assert self.reply is not None
        self.reply = dataclasses.replace(self.reply, events=events)
        return self.reply

    def cancel(self) -> Any:
        """Cancel this turn (running or queued)."""
        return self.client.cancel(self.session, self.id)
