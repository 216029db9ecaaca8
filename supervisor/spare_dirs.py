"""Session directories made ahead of time, so that a new session's worker
finds its directories there instead of creating them as it starts.

A new session's directory, with its `home/`, `workspace/` and `tmp/`, is four
directory creations; on ext4 each is a journalled metadata change of a few
hundred microseconds, made by the worker between its fork and its first
reply. A spare made earlier is moved into place with one rename, right after
the zygote is asked for the worker (so the rename runs while the worker
starts), and a new spare is made behind it.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
from pathlib import Path

from .session import sessions_dir

log = logging.getLogger("hermes_sup.supervisor")

SPARE_DIR = ".spare-sessions"  # beside <data>/sessions, on the same file system


class SpareDirs:
    """A few empty session directories, ready to be renamed into place."""

    def __init__(self, data_dir: Path, target: int = 4) -> None:
        self.root = data_dir / SPARE_DIR
        self.sessions = sessions_dir(data_dir)
        self.target = target
        self.free: list[Path] = []
        self._names = itertools.count()

    def reset(self) -> None:
        """Forget spares a previous run left (their names are not ours), and
        make a full set."""
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.sessions.mkdir(mode=0o700, exist_ok=True)
        self.free.clear()
        self.refill(self.target)

    def take(self, dest: Path, with_workspace: bool = True) -> bool:
        """Move a spare to `dest`; False if there is none, or `dest` is
        already there with something in it (the worker got ahead and made
        its own). A `dest` the worker has made but left empty so far is
        replaced: the worker then finds the spare's directories (see
        worker.main._make_dir)."""
        if not self.free:
            return False
        spare = self.free.pop()
        try:
            os.rename(spare, dest)
        except OSError:
            self.free.append(spare)
            return False
        if not with_workspace:
            try:
                (dest / "workspace").rmdir()  # the session's workspace is elsewhere
            except OSError:
                pass
        return True

    def refill(self, most: int = 1) -> None:
        """Make up to `most` spares, stopping at the target."""
        for _ in range(most):
            if len(self.free) >= self.target:
                return
            spare = self.root / str(next(self._names))
            try:
                spare.mkdir(mode=0o700)
                (spare / "home").mkdir(mode=0o700)
                (spare / "workspace").mkdir(mode=0o700)
                (spare / "tmp").mkdir(mode=0o700)
            except OSError as exc:
                log.warning("cannot make a spare session directory %s: %s", spare, exc)
                shutil.rmtree(spare, ignore_errors=True)
                return
            self.free.append(spare)
