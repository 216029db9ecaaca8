"""A blocking client of the supervisor's control socket, with timeouts on everything.

One DEALER socket; requests are matched to answers by id, so several requests
may be in flight at once (`submit` then `next`). Not thread-safe: use one
client per thread.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import zmq

from hermes_sup.protocol import (
    ErrorCode,
    Kind,
    Message,
    RemoteProtocolError,
    decode,
    encode,
)
from hermes_sup.supervisor import statedir


class ClientError(Exception):
    """Base of client errors."""


class NotRunning(ClientError):
    """No supervisor is serving the state directory."""


class AccessDenied(ClientError):
    """The state directory exists but this user may not use it."""


class RequestTimeout(ClientError):
    """The supervisor did not answer in time."""


class SupervisorError(ClientError):
    """The supervisor answered with an `error` message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{message} [{code}]")
        self.code = code
        self.message = message


class Client:
    """Talks to one supervisor through its state directory."""

    def __init__(self, state_dir: Path, timeout: float = 10.0) -> None:
        self.state_dir = state_dir
        self.timeout = timeout
        sock_path = state_dir / statedir.CONTROL_SOCKET
        try:
            sock_path.stat()
        except PermissionError:
            raise AccessDenied(
                f"permission denied on {state_dir}: it is private to the user the supervisor "
                "runs as; run this command as that user"
            ) from None
        except FileNotFoundError:
            pass
        if not sock_path.exists() or not statedir.is_locked(state_dir):
            raise NotRunning(f"no hermes-sup supervisor is running on {state_dir}")
        try:
            self.key = statedir.read_key(state_dir)
        except (OSError, statedir.StateDirError) as exc:
            raise NotRunning(f"cannot read the supervisor's key: {exc}") from None
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(statedir.endpoint(state_dir, statedir.CONTROL_SOCKET))
        self._early: list[Message] = []

    def close(self) -> None:
        """Close the socket and the context."""
        self.sock.close(0)
        self.ctx.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- low level

    def submit(
        self, kind: Kind, body: dict[str, Any] | None = None, session: str | None = None
    ) -> str:
        """Send one request without waiting; returns its id."""
        msg = Message(kind, body or {}, session=session)
        self.sock.send_multipart(encode(msg, self.key))
        return msg.id

    def next(self, timeout: float | None = None) -> Message:
        """The next message from the supervisor, or RequestTimeout."""
        if self._early:
            return self._early.pop(0)
        wait = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000) + 1):
                raise RequestTimeout(f"the supervisor did not answer within {wait:g}s")
            frames = self.sock.recv_multipart()
            try:
                return decode(frames, self.key)
            except RemoteProtocolError:
                continue  # not signed with our key: not from our supervisor

    def _answer(self, req_id: str, timeout: float | None = None) -> Message:
        """Wait for the answer to one request, keeping other messages for later."""
        wait = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        kept: list[Message] = []
        try:
            while True:
                left = max(0.0, deadline - time.monotonic())
                try:
                    if left == 0:
                        raise RequestTimeout("deadline passed")
                    msg = self.next(left)
                except RequestTimeout:
                    raise RequestTimeout(
                        f"the supervisor did not answer within {wait:g}s"
                    ) from None
                if msg.re == req_id:
                    return _raise_if_error(msg)
                kept.append(msg)
        finally:
            self._early.extend(kept)

    def request(
        self,
        kind: Kind,
        body: dict[str, Any] | None = None,
        session: str | None = None,
        timeout: float | None = None,
    ) -> Message:
        """Send a request and return its single answer (errors raise)."""
        return self._answer(self.submit(kind, body, session), timeout)

    # ---------------------------------------------------------------- commands

    def ping(self, timeout: float | None = None) -> dict[str, Any]:
        """The supervisor's version, pid and uptime."""
        return self.request(Kind.PING, timeout=timeout).body

    def open(self, session: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
        """Open (and start) a session, optionally with per-session options."""
        body = {"options": options} if options else {}
        return self.request(Kind.OPEN, body, session=session).body

    def sessions(self, prefix: str = "", state: str | None = None) -> list[dict[str, Any]]:
        """Every session the supervisor knows."""
        body: dict[str, Any] = {"prefix": prefix} if prefix else {}
        if state:
            body["state"] = state
        return list(self.request(Kind.LIST, body).body["sessions"])

    def kill(
        self, session: str, force: bool = False, purge: bool = False, timeout: float = 30.0
    ) -> dict[str, Any]:
        """Kill a session's worker and everything it started; waits until gone.
        With `purge`, also delete the session's data."""
        body = {"force": force, "purge": purge}
        return self.request(Kind.KILL, body, session=session, timeout=timeout).body

    def status(self) -> dict[str, Any]:
        """The supervisor's own pid, uptime, endpoints, session counts and memory."""
        return dict(self.request(Kind.STATUS).body["supervisor"])

    def logs(self, session: str, lines: int = 50) -> list[str]:
        """The last `lines` lines of a session's log."""
        return list(self.request(Kind.LOGS, {"lines": lines}, session=session).body["lines"])

    def cancel(self, session: str, turn: str | None = None) -> str | None:
        """Cancel the running turn (or a queued one by id)."""
        body = {"turn": turn} if turn else {}
        return self.request(Kind.CANCEL, body, session=session).body["turn"]

    def send(
        self,
        session: str,
        text: str,
        options: dict[str, Any] | None = None,
        turn_timeout: float | None = None,
    ) -> Iterator[Message]:
        """Send a turn; yield its events as they stream, then its reply.

        The supervisor acknowledges within the client's timeout; after that
        the turn may take up to `turn_timeout` seconds (None: no limit)."""
        body: dict[str, Any] = {"text": text}
        if options:
            body["options"] = options
        req_id = self.submit(Kind.SEND, body, session=session)
        first = self._answer(req_id)
        yield first
        if first.kind is not Kind.EVENT:
            return
        deadline = None if turn_timeout is None else time.monotonic() + turn_timeout
        while True:
            # Wake up now and then to notice a supervisor that died mid-turn.
            left = 2.0 if deadline is None else min(2.0, deadline - time.monotonic())
            if left <= 0:
                raise RequestTimeout(f"the turn did not finish within {turn_timeout:g}s")
            try:
                msg = self._answer(req_id, timeout=left)
            except RequestTimeout:
                if not statedir.is_locked(self.state_dir):
                    raise NotRunning("the supervisor went away during the turn") from None
                continue
            yield msg
            if msg.kind is not Kind.EVENT:
                return

    def run(self, session: str, text: str, **kw: Any) -> tuple[Message, list[Message]]:
        """Send a turn and collect it: (reply, events)."""
        events: list[Message] = []
        for msg in self.send(session, text, **kw):
            if msg.kind is Kind.EVENT:
                events.append(msg)
            else:
                return msg, events
        raise ClientError("the turn ended without a reply")


def _raise_if_error(msg: Message) -> Message:
    if msg.kind is Kind.ERROR:
        raise SupervisorError(str(msg.body.get("code")), str(msg.body.get("message")))
    return msg


__all__ = [
    "Client",
    "ClientError",
    "ErrorCode",
    "NotRunning",
    "RequestTimeout",
    "SupervisorError",
]
