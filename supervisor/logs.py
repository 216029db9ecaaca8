"""Session logs: a worker's stdout and stderr, written by the supervisor.

Each worker writes to a pipe whose read end the supervisor holds. The
supervisor writes whole lines to the session's `worker.log`, rotating it by
size only at a line boundary, and drains the pipe before it handles the
worker's exit, so the last lines a dying worker printed are never lost. It
also hands each line to whoever follows the log (`hermes-sup logs -f`).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable
from pathlib import Path

READ_SIZE = 65536
# A line longer than this is written in pieces rather than buffered forever.
MAX_LINE = 64 * 1024


class SessionLog:
    """One session's log file, size-rotated at line boundaries."""

    def __init__(self, path: Path, max_bytes: int = 10 * 1024 * 1024, backups: int = 3) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self._partial = b""
        self._fd: int | None = None
        self._size = 0

    def _open(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            self._size = os.fstat(self._fd).st_size
        return self._fd

    def feed(self, data: bytes) -> list[str]:
        """Write every complete line in `data`; keep the rest for later.
        Returns the lines written (decoded, without newlines)."""
        buf = self._partial + data
        lines = buf.split(b"\n")
        self._partial = lines.pop()
        while len(self._partial) > MAX_LINE:
            lines.append(self._partial[:MAX_LINE])
            self._partial = self._partial[MAX_LINE:]
        return self._write(lines)

    def finish(self) -> list[str]:
        """Write a trailing unterminated line, if any (the writer is gone)."""
        if not self._partial:
            return []
        line, self._partial = self._partial, b""
        return self._write([line])

    def _write(self, lines: list[bytes]) -> list[str]:
        if not lines:
            return []
        for line in lines:
            record = line + b"\n"
            if self._size and self._size + len(record) > self.max_bytes:
                self._rotate()
            fd = self._open()
            os.write(fd, record)
            self._size += len(record)
        return [line.decode("utf-8", "replace") for line in lines]

    def _rotate(self) -> None:
        self.close()
        for i in range(self.backups - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{i}")
            if older.exists():
                os.replace(older, self.path.with_name(f"{self.path.name}.{i + 1}"))
        if self.path.exists():
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))

    def close(self) -> None:
        """Close the file (it is reopened on the next line)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def tail(path: Path, count: int, backups: int = 3) -> list[str]:
    """The last `count` lines of a log and, if needed, its rotated files."""
    out: deque[str] = deque(maxlen=count)
    files = [path.with_name(f"{path.name}.{i}") for i in range(backups, 0, -1)] + [path]
    for f in files:
        try:
            with open(f, "rb") as fh:
                for raw in fh:
                    out.append(raw.rstrip(b"\n").decode("utf-8", "replace"))
        except FileNotFoundError:
            continue
    return list(out)


class PipeReader:
    """Reads one worker's output pipe into its SessionLog, from the event loop."""

    def __init__(self, fd: int, log: SessionLog, on_lines: Callable[[list[str]], None]) -> None:
        self.fd = fd
        self.log = log
        self.on_lines = on_lines
        os.set_blocking(fd, False)

    def drain(self) -> bool:
        """Read everything available now. Returns False at end of file."""
        while True:
            try:
                data = os.read(self.fd, READ_SIZE)
            except BlockingIOError:
                return True
            except OSError:
                data = b""
            if not data:
                lines = self.log.finish()
                if lines:
                    self.on_lines(lines)
                return False
            lines = self.log.feed(data)
            if lines:
                self.on_lines(lines)

    def close(self) -> None:
        """Close the pipe and the log file."""
        try:
            os.close(self.fd)
        except OSError:
            pass
        self.log.close()
