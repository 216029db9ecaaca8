"""A repository shared by sealed sessions, as each sees it.

A session on a repository (`repo`) works in a repository of its own whose
objects borrow the shared one's (`objects/info/alternates`,
supervisor/worktrees.py): the shared repository's git directory is bound
back into the session's view at its own path, read-only there, all of it.
The session reads its objects and branches, and writes nothing of it: not a
ref (its neighbours' branches, the operator's), not an object, not its
config or hooks (docs/repositories.md).

A workspace an operator made as a linked worktree of a repository (a
`workspace` under a workspace root) keeps its repository's git directory
visible too, with what git runs or follows there read-only, so that its
configuration runs nowhere else; it commits to that repository's refs. It
counts only if the repository has it registered (`worktrees/<name>` whose
`gitdir` names it): a session can write its own `.git` file, never that.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from hermes_sup.local.syscalls import MS_BIND, MS_REC
from hermes_sup.seal.calls import _mount, _open_path, _read_small, _remount_readonly, _under

# What of a linked worktree's repository its session may not change: what
# git runs (config, hooks), what decides it (info/attributes), the main
# worktree's state and every other worktree. In its own worktree's
# directory, what points git elsewhere or configures it.
GIT_READ_ONLY = ("config", "config.worktree", "hooks", "info", "HEAD", "index", "modules")
GIT_WORKTREES = "worktrees"
ADMIN_READ_ONLY = ("config.worktree", "commondir", "gitdir")


def _common_dirs(repos: Iterable[Path]) -> dict[str, Path]:
    """The git directories of the repositories in `repos` (their realpaths,
    as strings), of those that are one: `.git` of a work tree, the common
    directory of a linked worktree named as the repository (the operator's
    choice), or a bare repository itself."""
    found: dict[str, Path] = {}
    for repo in repos:
        dotgit = repo / ".git"
        if os.path.isdir(dotgit) and not os.path.islink(dotgit):
            common = Path(os.path.realpath(dotgit))
        elif os.path.isfile(dotgit):
            text = _read_small(dotgit) or ""
            admin = Path(repo, text.partition(":")[2].strip())
            named = (_read_small(admin / "commondir") or "").strip()
            if not text.startswith("gitdir:") or not named:
                continue
            common = Path(os.path.realpath(admin / named))
        elif (repo / "HEAD").is_file() and (repo / "objects").is_dir():
            common = Path(os.path.realpath(repo))
        else:
            continue
        found[str(common)] = common
    return found


def git_common_dir(workspace: Path, repos: Iterable[Path]) -> Path | None:
    """The git directory of the repository a workspace needs visible at its
    own path for git to work in it, if it is one of `repos` (the session's
    repository, the configured one, the repository roots); None for
    anything else. A session's own repository names it in its alternates; a
    linked worktree counts only if that repository registered it."""
    dotgit = workspace / ".git"
    if os.path.islink(dotgit):
        return None  # never followed: the session may have made it
    if os.path.isdir(dotgit):
        return _borrowed_from(dotgit, repos)
    return _registered_in(workspace, repos)


def _borrowed_from(dotgit: Path, repos: Iterable[Path]) -> Path | None:
    """The git directory whose objects a session's repository borrows (a
    line of its `objects/info/alternates`), if it is that of one of `repos`
    exactly: the session can write that file, and anything else it names is
    never bound into its view."""
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


def _registered_in(workspace: Path, repos: Iterable[Path]) -> Path | None:
    """The common git directory of a linked worktree workspace (a `.git`
    file naming `gitdir: ...`) under one of `repos`, if that repository has
    the worktree registered: its `worktrees/<name>/gitdir`, which git wrote,
    names this workspace."""
    text = _read_small(workspace / ".git")
    if text is None or not text.startswith("gitdir:"):
        return None
    admin = Path(text.partition(":")[2].strip())
    if not admin.is_absolute():
        admin = workspace / admin
    common = _read_small(admin / "commondir")
    if common is None:
        return None  # a repository's own git directory is no worktree's
    named = Path(common.strip())
    path = (named if named.is_absolute() else admin / named).resolve()
    if not _under(path, [Path(r).resolve() for r in repos]):
        return None
    return path if own_worktree_admin(path, workspace) is not None else None


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
    """In the session's view, what of the repository in `common` it may not
    change becomes read-only: for a session's own repository, the whole
    shared git directory (its refs, every other session's branches and the
    operator's, objects, packed-refs, reflogs, config, hooks); for a
    linked worktree, its repository's config, hooks, attributes and other
    worktrees (GIT_READ_ONLY), and in its own worktree's directory what
    redirects or configures git (ADMIN_READ_ONLY)."""
    if os.path.isdir(workspace / ".git"):
        _bind_read_only("git", common)
        return
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
