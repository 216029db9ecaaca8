"""Sealed sessions, the supervisor's side: whether the kernel lets us, and
what a worker is told to seal itself with (it does so with
hermes_sup.seal.steps, and mounts its view with worker/seal.py).

At start, with `sealed` = auto or on, `detect` forks a short-lived child
that tries what a worker will do (a mount namespace, a tmpfs, a bind, a
read-only remount, the drop to another uid) and reports. Where it fails,
"on" refuses to start with the cause and what to do about it, and "auto"
says at start that sessions run unsealed, and why.

As root, each session runs as a uid of its own, from SEALED_UID_BASE on:
derived from its key (so a session keeps its uid, and its files, from one
worker to the next), moved on to the next free one if a live session holds
it already, of this supervisor or of any other on the host (`HostUids`: a
byte-range lock per uid in one file every supervisor shares). Not root, every worker has the supervisor's uid in a user
namespace of its own; signals between workers of one uid are then kept in
by Landlock's signal scope where the kernel has it (Linux 6.12+), and
otherwise remain possible (docs/security.md says so).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import stat
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hermes_sup.local import statedir, syscalls
from hermes_sup.local.addresses import EGRESS_SOCKET
from hermes_sup.local.logfmt import kv
from hermes_sup.local.prctl import can_fork_to_parent, fork_with
from hermes_sup.seal import steps
from hermes_sup.seal.calls import FAULT_ENV, SealError

from .config import Settings
from .session import Session

log = logging.getLogger("hermes_sup.supervisor")

# Uids (and gids) of sealed sessions as root: a range no account uses.
SEALED_UID_BASE = 200_000
SEALED_UID_COUNT = 65_536
# The group every sealed session belongs to besides its own, as root: what
# an operator gives write access to a repository that sessions commit to
# (docs/repositories.md), rather than to every user.
SESSIONS_GID = SEALED_UID_BASE - 1
CAP_SYS_ADMIN = 21


class SealingUnavailable(Exception):
    """sealed = on, and this machine cannot seal sessions; says why and what to do."""


@dataclass
class Sealing:
    """Whether this supervisor's sessions are sealed, how, and if not why."""

    mode: str | None = None  # "root", "user", or None: unsealed
    asked: str = "off"  # the setting: off, auto, on
    reason: str = ""  # why unsealed although asked for
    signals_scoped: bool = False  # Landlock keeps each worker's signals in
    pid_namespaces: bool = False  # each worker the init of its own (the zygote says)
    syscall_filter: bool = False  # seccomp refuses namespaces, mounts, keyrings, ...
    # Sealed: the network the sessions have (steps.NETWORKS), and why it is
    # the host's where another was asked for.
    network: str = "host"
    network_reason: str = ""
    fault: str | None = None  # FAULT_ENV, for tests

    def describe(self) -> dict[str, Any]:
        """For status and logs."""
        return {
            "sealed": self.mode is not None,
            "mode": self.mode,
            "asked": self.asked,
            "reason": self.reason or None,
            "signals_scoped": self.signals_scoped,
            "pid_namespaces": self.pid_namespaces,
            "syscall_filter": self.syscall_filter,
            # Made with every sealed worker (seal/steps.py), said here so an
            # operator sees what holds on this host.
            "ipc_namespace": self.mode is not None,
            "network_namespace": self.mode is not None and self.network != "host",
            "network": self.network if self.mode is not None else "host",
            "network_reason": self.network_reason or None,
            "read_only_root": self.mode is not None,
            "workers_dumpable": self.mode is None,
            "warning": self.warning(),
        }

    def warning(self) -> str | None:
        """What an operator must be told while sessions are not a boundary
        (for start, status, list and the HTTP endpoint), or None."""
        if self.mode is not None:
            return self.network_warning()
        if self.asked == "off":
            return (
                "sessions run unsealed (sealed = off): a session's shell can read the "
                "supervisor's key and environment and reach every other session; "
                "use sealed = auto"
            )
        return (
            f"sessions run unsealed: {self.reason}; until then a session's shell can read "
            "the supervisor's key and environment and reach every other session"
        )

    def network_warning(self) -> str | None:
        """Sealed, but with the host's network: what a session can reach."""
        if self.network != "host":
            return None
        why = self.network_reason or 'network = "host"'
        return (
            f"sessions share the host's network ({why}): a session's shell reaches the "
            "host's loopback services, every other session's listeners and whatever the "
            'host can reach; use network = "egress"'
        )

    def spare_plan(self, settings: Settings) -> dict[str, Any] | None:
        """What a spare needs to enter its namespace at its start, and the
        settings every session's view is made of (worker/seal.py's View: a spare works
        it out before it has a session)."""
        if self.mode is None:
            return None
        return self._view_plan(settings)

    def plan(self, settings: Settings, session: Session, uid: int | None) -> dict[str, Any] | None:
        """What a session's worker seals itself with (None: unsealed)."""
        if self.mode is None:
            return None
        return {
            **self._view_plan(settings),
            # The session's /tmp (and /var/tmp, /dev/shm): a tmpfs this big,
            # or 0: its tmp/ on disk.
            "tmp_bytes": (settings.tmp_limit_mb or 0) * 1024 * 1024,
            "socket": str(settings.state_dir.absolute() / statedir.WORKER_SOCKET),
            "session_dir": str(session.dir),
            "user_dir": str(session.user),
            # Where a git worktree workspace's repository may be (seal.py
            # keeps it visible; anything else a `.git` file names is not):
            # the session's own, and where new sessions' may be.
            "repos": [r for r in (session.repo, settings.repo, *settings.repo_roots) if r],
            "uid": uid,
            "gid": uid,
            "groups": [SESSIONS_GID] if self.mode == "root" else [],
        }

    def _view_plan(self, settings: Settings) -> dict[str, Any]:
        """What is the same for every session of these settings."""
        assert self.mode is not None
        # The repository's own checkout too: a session works in its own
        # worktree and sees of the repository only its git directory.
        hide = [*settings.workspace_roots, *settings.repo_roots, *filter(None, [settings.repo])]
        if self.mode == "user":
            home = _own_home()
            if home is not None:
                hide.append(str(home))  # the operator's ~/.ssh, ~/.aws, ...
            # The service user's runtime directory: its D-Bus session bus
            # and systemd user manager would run commands outside the seal.
            hide.extend(_runtime_dirs())
        return {
            "mode": self.mode,
            "data_dir": str(settings.data_dir.absolute()),
            "state_dir": str(settings.state_dir.absolute()),
            "hide": hide,
            # Read by every session, shown read-only even where hidden: the
            # operator's template home (a front end's own is not trusted).
            "read": [t for t in (settings.runtime_config.get("template_home"),) if t],
            "network": self.network,
            "fault": self.fault,
            # worker/egress.py: where its proxy listener goes.
            "egress_socket": str(settings.state_dir.absolute() / EGRESS_SOCKET),
        }


def _own_home() -> Path | None:
    import pwd

    try:
        home = Path(pwd.getpwuid(os.getuid()).pw_dir)
    except KeyError:
        return None
    if not home.is_dir() or home == Path("/"):
        return None
    return home


def describe_limits(settings: Settings, sealing: Sealing) -> dict[str, str]:
    """How each per-session limit is enforced on this host (said at start
    and in status): by the kernel, or by the supervisor's sampler."""
    sealed = sealing.mode is not None
    mib = "{} MiB".format
    return {
        "processes": "off"
        if not settings.max_procs
        else f"{settings.max_procs}, "
        + ("kernel (RLIMIT_NPROC per session)" if sealed else "sampled (sessions share a uid)"),
        "memory": "off"
        if not settings.memory_limit_mb
        else f"{mib(settings.memory_limit_mb)}, sampled (PSS of the session's processes)",
        "tmp": (
            f"{mib(settings.tmp_limit_mb)}, kernel (a tmpfs of its own)"
            if sealed and settings.tmp_limit_mb
            else "unbounded (the session's tmp/ on disk)"
        ),
        "file_size": "off"
        if not settings.file_size_limit_mb
        else f"{mib(settings.file_size_limit_mb)}, kernel (RLIMIT_FSIZE)",
    }


def _runtime_dirs() -> list[str]:
    """This user's runtime directories (XDG_RUNTIME_DIR, /run/user/UID)."""
    found = {os.environ.get("XDG_RUNTIME_DIR") or "", f"/run/user/{os.getuid()}"}
    return sorted(p for p in found if p and os.path.isdir(p))


def uid_for(key: str, taken: set[int], host: HostUids | None = None) -> int:
    """The session's uid: from its key, or the next one no live session
    holds (of ours: `taken`; of any supervisor on the host: `host`, which
    then holds it for us until released)."""
    digest = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    start = digest % SEALED_UID_COUNT
    for i in range(SEALED_UID_COUNT):
        uid = SEALED_UID_BASE + (start + i) % SEALED_UID_COUNT
        if uid not in taken and (host is None or host.take(uid)):
            return uid
    raise RuntimeError("every sealed uid is taken")


# Where every supervisor on the host takes its sessions' uids: root's
# (only root supervisors run sessions as uids of their own), in /run, so
# no other user can make it first and hold every uid.
HOST_UIDS_FILE = Path("/run/hermes-sup-sealed-uids.lock")


class HostUids:
    """The sealed uids this supervisor's live sessions hold, host-wide: one
    POSIX byte-range lock per uid (byte uid - SEALED_UID_BASE) on a file all
    supervisors share. Two supervisors on one host never hand out the same
    uid (a session of one would read the other's 0600 files and share its
    RLIMIT_NPROC), and a supervisor's locks go with it however it dies."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    @classmethod
    def open(cls, path: Path = HOST_UIDS_FILE) -> HostUids:
        """Open (or make) the shared file; OSError if it is not root's own."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        st = os.fstat(fd)
        if st.st_uid != 0 or not stat.S_ISREG(st.st_mode) or st.st_mode & 0o022:
            os.close(fd)
            raise OSError(errno.EPERM, f"{path} is not a file root alone may write")
        return cls(fd)

    def take(self, uid: int) -> bool:
        """Hold `uid` for us; False if another supervisor holds it."""
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, uid - SEALED_UID_BASE)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise
        return True

    def release(self, uid: int) -> None:
        """Let another supervisor have `uid`."""
        fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, uid - SEALED_UID_BASE)

    def close(self) -> None:
        os.close(self._fd)


# ------------------------------------------------------------------ detection


def detect(settings: Settings, environ: dict[str, str]) -> Sealing:
    """Whether sessions can be sealed here. Call before any thread or zmq
    context exists (it forks). Raises SealingUnavailable for sealed = on."""
    asked = settings.sealed
    fault = environ.get(FAULT_ENV) or None
    if asked == "off":
        unsealed = Sealing(asked=asked)
        log.warning(kv("unsealed", warning=unsealed.warning()))
        return unsealed
    mode = steps.mode_for_this_process()
    network, network_reason = settings.network, ""
    try:
        if mode == "root":
            _check_reachable(settings)
        try:
            done = _probe_in_child(mode, settings.state_dir, fault, network)
        except SealError as exc:
            if network == "host":
                raise
            # Sealed all the same, with the host's network, if the network
            # namespace was what failed (and the operator let us: auto).
            done = _probe_in_child(mode, settings.state_dir, fault, "host")
            network_reason = f"no network namespace here: {exc}"
            if asked == "on":
                raise SealingUnavailable(
                    f"sealed = on, but sessions cannot have a network of their own here: "
                    f'{network_reason}; set network = "host" to run with the host\'s'
                ) from None
            network = "host"
    except SealError as exc:
        why = explain(mode, exc)
        if asked == "on":
            raise SealingUnavailable(
                f"sealed = on, but sessions cannot be sealed here: {why}"
            ) from None
        log.warning(kv("sealed_unavailable", reason=why, running="unsealed"))
        return Sealing(asked=asked, reason=why)
    sealing = Sealing(
        mode=mode,
        asked=asked,
        signals_scoped=bool(done.get("signals_scoped")),
        syscall_filter=syscalls.seccomp_supported(),
        network=network,
        network_reason=network_reason,
        fault=fault,
    )
    log.info(
        kv(
            "sealed",
            mode=mode,
            signals_scoped=sealing.signals_scoped,
            syscall_filter=sealing.syscall_filter,
            network=network,
        )
    )
    if sealing.network_warning():
        log.warning(kv("sessions_share_host_network", warning=sealing.network_warning()))
    if mode == "root":
        _warn_of_accounts_in_range()
    return sealing


def _warn_of_accounts_in_range() -> None:
    """A session's uid must be nobody else's: say so if an account has one."""
    import pwd

    end = SEALED_UID_BASE + SEALED_UID_COUNT
    for entry in pwd.getpwall():
        if SEALED_UID_BASE <= entry.pw_uid < end:
            log.warning(
                kv(
                    "sealed_uid_in_use",
                    account=entry.pw_name,
                    uid=entry.pw_uid,
                    range=f"{SEALED_UID_BASE}-{end - 1}",
                    hint="a session may run as this account's uid; move the account",
                )
            )


def _check_reachable(settings: Settings) -> None:
    """As root, sessions run as their own uid and must pass through the
    directories above the data and state dirs (inside a worker's view the
    two themselves are its own read-only tmpfs)."""
    for top in (settings.data_dir, settings.state_dir):
        for parent in top.absolute().parents:
            if parent in (Path("/tmp"), Path("/var/tmp")) or Path("/tmp") in parent.parents:
                continue  # under the session's own /tmp in its view
            try:
                mode = parent.stat().st_mode
            except OSError:
                continue
            if not mode & stat.S_IXOTH:
                raise SealError(
                    "hide",
                    f"{parent} (above {top}) is not searchable by other users (mode "
                    f"{stat.S_IMODE(mode):04o}), and sealed sessions run as uids of their own; "
                    f"chmod o+x {parent}, or choose a data and state dir elsewhere",
                )


def _probe_in_child(
    mode: str, scratch: Path, fault: str | None, network: str = "host"
) -> dict[str, Any]:
    """Run steps.probe in a forked child (its namespaces die with it), born
    into the namespaces a worker is (a PID namespace of its own)."""
    r, w = os.pipe()
    ids = (os.getuid(), os.getgid())
    namespaces = steps.namespaces_for(mode) if can_fork_to_parent() else 0
    try:
        pid = fork_with(namespaces) if namespaces else os.fork()
    except OSError as exc:
        os.close(r)
        os.close(w)
        raise SealError(
            "unshare", f"clone({syscalls.clone_flag_names(namespaces)}): {exc.strerror}"
        ) from None
    if pid == 0:
        code = 1
        try:
            steps.born(namespaces, ids)
            os.close(r)
            uid = SEALED_UID_BASE if mode == "root" else None
            done = steps.probe(mode, scratch, uid, uid, fault, network)
            result: dict[str, Any] = {"ok": True, **done}
            code = 0
        except SealError as exc:
            result = {"ok": False, "step": exc.step, "message": exc.message}
        except BaseException as exc:
            result = {"ok": False, "step": "probe", "message": f"{type(exc).__name__}: {exc}"}
            traceback.print_exc()
        finally:
            try:
                os.write(w, json.dumps(result).encode())
            finally:
                os._exit(code)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 65536):
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    try:
        result = json.loads(b"".join(chunks) or b"{}")
    except ValueError:
        result = {}
    if not result.get("ok"):
        raise SealError(
            str(result.get("step", "probe")), str(result.get("message", "the probe child died"))
        )
    return dict(result)


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _has_cap(cap: int) -> bool:
    for line in (_read("/proc/self/status") or "").splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> cap & 1)
    return False


def explain(mode: str, exc: SealError) -> str:
    """The cause of a failed probe, in words an operator can act on."""
    what = f"{exc.step} failed ({exc.message})"
    if mode == "root":
        if not _has_cap(CAP_SYS_ADMIN):
            return (
                f"{what}. The supervisor runs as root without CAP_SYS_ADMIN, as in a container "
                "by default: give it CAP_SYS_ADMIN, CAP_SETUID, CAP_SETGID, CAP_CHOWN and "
                "CAP_SETPCAP (docker run --cap-add SYS_ADMIN --security-opt seccomp=unconfined "
                "--security-opt apparmor=unconfined; Kubernetes securityContext.capabilities.add), "
                "or run it as a non-root user where user namespaces are allowed"
            )
        return f'{what}; see docs/security.md, "What an operator does"'
    if _read("/proc/sys/kernel/apparmor_restrict_unprivileged_userns") == "1":
        return (
            f"{what}. Ubuntu's AppArmor restricts unprivileged user namespaces "
            "(kernel.apparmor_restrict_unprivileged_userns=1): give the service's python an "
            "AppArmor profile that allows userns (docs/security.md), or run the "
            "supervisor as root"
        )
    if _read("/proc/sys/user/max_user_namespaces") == "0":
        return (
            f"{what}. User namespaces are off (user.max_user_namespaces=0): "
            "sysctl -w user.max_user_namespaces=15000, or run the supervisor as root"
        )
    if _read("/proc/sys/kernel/unprivileged_userns_clone") == "0":
        return (
            f"{what}. Unprivileged user namespaces are off "
            "(kernel.unprivileged_userns_clone=0): sysctl -w kernel.unprivileged_userns_clone=1, "
            "or run the supervisor as root"
        )
    return (
        f"{what}. Unprivileged user namespaces seem unavailable (a container's seccomp "
        "profile?); run the supervisor as root, or see docs/security.md"
    )


def open_worker_socket(path: Path) -> None:
    """As root, sealed workers connect as their own uids: the worker socket
    becomes connectable by any uid. Only sealed workers can reach it: in
    the host's view it is inside the state directory (0700, root's), and a
    worker's view of that directory is a tmpfs holding nothing but it. The
    key, the control socket and the lock stay out of every worker's view.
    (Connecting before the drop would work once, but not a reconnect.)"""
    os.chmod(path, 0o666)
