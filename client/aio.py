"""The asyncio client: the same calls as `Client`, awaited.

One socket per client; a reader hands each incoming message to the
request it answers, so any number of tasks may use one client at once.

A front end (the HTTP endpoint) runs every request through here, so the
path of one message is kept short. The socket is a plain zmq socket whose
descriptor the event loop watches (`add_reader`): at each wake-up the
callback takes every message queued, without blocking, and wakes the one
request waiting for each by resolving that request's future. There is no
reader task, no pyzmq future per message and no `wait_for` task per wait
(pyzmq's asyncio layer and those were a fifth of the endpoint's time).
Sends are non-blocking too; a full queue is retried briefly. The
supervisor's lock file is checked before a request only when nothing was
heard from it for a while; a waiting request checks it every
`LIVENESS_SLICE`, so a supervisor gone is noticed either way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from hermes_sup.local.frames import EVENTS, NOBLOCK, POLLIN, recv_frames, send_frames
from hermes_sup.protocol import Kind, Message

from . import core
from .connection import Connection, session_options
from .core import ClientCore, Killed, Opened, Pending, Pong, Signalled
from .errors import AccessDenied, ClientError, NotRunning, Timeout
from .events import Event, Reply, to_event
from .sockets import LIVENESS_SLICE, close_socket, make_socket, refused

# A supervisor that sent us something this recently is not checked for
# (its lock file) before a request.
RECENTLY = 1.0
SEND_RETRY = 0.005  # seconds between tries to send while the queue is full


class AsyncClient:
    """Talks to one supervisor from asyncio. Use `async with AsyncClient() as c`."""

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
        self.ctx = zmq.asyncio.Context()
        self._sock: zmq.Socket[bytes] | None = None
        self._fd = -1  # its descriptor, which the event loop watches
        self._loop: asyncio.AbstractEventLoop | None = None
        self._monitor: Any = None
        self._core: ClientCore | None = None
        # The future of each request now waiting: True when an answer came,
        # False when its wait ran out (see `_wait`).
        self._wakers: dict[str, asyncio.Future[bool]] = {}
        self._heard = 0.0  # monotonic time the supervisor last sent us anything
        self._fresh = True

    @classmethod
    def from_connection_file(cls, path: Path | str, timeout: float = 10.0) -> AsyncClient:
        """A client of a remote supervisor (file from `hermes-sup keys generate`)."""
        return cls(connection=Connection.from_file(path), timeout=timeout)

    async def close(self) -> None:
        """Stop the reader, close the socket and the context."""
        await self._drop()
        self.ctx.term()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------ connection

    def _connect(self) -> tuple[zmq.Socket[bytes], ClientCore]:
        loop = asyncio.get_running_loop()
        if self._sock is not None and self._loop is not loop:
            # Its event loop ended (a second asyncio.run, say): start afresh here.
            self._forget()
        if self._sock is not None and self._core is not None:
            return self._sock, self._core
        if self.connection.alive() is False:
            raise NotRunning(f"no hermes-sup supervisor is running on {self.state_dir}")
        if not self._fresh and self.connection.state_dir is not None:
            self.connection = self.connection.refreshed()  # a restart may bring a new key
        self._fresh = False
        conn = self.connection
        # A plain socket, read and written without blocking from the loop's
        # own reader callback (see the module docstring).
        sock, self._monitor = make_socket(zmq.Context.shadow(self.ctx.underlying), conn)
        self._fd = int(sock.getsockopt(zmq.FD))
        self._sock, self._core, self._loop = sock, ClientCore(conn.key), loop
        loop.add_reader(self._fd, self._on_readable)
        return sock, self._core

    def _on_readable(self) -> None:
        """Take every message waiting on the socket, each to its request.
        zmq's descriptor only says that something changed: the loop goes on
        until EVENTS says nothing is left (after a send too, which may take
        the wake-up of a message already here)."""
        sock, core_, wakers = self._sock, self._core, self._wakers
        if sock is None or core_ is None:
            return
        heard = False
        try:
            while True:
                while int(sock.getsockopt(EVENTS)) & POLLIN:
                    pending = core_.receive(recv_frames(sock, NOBLOCK))
                    heard = True
                    if pending is not None:
                        waker = wakers.pop(pending.id, None)
                        if waker is not None and not waker.done():
                            waker.set_result(True)
                resends = core_.take_outbox()
                if not resends:
                    break
                for frames in resends:  # a turn's send again, after `dropped`
                    try:
                        send_frames(sock, frames, NOBLOCK)
                    except zmq.Again:
                        self._loop_now().create_task(self._send(frames))
        except zmq.ZMQError:
            self._forget()  # the socket broke: waiting requests see it gone
        if heard:
            self._heard = time.monotonic()

    def _loop_now(self) -> asyncio.AbstractEventLoop:
        return self._loop or asyncio.get_running_loop()

    async def _send(self, frames: list[bytes]) -> None:
        """Send without blocking the loop; a full queue (the supervisor not
        reading) is waited on for at most `timeout`."""
        sock, _ = self._connect()
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                send_frames(sock, frames, NOBLOCK)
                break
            except zmq.Again:
                if time.monotonic() > deadline:
                    raise Timeout(
                        f"could not send to the supervisor within {self.timeout:g}s: "
                        "its queue for this client is full"
                    ) from None
                await asyncio.sleep(SEND_RETRY)
        if int(sock.getsockopt(EVENTS)) & POLLIN:
            self._on_readable()

    def _forget(self) -> None:
        """Close the socket; every waiting request wakes and finds it gone."""
        if self._sock is not None:
            if self._loop is not None:
                try:
                    self._loop.remove_reader(self._fd)
                except (RuntimeError, ValueError, OSError):
                    pass  # its loop is closed already
            close_socket(self._sock, self._monitor)
        self._sock = self._core = self._monitor = self._loop = None
        wakers = list(self._wakers.values())
        self._wakers.clear()
        for waker in wakers:
            if not waker.done():
                waker.set_result(True)  # they see the connection gone

    async def _drop(self) -> None:
        """Forget the connection; waiting requests fail, the next one reconnects."""
        self._forget()

    def _lost(self, why: str) -> ClientError:
        self._forget()
        return NotRunning(why)

    # ------------------------------------------------------------- the calls

    async def _start(
        self,
        kind: Kind,
        body: dict[str, Any],
        session: str | None,
        ttl: float | None,
        msg_id: str | None = None,
    ) -> Pending:
        # Is it still there? Not asked (a lock-file check) when it sent us
        # something just now; one gone since is noticed while waiting anyway.
        if time.monotonic() - self._heard > RECENTLY and self.connection.alive() is False:
            await self._drop()
            raise NotRunning(f"no hermes-sup supervisor is running on {self.state_dir}")
        _, core_ = self._connect()
        pending, frames = core_.request(kind, body, session, msg_id=msg_id, ttl=ttl)
        try:
            await self._send(frames)
        except BaseException:
            self._end(pending)
            raise
        return pending

    def _end(self, pending: Pending) -> None:
        waker = self._wakers.pop(pending.id, None)
        if waker is not None and not waker.done():
            waker.set_result(True)  # a wait on it sees it ended
        if self._core is not None:
            self._core.forget(pending)

    async def _wait(self, pending: Pending, timeout: float | None) -> Message:
        """The next answer to `pending` (errors raise); None waits for ever,
        checking that the supervisor is still there."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            msg = pending.pop()
            if msg is not None:
                return core.check(msg)
            if self._core is None or pending.id not in self._core.pending and not pending.done:
                self._end(pending)
                raise NotRunning("the connection to the supervisor was lost")
            left = LIVENESS_SLICE if deadline is None else deadline - time.monotonic()
            if left <= 0:
                self._end(pending)
                error = self._timed_out(timeout or 0.0)
                if self._core is not None and not self._core.pending:
                    # Nobody else waits on this socket: drop it, so a request
                    # still queued on it is never delivered after this error.
                    await self._drop()
                raise error
            if not await self._next(pending, min(left, LIVENESS_SLICE)):
                reason = refused(self._monitor)
                if reason:
                    self._end(pending)
                    raise AccessDenied(reason) from None
                if self.connection.alive() is False:
                    self._end(pending)
                    raise self._lost("the supervisor went away before it answered") from None

    async def _next(self, pending: Pending, wait: float) -> bool:
        """Wait up to `wait` seconds for the reader to bring `pending` an
        answer: True when it did (or the connection went), False if not."""
        loop = asyncio.get_running_loop()
        waker: asyncio.Future[bool] = loop.create_future()
        self._wakers[pending.id] = waker
        timer = loop.call_later(wait, _expire, waker)
        try:
            return await waker
        finally:
            timer.cancel()
            if self._wakers.get(pending.id) is waker:
                del self._wakers[pending.id]

    def _timed_out(self, waited: float) -> ClientError:
        reason = refused(self._monitor)
        if reason:
            return AccessDenied(reason)
        if self.connection.alive() is False:
            return self._lost("the supervisor went away before it answered")
        return Timeout(f"the supervisor did not answer within {waited:g}s")

    async def _call(self, call: core.Call, timeout: float | None) -> Any:
        wait = self.timeout if timeout is None else timeout
        pending = await self._start(call.kind, call.body, call.session, ttl=wait)
        try:
            msg = await self._wait(pending, wait)
        finally:
            self._end(pending)
        return call.read(msg)

    async def ping(self, timeout: float | None = None) -> Pong:
        """The supervisor's version, pid and uptime."""
        return await self._call(core.ping(), timeout)

    async def open(
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
        """Open (and start) a session with its options (see `Client.open`)."""
        opts = options or session_options(
            workspace=workspace, session_env=session_env, env=env, runtime=runtime, agent=agent
        )
        return await self._call(core.open_session(session, opts), timeout)

    async def send(
        self,
        session: str,
        text: str,
        *,
        options: dict[str, Any] | None = None,
        turn_timeout: float | None = None,
        context: dict[str, Any] | None = None,
        turn_id: str | None = None,
        orphan_grace: float | None = None,
    ) -> AsyncTurn:
        """Send a turn; `async for` the result for its events as they stream.
        `context` goes to the session's runtime with the text (PROTOCOL.md);
        `turn_id` and `orphan_grace` as in the blocking client's `send`."""
        pending = await self._start(
            Kind.SEND,
            core.send_body(text, options, context, orphan_grace),
            session,
            ttl=self.timeout,
            msg_id=turn_id,
        )
        return AsyncTurn(self, pending, turn_timeout)

    async def run(self, session: str, text: str, **kw: Any) -> Reply:
        """Send a turn and wait for it: its `Reply`, with `.events` streamed."""
        return await (await self.send(session, text, **kw)).collect()

    async def approve(
        self,
        session: str,
        choice: str,
        timeout: float | None = None,
        approval: str | None = None,
    ) -> str:
        """Answer the session's waiting approval: once, session, always, deny.
        With `approval` (an ApprovalRequest's id), only if that one waits."""
        return await self._call(core.approve(session, choice, approval), timeout)

    async def cancel(
        self, session: str, turn: str | None = None, timeout: float | None = None
    ) -> Any:
        """Cancel the running turn, or a queued one by its id."""
        return await self._call(core.cancel(session, turn), timeout)

    async def sessions(self, prefix: str = "", state: str | None = None) -> list[dict[str, Any]]:
        """Every session the supervisor knows (fields in PROTOCOL.md)."""
        return await self._call(core.sessions(prefix, state), None)

    async def kill(
        self, session: str, force: bool = False, purge: bool = False, timeout: float = 30.0
    ) -> Killed:
        """Kill a session's worker and everything it started; waits until gone."""
        return await self._call(core.kill(session, force, purge), timeout)

    async def status(self) -> dict[str, Any]:
        """The supervisor's own pid, uptime, endpoints, session counts, memory."""
        return await self._call(core.status(), None)

    async def logs(self, session: str, lines: int = 50) -> list[str]:
        """The last `lines` lines of a session's log."""
        return await self._call(core.logs(session, lines), None)

    async def reload(self) -> dict[str, Any]:
        """Re-read the configuration file: what changed, what needs a restart."""
        return await self._call(core.reload(), None)

    async def signal(
        self, session: str, sig: str, group: bool = False, timeout: float | None = None
    ) -> Signalled:
        """Send a signal (TERM, HUP, ... or a number) to the session's worker,
        or with `group` to its whole process group."""
        return await self._call(core.signal(session, sig, group), timeout)

    async def inspect(self, session: str, timeout: float | None = None) -> dict[str, Any]:
        """One session in full: directories, log files, options, the names of
        its worker's environment variables, state history (PROTOCOL.md)."""
        return await self._call(core.inspect(session), timeout)

    async def turn_status(
        self, session: str, turn: str, timeout: float | None = None
    ) -> dict[str, Any]:
        """What became of a turn (the id of its `send`): see the blocking client."""
        return await self._call(core.turn_status(session, turn), timeout)

    async def shutdown(self, timeout: float | None = None) -> dict[str, Any]:
        """Shut the supervisor down as SIGTERM does (local clients only)."""
        return await self._call(core.shutdown(), timeout)

    async def watch(
        self, session: str | None = None, replay: int = 0, types: list[str] | None = None
    ) -> AsyncIterator[Event]:
        """Every event of one session (or of all; of the `types` named, if
        given) until the iterator is closed."""
        body: dict[str, Any] = {"replay": replay}
        if types:
            body["types"] = list(types)
        pending = await self._start(Kind.WATCH, body, session, ttl=self.timeout)
        try:
            await self._wait(pending, self.timeout)  # the `watching` acknowledgement
            while True:
                yield to_event(await self._wait(pending, None))
        finally:
            self._end(pending)
            if self._sock is not None and self._core is not None:
                await self._send(self._core.notice(Kind.UNWATCH, {"watch": pending.id}))


def _expire(waker: asyncio.Future[bool]) -> None:
    if not waker.done():
        waker.set_result(False)


class AsyncTurn:
    """A running turn: `async for` its events; `reply` is set at the end."""

    def __init__(self, client: AsyncClient, pending: Pending, turn_timeout: float | None) -> None:
        self.client = client
        self.id = pending.id
        self.session = pending.session or ""
        self.reply: Reply | None = None
        self._pending = pending
        self._turn_timeout = turn_timeout

    async def __aiter__(self) -> AsyncGenerator[Event, None]:
        deadline = None if self._turn_timeout is None else time.monotonic() + self._turn_timeout
        try:
            msg = await self.client._wait(self._pending, self.client.timeout)
            while True:
                event = to_event(msg)
                if isinstance(event, Reply):
                    self.reply = event
                    yield event
                    return
                yield event
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise await self._give_up()
                try:
                    msg = await self.client._wait(self._pending, left)
                except Timeout:
                    if deadline is None:
                        raise
                    raise await self._give_up() from None
        finally:
            self.client._end(self._pending)

    async def _give_up(self) -> Timeout:
        """The turn ran over its turn_timeout: cancel it (best effort)."""
        self.client._end(self._pending)
        try:
            await self.client.cancel(self.session, self.id, timeout=min(5.0, self.client.timeout))
            outcome = "it was cancelled"
        except ClientError as exc:
            outcome = f"cancelling it failed: {exc}"
        return Timeout(f"the turn did not finish within {self._turn_timeout:g}s; {outcome}")

    async def collect(self) -> Reply:
        """Wait for the end: the reply, with every event it streamed."""
        events = [event async for event in self if not isinstance(event, Reply)]
        assert self.reply is not None
        self.reply = dataclasses.replace(self.reply, events=events)
        return self.reply

    async def cancel(self) -> Any:
        """Cancel this turn (running or queued)."""
        return await self.client.cancel(self.session, self.id)
