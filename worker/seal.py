"""A sealed worker's view of the machine: what its session may not see,
what it sees at its own path, and its session's directories over the fixed
paths the zygote imported under. Only a worker mounts; the steps around it
(its namespaces before, its uid after) are hermes_sup.seal.steps.

`mount_session`: a tmpfs of its own (size-limited) over /tmp, /var/tmp
and /dev/shm; a read-only tmpfs over the data dir (every other session,
the zygote's home), over the state dir (the signing key, the sockets)
and over the workspace and repository roots; then bound back at their
own paths only what this worker needs: its own session directory
(read-only), the service's code if it lived under a hidden directory, a
git worktree's common directory; and the session's home, workspace and
HOME over the fixed paths P, W, U (`SealedPaths`) that the zygote
imported under. Every path captured at import is then the session's own.
The worker socket is not bound back: nothing in the session's view
leads to it. A worker forked for a session keeps an O_PATH descriptor
of it, connects through that (`/proc/self/fd/N`) and closes it once
connected, before any of the session's code runs; a spare connected
before its mounts. A session's shell (or code loaded into the worker
later) has no path to any socket of the supervisor's, so it cannot
open connections to exhaust its descriptors.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hermes_sup.local.syscalls import (
    MS_BIND,
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    MS_RDONLY,
    MS_REC,
    MS_REMOUNT,
)
from hermes_sup.seal.calls import (
    MOUNTPOINT_MODE,
    SealError,
    _check_fault,
    _makedirs,
    _mount,
    _open_path,
    _remount_readonly,
    _remount_writable,
    _under,
)
from hermes_sup.seal.paths import SealedPaths, _closed_code_ancestors, closed_ancestors, code_paths
from hermes_sup.seal.steps import read_only_root

from .seal_git import _protect_git, git_common_dir, own_worktree_admin

# The tmpfs over what a session may not see: empty, tiny, read-only once
# its mount points are made.
TMPFS_FLAGS = MS_NOSUID | MS_NODEV | MS_NOEXEC
TMPFS_DATA = f"mode={MOUNTPOINT_MODE:o},size=64k"

# The session's /tmp when it is a tmpfs (plan["tmp_bytes"]): a /tmp as any
# program expects it, in the session's view only.
TMP_FLAGS = MS_NOSUID | MS_NODEV


@dataclass(frozen=True)
class SessionDirs:
    """One session's own directories, at their real paths."""

    dir: Path  # the session's directory under <data>/sessions
    home: Path
    workspace: Path
    tmp: Path
    user: Path  # its HOME


# What no session may see of a temporary directory shared by the machine.
COMMON_TMP = (Path("/tmp"), Path("/var/tmp"), Path("/dev/shm"))


@dataclass(frozen=True)
class View:
    """What every session of one supervisor's settings hides (tmpfs over
    each, shallowest first) and which of the service's code comes back at
    its own path (read-only): the same for all its sessions, so worked out
    once (a spare, before it has a session)."""

    hidden: tuple[Path, ...]
    code: tuple[Path, ...]


@functools.lru_cache(maxsize=4)
def view_for(
    mode: str, data_dir: str, state_dir: str, hide: tuple[str, ...], shared: tuple[str, ...]
) -> View:
    """The View of a plan's settings (`shared`: the directories every
    session reads, such as an agent's template home, that exist)."""
    shared_paths = [Path(p) for p in shared]
    codes = (*code_paths(), *shared_paths)
    own = [Path(data_dir), Path(state_dir)]
    hide_set = {*own, *(Path(p) for p in hide)}
    if mode == "root":
        hide_set |= _closed_code_ancestors() | closed_ancestors(shared_paths)
    hidden = tuple(sorted(hide_set, key=lambda p: len(p.parts)))
    code = []
    for path in codes:
        if _under(path, own) or any(_under(p, [path]) for p in own):
            continue  # nothing of the data or state dir comes back this way
        # Hidden code comes back; not root, all of it comes back read-only:
        # the session's uid may own it, and a worker must not change what
        # the next supervisor or zygote will run.
        if mode == "user" or _under(path, [*hidden, *COMMON_TMP]):
            code.append(path)
    return View(hidden=hidden, code=tuple(code))


def plan_view(plan: dict[str, Any]) -> View:
    """The View of a sealing plan (or of a spare's, which carries the same
    settings: see supervisor/sealing.py)."""
    shared = tuple(p for p in plan.get("read", ()) if os.path.isdir(p))
    return view_for(
        plan["mode"], plan["data_dir"], plan["state_dir"], tuple(plan.get("hide", ())), shared
    )


# The lock directories a session gets a tmpfs of its own over (/var/lock
# is mostly a link to /run/lock): writable by every uid on the host, so
# what a session leaves there would outlive it.
LOCK_DIRS = ("/run/lock", "/var/lock")
LOCK_TMPFS_DATA = "mode=1777,size=1m"


def _lock_dirs() -> list[Path]:
    found: list[Path] = []
    for raw in LOCK_DIRS:
        path = Path(os.path.realpath(raw))
        if path.is_dir() and path not in found:
            found.append(path)
    return found


def mount_session(
    plan: dict[str, Any], dirs: SessionDirs, paths: SealedPaths, keep_socket: bool = False
) -> dict[str, Any]:
    """Stage 2: hide what is shared, bind back what this session needs,
    put its directories over the fixed paths, chdir to W. `keep_socket`:
    return an O_PATH descriptor of the worker socket as "socket_fd" (for a
    worker that has yet to connect; it must close it once connected)."""
    fault = plan.get("fault")
    data_dir = Path(plan["data_dir"])
    state_dir = Path(plan["state_dir"])
    tmp_bytes = int(plan.get("tmp_bytes") or 0)
    # Taken before any mount: a path may be hidden by the time it is bound.
    fds: dict[str, int] = {}
    socket_fd: int | None = None
    umask = os.umask(0)  # mount points get exactly MOUNTPOINT_MODE
    try:
        if keep_socket:
            socket_fd = _open_path("session", Path(plan["socket"]))
        for name, path in (
            ("home", dirs.home),
            ("workspace", dirs.workspace),
            ("user", dirs.user),
            ("dir", dirs.dir),
        ):
            fds[name] = _open_path("session", path)
        if not tmp_bytes:
            fds["tmp"] = _open_path("session", dirs.tmp)
        view = plan_view(plan)
        hidden = view.hidden
        # Nothing of the host is writable from here on but what is mounted
        # below for the session: its own directories, its tmp, its locks.
        # (Files a session wrote to /run/lock or into a directory its uid
        # owns would outlive it, or run as the service at its next start.)
        _check_fault("readonly", fault)
        read_only_root("readonly")
        # What must stay at its own path: (name, source, target, read-only).
        keep: list[tuple[str, Path, bool]] = [("dir", dirs.dir, True)]
        if not _under(dirs.workspace, [dirs.dir]):
            keep.append(("workspace", dirs.workspace, False))
        repos = [Path(r) for r in plan.get("repos", ()) if r]
        common = git_common_dir(dirs.workspace, repos) if repos else None
        if common is not None and (_under(common, [data_dir, state_dir]) or not common.is_dir()):
            common = None
        if common is not None:
            fds["git"] = _open_path("session", common)
            keep.append(("git", common, False))
        # The service's code (and what every session reads) that is hidden.
        for i, code in enumerate(view.code):
            fds[f"code{i}"] = _open_path("session", code)
            keep.append((f"code{i}", code, True))

        # The session's tmp is every shared temporary directory: a tmpfs of
        # its own, bounded and gone with the session's last process, or
        # (tmp_bytes 0) its tmp/ on disk.
        _check_fault("tmp", fault)
        if tmp_bytes:
            _mount("tmp", "tmpfs", "/tmp", "tmpfs", TMP_FLAGS, f"mode=1777,size={tmp_bytes}")
            tmp_src = "/tmp"
        else:
            tmp_src = f"/proc/self/fd/{fds['tmp']}"
        for common_tmp in ("/tmp", "/var/tmp", "/dev/shm"):
            if os.path.isdir(common_tmp) and (common_tmp, tmp_src) != ("/tmp", "/tmp"):
                _mount("tmp", tmp_src, common_tmp, None, MS_BIND)
                if not tmp_bytes:  # a bind of the (now read-only) disk
                    _remount_writable("tmp", Path(common_tmp))
        # Lock directories every program may write: the session's own,
        # small, gone with it. And its IPC namespace's message queues where
        # the host shows them.
        for lock_dir in _lock_dirs():
            _mount("tmp", "tmpfs", str(lock_dir), "tmpfs", TMPFS_FLAGS, LOCK_TMPFS_DATA)
        if os.path.isdir("/dev/mqueue"):
            _mount("tmp", "mqueue", "/dev/mqueue", "mqueue", TMPFS_FLAGS)

        # Read-only empty directories over what no session may see.
        _check_fault("hide", fault)
        tmpfs: list[Path] = []
        for path in hidden:
            _makedirs("hide", path)
            _mount("hide", "tmpfs", str(path), "tmpfs", TMPFS_FLAGS, TMPFS_DATA)
            tmpfs.append(path)

        # The session's directories over the fixed paths.
        _check_fault("session", fault)
        for name, target in (
            ("home", paths.home),
            ("workspace", paths.workspace),
            ("user", paths.user),
        ):
            _makedirs("session", target)
            _mount("session", f"/proc/self/fd/{fds[name]}", str(target), None, MS_BIND | MS_REC)
            _remount_writable("session", target)

        # What stays visible at its own path, shallowest first.
        _check_fault("bind", fault)
        for name, path, readonly in sorted(keep, key=lambda k: len(k[1].parts)):
            hidden_here = _under(path, [*hidden, *COMMON_TMP])
            if not hidden_here and not name.startswith("code") and readonly:
                continue  # never hidden, and read-only with the rest of /
            _makedirs("bind", path)
            _mount("bind", f"/proc/self/fd/{fds[name]}", str(path), None, MS_BIND | MS_REC)
            if readonly:
                _remount_readonly("bind", path)
            else:
                _remount_writable("bind", path)
        for path in tmpfs:  # ours: no flags to keep but those we gave
            _mount("hide", None, str(path), None, MS_REMOUNT | MS_BIND | MS_RDONLY | TMPFS_FLAGS)
        if common is not None:
            _protect_git(common, dirs.workspace)
    except BaseException:
        if socket_fd is not None:
            os.close(socket_fd)
        raise
    finally:
        os.umask(umask)
        for fd in fds.values():
            os.close(fd)
    try:
        os.chdir(paths.workspace)
    except OSError as exc:
        if socket_fd is not None:
            os.close(socket_fd)
        raise SealError("session", f"chdir {paths.workspace}: {exc.strerror}") from None
    return {"hidden": [str(p) for p in hidden], "socket_fd": socket_fd}


def chown_session(
    dirs: SessionDirs,
    uid: int,
    gid: int,
    repos: Iterable[str | os.PathLike[str]] = (),
    tmp: bool = True,
) -> None:
    """Give the session's uid its own directories (as root, before `drop`).
    Whole trees only when their top is not the uid's yet (the first sealed
    start of a session): later starts touch four inodes. Its session
    directory itself stays root's: session.json and the logs are the
    supervisor's. A git worktree workspace's own directory in the
    repository (`worktrees/<name>`) is the session's too: git refuses to
    work in a worktree whose directories another user owns. `tmp`: its tmp/
    on disk is its /tmp (not a tmpfs)."""
    tops = [dirs.home, dirs.workspace, dirs.user, *([dirs.tmp] if tmp else [])]
    repo_paths = [Path(r) for r in repos if r]
    common = git_common_dir(dirs.workspace, repo_paths) if repo_paths else None
    admin = own_worktree_admin(common, dirs.workspace) if common is not None else None
    if admin is not None:
        tops.append(admin)
    for top in tops:
        try:
            st = os.lstat(top)
            if st.st_uid == uid and st.st_gid == gid:
                continue
            os.lchown(top, uid, gid)
            with os.scandir(top) as entries:
                if next(entries, None) is None:
                    continue  # a new session's: empty
            for root, subdirs, files in os.walk(top):
                os.lchown(root, uid, gid)
                for name in subdirs + files:
                    os.lchown(os.path.join(root, name), uid, gid)
        except OSError as exc:
            raise SealError("session", f"chown {top} to {uid}:{gid}: {exc.strerror}") from None
