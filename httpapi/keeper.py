"""The keeper: what keeps `serve --http`'s endpoint serving.

`serve --http` starts this process (double-forked, so it is not the
supervisor's child), and it runs the endpoint as its own child, on the
listening socket it holds: when the endpoint dies (a crash, an OOM kill,
a SIGKILL by mistake) the keeper logs it and starts a new one on the same
socket, so the port is never let go and clients only see connections
refused for the moment between. Restarts back off (`FIRST_DELAY` doubling
up to `MAX_DELAY`; back to the first once an endpoint has served for
`STEADY` seconds), so an endpoint that cannot start does not spin.

Both the keeper and the endpoint watch the supervisor's pipe (see
serve.py): when the supervisor exits, however it exits, the keeper stops
restarting, tells its endpoint to stop, waits for it (SIGKILL after
`STOP_GRACE`), and exits; the endpoint stops on its own at the same EOF,
so even a SIGKILLed keeper leaves nothing behind. SIGTERM and SIGINT to
the keeper stop it the same way.

One thread, no event loop: signal handlers only note the signal (through
`signal.set_wakeup_fd`), and the loop waits on the pipe and that fd.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from .logsafe import kv

log = logging.getLogger("hermes_sup.httpapi")

FIRST_DELAY = 0.5  # seconds before the first restart
MAX_DELAY = 30.0
STEADY = 60.0  # an endpoint that served this long resets the back-off
STOP_GRACE = 10.0  # seconds an endpoint gets to stop before SIGKILL


class Keeper:
    """Runs `argv` (the endpoint) until `watch_fd` reads EOF or a stop signal."""

    def __init__(self, argv: Sequence[str], watch_fd: int, pass_fds: Sequence[int]) -> None:
        self.argv = list(argv)
        self.watch_fd = watch_fd
        self.pass_fds = tuple(pass_fds)
        self.child: subprocess.Popen[bytes] | None = None
        self.stopping: str | None = None  # why, once we are stopping
        self.delay = FIRST_DELAY
        self._parent_gone = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)

    def run(self) -> int:
        signal.set_wakeup_fd(self._wake_w)
        for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: None)  # noted by the wakeup fd only
        while self.stopping is None:
            started = time.monotonic()
            self._spawn()
            code = self._wait_child(deadline=None)
            if self.stopping is not None:
                break
            served = time.monotonic() - started
            if served >= STEADY:
                self.delay = FIRST_DELAY
            log.warning(
                kv(
                    "http_endpoint_exited",
                    pid=self.child.pid if self.child else None,
                    code=code,
                    served=round(served, 1),
                    restart_in=self.delay,
                )
            )
            self._pause(self.delay)
            self.delay = min(self.delay * 2, MAX_DELAY)
        self._stop_child()
        log.info(kv("http_keeper_stopped", reason=self.stopping))
        return 0

    def _spawn(self) -> None:
        self.child = subprocess.Popen(self.argv, pass_fds=self.pass_fds)
        log.info(kv("http_endpoint_started", pid=self.child.pid, keeper=os.getpid()))

    def _events(self, timeout: float | None) -> None:
        """Wait up to `timeout` for the pipe or a signal; note a stop."""
        fds = [self._wake_r] if self._parent_gone else [self.watch_fd, self._wake_r]
        ready, _, _ = select.select(fds, [], [], timeout)
        if self._wake_r in ready:
            try:
                signums = os.read(self._wake_r, 512)
            except BlockingIOError:
                signums = b""
            for signum in signums:
                if signum in (signal.SIGTERM, signal.SIGINT):
                    self.stopping = self.stopping or signal.Signals(signum).name
        if self.watch_fd in ready and not os.read(self.watch_fd, 1):
            self._parent_gone = True  # EOF stays readable: watched no more
            self.stopping = self.stopping or "the supervisor exited"

    def _wait_child(self, deadline: float | None) -> int | None:
        """Until the endpoint exits (its code) or a stop is noted (None)."""
        assert self.child is not None
        while True:
            code = self.child.poll()
            if code is not None:
                return code
            if self.stopping is not None and deadline is None:
                return None
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return None
            # A bounded wait: a SIGCHLD that came before select() still
            # sits in the wakeup fd, but a short timeout costs nothing.
            self._events(1.0 if remaining is None else min(remaining, 1.0))

    def _pause(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self.stopping is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._events(remaining)

    def _stop_child(self) -> None:
        child = self.child
        if child is None or child.poll() is not None:
            return
        child.terminate()
        if self._wait_child(deadline=time.monotonic() + STOP_GRACE) is None:
            log.warning(kv("http_endpoint_killed", pid=child.pid, after=STOP_GRACE))
            child.kill()
            child.wait()


def keep(argv: Sequence[str], watch_fd: int, pass_fds: Sequence[int]) -> None:
    """`python -m hermes_sup.httpapi --keep ...`: run the endpoint `argv`."""
    sys.exit(Keeper(argv, watch_fd, pass_fds).run())
