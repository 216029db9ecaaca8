"""A repository shared by sealed sessions, as each sees it. A session's
workspace is a repository of its own whose objects borrow the shared one's
(`objects/info/alternates`, supervisor/worktrees.py): the shared repository's
git directory is bound back into the session's view at its own path, and
read-only there, all of it. The session reads its objects and branches,
and writes nothing of it: not a ref (its neighbours' branches, the
operator's), not an object, not its config or hooks (docs/repositories.md).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from hermes_sup.local.syscalls import MS_BIND, MS_REC

from .seal_calls import _mount, _read_small, _remount_readonly

GIT_WORKTREES = "worktrees"


def _common_dirs(repos: Iterable[Path]) -> dict[str, Path]:
    """The git directories of the repositories in `repos` (their realpaths,
    as strings), of those that are one: `.git` of a work tree, or a bare
    repository itself."""
    found: dict[str, Path] = {}
    for repo in repos:
        dotgit = repo / ".git"
        if os.path.isdir(dotgit) and not os.path.islink(dotgit):
            common = Path(os.path.realpath(dotgit))
        elif (repo / "HEAD").is_file() and (repo / "objects").is_dir():
            common = Path(os.path.realpath(repo))
        else:
            continue
        found[str(common)] = common
    return found


def git_common_dir(workspace: Path, repos: Iterable[Path]) -> Path | None:
    """The shared repository's git directory whose objects a session's
    repository borrows (a line of its `.git/objects/info/alternates`), which
    must stay visible at its own path for git to work in it; None for
    anything else. The session can write that file, so only the git
    directory of one of `repos` (its repository, the configured one, a
    repository root that is one) counts: anything else it names is never
    bound into its view."""
    dotgit = workspace / ".git"
    if not os.path.isdir(dotgit) or os.path.islink(dotgit):
        return None
    text = _read_small(dotgit / "objects" / "info" / "alternates")
    if text is None:
        return None
    known = _common_dirs(repos)
    for line in text.splitlines():
        named = Path(line.strip())
        if line.startswith("#") or not named.is_absolute() or named.name != "objects":
            continue
        common = known.get(os.path.realpath(named.parent))
        if common is not None and os.path.realpath(named) == str(common / "objects"):
            return common
    return None


def own_worktree_admin(common: Path, workspace: Path) -> Path | None:
    """The session's own `worktrees/<name>` directory in the common git
    directory: the one whose `gitdir` file (written by git, read-only to
    sessions) names this workspace, never what the workspace's `.git` file
    says (the session can write that). None for a session whose workspace
    is a repository of its own: nothing of the shared one is its."""
    if os.path.isdir(workspace / ".git"):
        return None
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
    """In the session's view, the shared repository's git directory is
    read-only, all of it: its refs (every other session's branches and the
    operator's), objects, packed-refs and reflogs, config, hooks and
    worktrees. The session's own repository (in its workspace) is where it
    writes. `workspace` is its repository's work tree: nothing of it is in
    `common`."""
    del workspace  # nothing of the session's own is under the shared directory
    _bind_read_only("git", common)
