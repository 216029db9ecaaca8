"""A repository shared by sealed sessions, as each sees it: its common git
directory bound back into the session's view, with what git would run or
follow made read-only there, so one session's git configuration runs in no
other session, nor in the supervisor's own git (docs/repositories.md).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from hermes_sup.local.syscalls import MS_BIND, MS_REC
from hermes_sup.seal.calls import _mount, _open_path, _read_small, _remount_readonly, _under

# What of a repository's common git directory a session may not change:
# what git runs (config, hooks), what decides it (info/attributes), the main
# worktree's state and every other session's worktree. Objects, refs and
# logs stay writable: committing to its own branch needs them. In its own
# worktree's directory, what points git elsewhere or configures it.
GIT_READ_ONLY = ("config", "config.worktree", "hooks", "info", "HEAD", "index", "modules")
GIT_WORKTREES = "worktrees"
ADMIN_READ_ONLY = ("config.worktree", "commondir", "gitdir")


def git_common_dir(workspace: Path, repos: Iterable[Path]) -> Path | None:
    """The repository's common git directory of a worktree workspace (a
    `.git` file naming `gitdir: ...`), which must stay visible at its own
    path for git to work in it; None for anything else. The session wrote
    that file, so only a directory under one of `repos` (the configured
    repository and repository roots) counts: anything else it names (another
    session's directory, say) is never bound into its view."""
    text = _read_small(workspace / ".git")
    if text is None or not text.startswith("gitdir:"):
        return None
    admin = Path(text.partition(":")[2].strip())
    if not admin.is_absolute():
        admin = workspace / admin
    common = _read_small(admin / "commondir")
    if common is None:
        path = admin.resolve()
    else:
        named = Path(common.strip())
        path = (named if named.is_absolute() else admin / named).resolve()
    return path if _under(path, [Path(r).resolve() for r in repos]) else None


def own_worktree_admin(common: Path, workspace: Path) -> Path | None:
    """The session's own `worktrees/<name>` directory in the common git
    directory: the one whose `gitdir` file (written by git, read-only to
    sessions) names this workspace, never what the workspace's `.git` file
    says (the session can write that)."""
    wanted = os.path.realpath(workspace / ".git")
    try:
        names = os.listdir(common / GIT_WORKTREES)
    except OSError:
        return None
    for name in names:
        named = _read_small(common / GIT_WORKTREES / name / "gitdir")
        if named is not None and os.path.realpath(named.strip()) == wanted:
            return common / GIT_WORKTREES / name
    return None


def _bind_read_only(step: str, path: Path) -> None:
    """Make `path` (a file or a directory) read-only where it is: a mount
    of itself, which can be neither written nor renamed over nor removed."""
    _mount(step, str(path), str(path), None, MS_BIND | MS_REC)
    _remount_readonly(step, path)


def _protect_git(common: Path, workspace: Path) -> None:
    """In the session's view, a repository shared by sessions executes
    nothing one session configured in another, nor in the supervisor's
    git: its config, hooks, attributes and the other sessions' worktree
    directories become read-only (GIT_READ_ONLY); the session's own
    worktree directory stays writable but for what redirects or configures
    git (ADMIN_READ_ONLY)."""
    own = own_worktree_admin(common, workspace)
    own_fd = _open_path("git", own) if own is not None else None
    try:
        for name in (*GIT_READ_ONLY, GIT_WORKTREES):
            if os.path.lexists(common / name):
                _bind_read_only("git", common / name)
        if own is not None and own_fd is not None:
            _mount("git", f"/proc/self/fd/{own_fd}", str(own), None, MS_BIND)
            for name in ADMIN_READ_ONLY:
                if os.path.lexists(own / name):
                    _bind_read_only("git", own / name)
    finally:
        if own_fd is not None:
            os.close(own_fd)
