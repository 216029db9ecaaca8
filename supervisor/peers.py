"""A session's peers: the other live sessions on its repository, written
for it to read in `workspace/.hermes-sup/peers` at each start and each
turn (ignored by git through a .gitignore of its own). The supervisor
writes it through directory descriptors without following symlinks: the
workspace is the session's to change.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

PEERS_DIR = ".hermes-sup"
PEERS_FILE = "peers"


@dataclass(frozen=True)
class Peer:
    """Another live session on the same repository."""

    key: str
    branch: str
    state: str
    label: str | None


def peers_text(key: str, repo: str, branch: str, peers: list[Peer], now: float) -> str:
    """The peers file: comment lines for a person or an agent, then one
    tab-separated line per peer (session, branch, state, label or -)."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))
    lines = [
        f"# hermes-sup: other live sessions working on the repository {repo}, as of {stamp}",
        "# (rewritten at the start of each of your turns).",
        f"# You are session {key}, on branch {branch}, in a git repository of your own.",
        "# Each session below works in its own repository on its own branch: its commits",
        "# and uncommitted changes are not in yours, nor yours in its. The operator brings",
        "# each session's branch into the shared repository (its branches: shared/*).",
    ]
    if not peers:
        lines.append("# No other session is live on this repository now.")
    else:
        lines.append("# session\tbranch\tstate\tlabel")
        lines += [f"{p.key}\t{p.branch}\t{p.state}\t{p.label or '-'}" for p in peers]
    return "\n".join(lines) + "\n"


def write_peers(session_dir: Path, text: str) -> None:
    """Write `workspace/.hermes-sup/peers` of the session in `session_dir`
    (atomically), with a `.gitignore` that keeps the directory out of git.
    Opened a directory at a time, never following a symlink: the worktree
    belongs to the session, which could have put one there. OSError if it
    cannot be written."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    top = os.open(session_dir, flags)
    try:
        workspace = os.open("workspace", flags, dir_fd=top)
    finally:
        os.close(top)
    try:
        try:
            os.mkdir(PEERS_DIR, 0o755, dir_fd=workspace)
        except FileExistsError:
            pass
        own = os.open(PEERS_DIR, flags, dir_fd=workspace)
    finally:
        os.close(workspace)
    try:
        # Readable, not writable, by the session: a sealed worker runs as a
        # uid of its own (worker/seal.py), and the directories above are
        # private to it and the service user either way.
        os.fchmod(own, 0o755)
        _write_at(own, ".gitignore", "# hermes-sup's own files, not the project's\n*\n", keep=True)
        _write_at(own, PEERS_FILE, text, keep=False)
    finally:
        os.close(own)


def _write_at(dir_fd: int, name: str, text: str, keep: bool) -> None:
    """Write `name` in the directory `dir_fd` through a new temporary file
    renamed over it; with `keep`, leave an existing one as it is."""
    if keep:
        try:
            os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            return
        except FileNotFoundError:
            pass
    tmp = f".{name}.tmp"
    try:
        os.unlink(tmp, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    fd = os.open(
        tmp,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
        0o600,
        dir_fd=dir_fd,
    )
    try:
        os.fchmod(fd, 0o644)  # see write_peers
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
