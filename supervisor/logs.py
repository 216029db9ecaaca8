"""Session logs: a worker's stdout and stderr, written by the supervisor.

Each worker writes to a pipe whose read end the supervisor holds. The
supervisor writes whole lines to the session's `worker.log`, rotating it by
size only at a line boundary, and drains the pipe before it handles the
worker's exit, so the last lines a dying worker printed are never lost. It
also hands each line to whoever follows the log (`hermes-sup logs -f`).
This module is the writing side only: reading stored logs back (`tail`,
`logs` requests, the stamp's format and parsing) is supervisor/logread.py.

Every stored line begins with a timestamp and one space, as docker keeps
one with every line (`logs --since/--until/-t`):

    2026-12-01T10:38:21.123456Z what the worker printed

It is when the supervisor read the line from the pipe (lines read together
share it; a pipe held back by the rate limit delays it), RFC 3339 in UTC to
the microsecond, and always 27 characters wide. Fixed width keeps both ends
cheap: writing is one prefix per line, made once per batch; reading strips
a slice; and such stamps sort as text in time order, so `since` and `until`
are byte comparisons, with no date parsed per line. The file stays a text
file that `less`, `grep` and `tail -f` read as before. A line without a
stamp (a log written before stamps were) is shown as it is; its time is
unknown, and it counts as older than every stamped line: `since` leaves it
out, `until` keeps it.

What one session's output may cost the others
---------------------------------------------
A session that prints without end (`yes`), or a full disk, must neither
stall the supervisor nor take it down.

* Reads are budgeted: one wake-up reads at most READ_BUDGET bytes, stamps
  counted, and goes back to the loop, which calls again while the pipe is
  readable; other clients and sessions are served in between. Whole
  batches of lines are written with one write, not one write a line.
* Each session's log takes at most `log_rate_limit` bytes a second after a
  burst of `log_rate_burst` (a token bucket, kept across worker restarts),
  stamps included: short lines take more of it than their own bytes.
  Over the rate the supervisor stops reading that session's pipe until the
  bucket has refilled: the pipe fills, and the session's own writers block,
  slowed to the rate; no one else waits, and they are never blocked for
  good. This is chosen over reading and dropping: draining a `yes` at pipe
  speed only to throw the bytes away would keep a core of the supervisor
  busy (half of a 2-core machine) and lose lines silently; held back, the
  flooder sleeps and every line it printed is kept. `session_log_throttled`
  says, once per REPORT_INTERVAL, how long the pipe was held.
* A write that fails (ENOSPC, EDQUOT, EIO, a directory removed, also while
  rotating) never raises: the pipe is still read (at the rate), so the
  worker never blocks on it; the lines that cannot be written are counted
  and dropped, a write is tried again at most once every RETRY_INTERVAL,
  and `session_log_losing_lines` (no traceback) says so once per
  REPORT_INTERVAL. When writing works again, the log gets a line saying how
  many lines were lost there, and `session_log_resumed` says it once.
* When the worker exits, what its pipe holds (at most the pipe's capacity)
  is read at once, whatever the rate: the last lines before a death are the
  ones worth having.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

from hermes_sup.local.logfmt import kv

from .logread import STAMP_WIDTH

log = logging.getLogger("hermes_sup.supervisor")

READ_SIZE = 65536
# At most this much is read per wake-up of the loop, then others get a turn.
READ_BUDGET = 4 * READ_SIZE
# A line longer than this is written in pieces rather than buffered forever.
MAX_LINE = 64 * 1024
# While writes fail, one is tried again at most this often.
RETRY_INTERVAL = 1.0
# Lines about one session's losses or throttling, at most one per interval.
REPORT_INTERVAL = 10.0
NOTE = "hermes-sup: {lost} line(s) of this session's output were lost here ({error})\n"


class Stamper:
    """Makes the prefix of lines read now, in the stamp format of
    logread.py (STAMP_WIDTH wide). The part down to the second is
    formatted once a second, so a prefix costs a clock read and a format of
    the microseconds."""

    def __init__(self) -> None:
        self._second = -1
        self._head = b""

    def prefix(self) -> bytes:
        """`<stamp> ` for now, as bytes."""
        # A float's clock: at today's seconds it still holds a quarter of a
        # microsecond, and it costs less than integer nanoseconds (measured).
        now = time.time()
        seconds = int(now)
        if seconds != self._second:
            self._second = seconds
            self._head = time.strftime("%Y-%m-%dT%H:%M:%S.", time.gmtime(seconds)).encode()
        return self._head + b"%06dZ " % int((now - seconds) * 1_000_000)


class SessionLog:
    """One session's log file, size-rotated at line boundaries, with its
    write-rate bucket and what it lost while writes failed."""

    def __init__(self, path: Path, max_bytes: int = 10 * 1024 * 1024, backups: int = 3) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self._partial = b""
        self._fd: int | None = None
        self._stamper = Stamper()
        self._prefix = b""  # of the lines written last
        # Bytes of stamps stored so far: they count against the rate and a
        # wake-up's budget like the bytes they stamp.
        self.stamp_bytes = 0
        self._size = 0
        # Token bucket (bytes): no limit until `limit_rate` sets one.
        self.rate: float | None = None
        self.burst = 0.0
        self._tokens = 0.0
        self._refilled = time.monotonic()
        # While writes fail: why, and the lines dropped since they began.
        self.error: str | None = None
        self.lost_lines = 0
        self._retry_at = 0.0
        self._torn = False  # a write stopped mid-line
        self._reported = False  # this outage was reported
        self._resumed: int | None = None  # lines an outage just over lost
        self._next_report = 0.0
        self._held = 0.0  # seconds the pipe was held since the last report
        self._next_throttle_report = 0.0

    # ------------------------------------------------------------- rate

    def limit_rate(self, rate: int | None, burst: int) -> None:
        """At most `rate` bytes a second after a burst of `burst` (None: no
        limit). The bucket starts full and keeps its level when the same
        limit is set again for the session's next worker."""
        new_rate = float(rate) if rate else None
        # At least one read's worth: a smaller bucket would only mean more,
        # smaller reads, each a wake-up of the loop.
        new_burst = float(max(READ_SIZE, burst))
        if (new_rate, new_burst) == (self.rate, self.burst):
            return
        if self.rate is None:
            self._tokens = new_burst
        self.rate, self.burst = new_rate, new_burst
        self._tokens = min(self._tokens, new_burst)

    def allowance(self, now: float) -> float:
        """Bytes the log may take now (inf when there is no limit)."""
        if self.rate is None:
            return math.inf
        self._tokens = min(self.burst, self._tokens + (now - self._refilled) * self.rate)
        self._refilled = now
        return self._tokens

    def resume_level(self) -> float:
        """Tokens worth a wake-up: reading a few bytes at a time would cost
        more than the bytes."""
        return min(self.burst, READ_SIZE)

    def wait_time(self) -> float:
        """Seconds until the bucket holds `resume_level` again."""
        if self.rate is None:
            return 0.0
        return max(0.01, (self.resume_level() - self._tokens) / self.rate)

    def spend(self, count: int) -> None:
        """`count` bytes were read, or stored as stamps (the bucket may go
        below zero: a dying worker's last output is read whatever the rate)."""
        if self.rate is not None:
            self._tokens -= count

    # ------------------------------------------------------------ lines

    def feed(self, data: bytes, want_lines: bool = True) -> list[bytes]:
        """Write every complete line in `data`; keep the rest for later.
        Returns the lines (without newlines) if `want_lines`."""
        buf = self._partial + data if self._partial else data
        cut = buf.rfind(b"\n") + 1
        chunk, rest = buf[:cut], buf[cut:]
        if len(rest) > MAX_LINE:
            keep = len(rest) % MAX_LINE or MAX_LINE
            head, rest = rest[:-keep], rest[-keep:]
            chunk += b"".join(head[i : i + MAX_LINE] + b"\n" for i in range(0, len(head), MAX_LINE))
        self._partial = rest
        self._write(chunk)
        return chunk.split(b"\n")[:-1] if want_lines and chunk else []

    def finish(self, want_lines: bool = True) -> list[bytes]:
        """Write a trailing unterminated line, if any (the writer is gone)."""
        if not self._partial:
            return []
        line, self._partial = self._partial, b""
        self._write(line + b"\n")
        return [line] if want_lines else []

    def last_stamp(self) -> str | None:
        """The stamp of the lines the last `feed` or `finish` returned (sent
        with them to followers), even if they could not be written."""
        return self._prefix[:STAMP_WIDTH].decode() if self._prefix else None

    def _write(self, chunk: bytes) -> None:
        """Write whole lines, each stamped; a failure drops them, counted,
        and never raises."""
        if not chunk:
            return
        prefix = self._prefix = self._stamper.prefix()
        now = time.monotonic()
        if self.error is not None and now < self._retry_at:
            self.lost_lines += chunk.count(b"\n")
            return
        try:
            if self.error is not None:
                lost = NOTE.format(lost=self.lost_lines, error=self.error)
                self._put((b"\n" if self._torn else b"") + prefix + lost.encode())
                self._torn = False
            self._put_stamped(prefix, chunk)
        except OSError as exc:
            self._failed(exc, chunk.count(b"\n"), now)
            return
        if self.error is not None:
            if self._reported:
                self._resumed = self.lost_lines
            self.error, self.lost_lines, self._reported = None, 0, False

    def _failed(self, exc: OSError, lines: int, now: float) -> None:
        # Closed, so that the next try opens the file anew: a removed
        # directory or file that is back is found again.
        self.close()
        self.error = exc.strerror or str(exc)
        self.lost_lines += lines
        self._retry_at = now + RETRY_INTERVAL

    def _put_stamped(self, prefix: bytes, chunk: bytes) -> None:
        """Append whole lines, each after `prefix`. One `replace` puts the
        prefix after every newline (the last one's is left out of the write)
        and one writev adds the first: a single new buffer. Concatenating
        would allocate two or three more the size of a read, and that
        (measured) made a 64 KiB batch cost 7 times more than this does."""
        body: bytes | memoryview = chunk
        if chunk.find(b"\n") < len(chunk) - 1:  # more than one line
            stamped = chunk.replace(b"\n", b"\n" + prefix)
            body = memoryview(stamped)[: len(stamped) - len(prefix)]
        size = len(prefix) + len(body)
        self.stamp_bytes += size - len(chunk)  # the stamps: one a line
        self.spend(size - len(chunk))
        fd = self._open()
        if size > self.max_bytes - self._size:
            self._put(prefix + body)  # rotates first: once a file
            return
        done = os.writev(fd, (prefix, body))
        self._size += done
        if done < size:  # a short write (the disk filling up): go on as _put does
            try:
                self._put((prefix + body)[done:])
            except OSError:
                self._torn = self._torn or done > 0
                raise

    def _put(self, data: bytes) -> None:
        """Append lines, rotating first when the next line would not fit."""
        while data:
            room = self.max_bytes - self._size
            if len(data) <= room:
                piece, data = data, b""
            else:
                cut = data.rfind(b"\n", 0, room) + 1 if room > 0 else 0
                if not cut:
                    if self._size:
                        self._rotate()
                        continue
                    cut = data.find(b"\n") + 1  # longer than a whole file: alone in one
                piece, data = data[:cut], data[cut:]
            fd = self._open()
            done = 0
            try:
                while done < len(piece):
                    done += os.write(fd, piece[done:])
            finally:
                self._size += done
                if 0 < done < len(piece):
                    self._torn = True

    def _open(self) -> int:
        if self._fd is None:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                self._size = os.fstat(fd).st_size
            except OSError:
                os.close(fd)
                raise
            self._fd = fd
        return self._fd

    def _rotate(self) -> None:
        self.close()
        for i in range(self.backups - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{i}")
            if older.exists():
                os.replace(older, self.path.with_name(f"{self.path.name}.{i + 1}"))
        if self.path.exists():
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        self._size = 0

    def close(self) -> None:
        """Close the file (it is reopened on the next line)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass  # closed all the same; what it could not write is counted

    # ---------------------------------------------------------- reports

    def report(self, session: str, now: float) -> None:
        """Say that lines are being lost (at most once per REPORT_INTERVAL),
        and once that they no longer are. No traceback: it is not a bug."""
        if self._resumed is not None:
            log.warning(kv("session_log_resumed", session=session, lost_lines=self._resumed))
            self._resumed = None
        if self.error is not None and self.lost_lines and now >= self._next_report:
            self._next_report = now + REPORT_INTERVAL
            self._reported = True
            log.error(
                kv(
                    "session_log_losing_lines",
                    session=session,
                    lost_lines=self.lost_lines,
                    error=self.error,
                    path=self.path,
                )
            )

    def held(self, session: str, seconds: float, now: float) -> None:
        """The pipe is held `seconds` for the rate; said once per interval."""
        self._held += seconds
        if now >= self._next_throttle_report:
            self._next_throttle_report = now + REPORT_INTERVAL
            log.warning(
                kv(
                    "session_log_throttled",
                    session=session,
                    rate=f"{self.rate:.0f}B/s",
                    burst=f"{self.burst:.0f}B",
                    held=f"{self._held:.1f}s",
                )
            )
            self._held = 0.0


class PipeReader:
    """Reads one worker's output pipe into its session's log, from the event
    loop: budgeted per wake-up, held back over the session's rate."""

    def __init__(
        self,
        fd: int,
        log: SessionLog,
        session: str,
        on_lines: Callable[[list[str]], None],
        want_lines: Callable[[], bool] = lambda: True,
    ) -> None:
        self.fd = fd
        self.log = log
        self.session = session
        self.on_lines = on_lines
        self.want_lines = want_lines
        self.on_eof: Callable[[], None] | None = None
        self.closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._resume: asyncio.TimerHandle | None = None
        self._bug_logged = False
        os.set_blocking(fd, False)
        try:
            self.capacity = fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ)
        except OSError:
            self.capacity = READ_SIZE  # not a pipe (a test's file): one read's worth
        # A pipe made bigger than this still drains in bounded bites at exit.
        self.capacity = min(max(self.capacity, READ_SIZE), 16 * READ_SIZE)

    def start(self, loop: asyncio.AbstractEventLoop, on_eof: Callable[[], None]) -> None:
        """Read whenever the pipe is readable; `on_eof` once it is closed."""
        self._loop, self.on_eof = loop, on_eof
        loop.add_reader(self.fd, self.on_readable)

    def on_readable(self) -> None:
        """One wake-up: read up to the budget and what the rate allows, or
        hold the pipe until the rate allows a useful read."""
        now = time.monotonic()
        allowed = self.log.allowance(now)
        if allowed < self.log.resume_level():
            self._hold(now)
            return
        if not self._guarded_drain(min(READ_BUDGET, allowed)):
            self.end()

    def drain_at_exit(self) -> None:
        """The worker exited: log what its pipe holds now, whatever the rate
        (a pipe holds little). Descendants that still write are read on."""
        if not self.closed and not self._guarded_drain(self.capacity + 1, with_stamps=False):
            self.end()

    def _guarded_drain(self, budget: float, with_stamps: bool = True) -> bool:
        try:
            return self.drain(budget, with_stamps)
        except Exception:
            # A bug, but one session's output must not fill the supervisor's
            # log with the same traceback on every read, nor stop the loop.
            if not self._bug_logged:
                self._bug_logged = True
                log.exception(kv("bug", where="session_log", session=self.session))
            return True

    def drain(self, budget: float = math.inf, with_stamps: bool = True) -> bool:
        """Read what is there now, up to `budget` bytes: read and, if
        `with_stamps`, their stamps too (a 2-byte line is stored as 30
        bytes: a `yes` would otherwise have one wake-up write 15 times its
        budget). False at end of file."""
        taken = 0
        stamped_before = self.log.stamp_bytes
        want = self.want_lines()
        try:
            while True:
                used = taken + (self.log.stamp_bytes - stamped_before if with_stamps else 0)
                if used >= budget:
                    return True
                size = READ_SIZE
                if budget - used < READ_SIZE:
                    # What is left of the budget, shrunk by what stamps added
                    # to the reads so far (lines of one output look alike).
                    size = int((budget - used) * taken / used) if used else int(budget - used)
                try:
                    data = os.read(self.fd, max(1, size))
                except BlockingIOError:
                    return True
                except OSError:
                    data = b""
                if not data:
                    self._hand(self.log.finish(want))
                    return False
                taken += len(data)
                self._hand(self.log.feed(data, want))
        finally:
            self.log.spend(taken)
            self.log.report(self.session, time.monotonic())

    def _hand(self, lines: list[bytes]) -> None:
        if lines:
            self.on_lines([line.decode("utf-8", "replace") for line in lines])

    def _hold(self, now: float) -> None:
        """Stop reading until the bucket has refilled."""
        assert self._loop is not None
        self._loop.remove_reader(self.fd)
        wait = self.log.wait_time()
        self._resume = self._loop.call_later(wait, self._unhold)
        self.log.held(self.session, wait, now)

    def _unhold(self) -> None:
        self._resume = None
        if not self.closed and self._loop is not None:
            self._loop.add_reader(self.fd, self.on_readable)

    def end(self) -> None:
        """Stop reading, close the pipe and the log file, and say so."""
        if self.closed:
            return
        if self._loop is not None:
            self._loop.remove_reader(self.fd)
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        self.close()
        if self.on_eof is not None:
            self.on_eof()

    def close(self) -> None:
        """Close the pipe and the log file."""
        self.closed = True
        try:
            os.close(self.fd)
        except OSError:
            pass
        self.log.close()
