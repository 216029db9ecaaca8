"""The supervisor's side of the zygote: start it, ask it for workers.

The zygote is a fresh interpreter (posix_spawn, so it inherits no sockets,
threads or zmq context of ours) that preloads what workers need, freezes its
gc and then forks one worker per request. Requests and replies are msgpack
over a SOCK_SEQPACKET socketpair. A request can be larger than one datagram
may be (a spawn request holds a whole environment and the session's
options), so it goes as parts (hermes_sup.local.datagrams); a reply is one
datagram, with the worker's output pipe attached. Requests wait in an
outbox while the socket is full (many spawns at once), never failing for it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import msgpack

from hermes_sup.local import datagrams

log = logging.getLogger("hermes_sup.supervisor")

# The largest reply: a pid or an error, so far from it.
MAX_REPLY = 64 * 1024


class ZygoteError(Exception):
    """The zygote could not start or could not fork a worker."""


class Zygote:
    """A running zygote process and the requests in flight to it."""

    def __init__(
        self,
        preload: tuple[str, ...],
        env: Mapping[str, str],
        cwd: str,
        sealed: str | None = None,
        data_dir: str | None = None,
        hermes: bool = False,
        cgroup_dirs: tuple[str, ...] = (),
    ) -> None:
        self.preload = preload
        # The session cgroups' parents: the zygote removes what is left of
        # them if the supervisor dies without doing it (cgroups.py).
        self.cgroup_dirs = cgroup_dirs
        self.env = dict(env)
        self.cwd = cwd
        # Sealed mode ("root"/"user", supervisor/sealing.py): the zygote
        # makes the fixed paths under data_dir, and imports hermes under
        # them when `hermes` may run.
        self.sealed = sealed
        self.data_dir = data_dir
        self.hermes = hermes
        self.pid: int | None = None
        self.started_at = 0.0
        self._sock: socket.socket | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[tuple[int, int | None]]] = {}
        # Parts of requests not yet taken by the socket, oldest first.
        self._outbox: deque[bytes] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._writing = False

    def start(
        self,
        timeout: float = 30.0,
        on_progress: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """Start the zygote and wait (blocking) until its preload is done:
        at most `timeout` seconds without a word from it (a preload that
        reports progress, `on_progress(report)`, is not stuck). Call before
        any zmq context or thread exists in this process."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        theirs.set_inheritable(True)
        argv = [
            sys.executable,
            "-m",
            "hermes_sup.worker.zygote",
            "--fd",
            str(theirs.fileno()),
            "--supervisor-pid",
            str(os.getpid()),
            "--cwd",
            self.cwd,
        ]
        for mod in self.preload:
            argv += ["--preload", mod]
        if self.sealed:
            assert self.data_dir is not None
            argv += ["--sealed", self.sealed, "--data-dir", self.data_dir]
            if self.hermes:
                argv.append("--hermes")
        for path in self.cgroup_dirs:
            argv += ["--cgroup-dir", path]
        self.pid = os.posix_spawn(sys.executable, argv, self.env, setsid=False)
        theirs.close()
        ours.settimeout(timeout)
        while True:
            try:
                data = ours.recv(MAX_REPLY)
            except TimeoutError:
                raise ZygoteError(
                    f"zygote (pid {self.pid}) said nothing for {timeout:.0f}s while getting ready"
                ) from None
            if not data:
                raise ZygoteError(
                    f"zygote (pid {self.pid}) exited during start-up; see the log above"
                )
            ready = msgpack.unpackb(data, raw=False)
            if not (isinstance(ready, dict) and "progress" in ready):
                break
            if on_progress is not None:
                on_progress(dict(ready["progress"]))
        ours.setblocking(False)
        self._sock = ours
        self.started_at = time.monotonic()
        return dict(ready)

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the zygote's replies from the event loop."""
        assert self._sock is not None
        self._loop = loop
        loop.add_reader(self._sock.fileno(), self._on_readable)

    def detach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Stop reading replies and writing requests (before close)."""
        if self._sock is not None:
            loop.remove_reader(self._sock.fileno())
            if self._writing:
                loop.remove_writer(self._sock.fileno())
                self._writing = False
        self._loop = None

    def spawn(self, request: dict[str, Any]) -> asyncio.Future[tuple[int, int | None]]:
        """Ask for one worker now; the future gives its pid once forked, and
        the read end of the pipe that carries its output (ours to close)."""
        fut: asyncio.Future[tuple[int, int | None]] = asyncio.get_running_loop().create_future()
        if self._sock is None:
            fut.set_exception(ZygoteError("the zygote is not running"))
            return fut
        req_id = next(self._ids)
        self._pending[req_id] = fut
        self._outbox.extend(datagrams.split(datagrams.with_id(req_id, msgpack.packb(request))))
        self._flush()
        return fut

    def _flush(self) -> None:
        """Send waiting parts until the socket is full; then again once it
        is writable. A socket error means the zygote is gone: every request
        in flight fails (the supervisor restarts the zygote)."""
        sock = self._sock
        while self._outbox and sock is not None:
            try:
                sock.send(self._outbox[0])
            except BlockingIOError:
                if not self._writing and self._loop is not None:
                    self._loop.add_writer(sock.fileno(), self._flush)
                    self._writing = True
                return
            except OSError as exc:
                self._outbox.clear()
                self.fail_pending(f"cannot reach the zygote: {exc}")
                break
            self._outbox.popleft()
        if self._writing and self._loop is not None and sock is not None:
            self._loop.remove_writer(sock.fileno())
            self._writing = False

    def _on_readable(self) -> None:
        assert self._sock is not None
        while True:
            try:
                data, fds, _flags, _addr = socket.recv_fds(self._sock, MAX_REPLY, 1)
            except BlockingIOError:
                return
            except OSError as exc:
                self.fail_pending(f"zygote socket failed: {exc}")
                return
            if not data:
                self.fail_pending("the zygote exited")
                if self._sock is not None:
                    asyncio.get_running_loop().remove_reader(self._sock.fileno())
                return
            reply = msgpack.unpackb(data, raw=False)
            fut = self._pending.pop(reply.get("id"), None)
            out_fd = fds[0] if fds else None
            if fut is None or fut.done():
                if out_fd is not None:
                    os.close(out_fd)
                continue
            if "pid" in reply:
                fut.set_result((int(reply["pid"]), out_fd))
            else:
                fut.set_exception(ZygoteError(str(reply.get("error", "fork failed"))))

    def fail_pending(self, why: str) -> None:
        """Fail every request in flight (the zygote died)."""
        self._outbox.clear()
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(ZygoteError(why))

    def close(self) -> None:
        """Close our end; the zygote sees EOF and exits."""
        self.fail_pending("the supervisor is shutting down")
        if self._sock is not None:
            self._sock.close()
            self._sock = None
