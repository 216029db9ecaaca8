"""Where a sealed worker's things are: the fixed paths its session's
directories are mounted over (the supervisor names them, the zygote imports
under them, the worker mounts over them), and the service's own code, which
every session must still be able to read.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .calls import _under


@dataclass(frozen=True)
class SealedPaths:
    """The fixed paths the zygote imports under and every sealed worker
    finds its own session's directories at: P (HERMES_HOME), W (the
    workspace and cwd), U (HOME)."""

    home: Path
    workspace: Path
    user: Path

    @classmethod
    def for_data_dir(cls, data_dir: str | os.PathLike[str]) -> SealedPaths:
        base = Path(data_dir) / "sealed"
        return cls(home=base / "home", workspace=base / "workspace", user=base / "user")

    def make(self) -> None:
        """Create the three (empty) directories, as the zygote does."""
        for path in (self.home, self.workspace, self.user):
            path.mkdir(mode=0o700, parents=True, exist_ok=True)


@functools.cache
def code_paths() -> tuple[Path, ...]:
    """Where this worker's code comes from: the interpreter's prefixes,
    the directories on sys.path, and this package. Not sys.path[0]: under
    `python -m` that is only the directory the service was started in."""
    found: list[Path] = []
    for raw in (sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path[1:]):
        if raw and os.path.isdir(raw):
            found.append(Path(os.path.realpath(raw)))
    found.append(Path(os.path.realpath(__file__)).parent.parent)
    unique: list[Path] = []
    for path in sorted(set(found), key=lambda p: len(p.parts)):
        if not _under(path, unique):
            unique.append(path)
    return tuple(unique)


@functools.cache
def _closed_code_ancestors() -> frozenset[Path]:
    return frozenset(closed_ancestors(code_paths()))


def closed_ancestors(paths: Iterable[Path]) -> set[Path]:
    """The highest directory above each path that other users cannot pass
    through (e.g. /root, when the interpreter is in /root/.pyenv). Hidden
    under a tmpfs that others may pass through, with the path bound back,
    the code becomes reachable by a session's own uid, and nothing else of
    that directory does."""
    closed: set[Path] = set()
    for path in paths:
        for parent in reversed(path.parents):
            if parent == Path("/"):
                continue
            try:
                if not os.stat(parent).st_mode & 0o001:
                    closed.add(parent)
                    break
            except OSError:
                break
    return closed
