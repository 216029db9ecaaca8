"""`hermes-sup logs --data-dir`: a session's log read from disk, so it can be
read with the supervisor down (after a crash, say).

A session's directory is named by a digest of its key (PROTOCOL.md), so the
key alone finds it; the worker's stdout and stderr are in `worker.log`
there, with the older lines in `worker.log.1`, `.2`, ... (rotated by size,
newest first), each line after its timestamp (supervisor/logread.py).
Following polls the file as `tail -F` does: across rotation, and across the
file appearing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

from hermes_sup.protocol import session_dir_name
from hermes_sup.supervisor import logread

LOG_FILE = "worker.log"  # as the supervisor writes it (supervisor/session.py)
POLL = 0.25


def session_log(data_dir: Path, key: str) -> Path:
    """Where the supervisor writes the log of session `key`."""
    return data_dir / "sessions" / session_dir_name(key) / LOG_FILE


def rotated(path: Path) -> list[Path]:
    """The log's rotated files that exist, oldest first."""
    found = []
    i = 1
    while (older := path.with_name(f"{path.name}.{i}")).exists():
        found.append(older)
        i += 1
    return list(reversed(found))


def tail(
    path: Path,
    count: int,
    since: float | None = None,
    until: float | None = None,
    timestamps: bool = False,
) -> list[str]:
    """The last `count` lines of the log and its rotated files, chosen and
    shown as the supervisor does for `logs` (by the same code)."""
    return logread.tail(
        path, count, backups=len(rotated(path)), since=since, until=until, timestamps=timestamps
    )


def follow(path: Path, stop_after: float | None = None) -> Iterator[str]:
    """Every line written to the log from now on, as stored (with its
    stamp), across rotation; runs until the caller stops iterating (Ctrl-C)
    or, once nothing more is there to read, until the clock passes
    `stop_after` (seconds since the epoch)."""
    fh = None
    ino = None
    partial = b""
    try:
        try:
            fh = open(path, "rb")  # noqa: SIM115 - kept open while following
            fh.seek(0, os.SEEK_END)
            ino = os.fstat(fh.fileno()).st_ino
        except FileNotFoundError:
            pass
        while True:
            data = fh.read() if fh is not None else b""
            if data:
                partial += data
                *lines, partial = partial.split(b"\n")
                for line in lines:
                    yield line.decode("utf-8", "replace")
                continue
            if stop_after is not None and time.time() > stop_after:
                return
            time.sleep(POLL)
            try:
                now = os.stat(path).st_ino
            except FileNotFoundError:
                continue
            if now != ino:  # rotated (or created): finish the old file, open the new
                if fh is not None:
                    rest = fh.read()
                    fh.close()
                    partial += rest
                    *lines, partial = partial.split(b"\n")
                    for line in lines:
                        yield line.decode("utf-8", "replace")
                fh = open(path, "rb")  # noqa: SIM115
                ino = os.fstat(fh.fileno()).st_ino
    finally:
        if fh is not None:
            fh.close()
