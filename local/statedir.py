"""The state directory as both sides read it: file names, where it is by
default, the socket endpoints in it, the signing key and the lock check.

The supervisor writes the directory and a local client reads it, so the
names must be one set of names; they live here rather than in the
supervisor so that a client can read them without loading the server.
Making the directory, creating the key and taking the lock are the
service's alone (`hermes_sup.door.privatedir`). Standard library
only: no zmq.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

KEY_FILE = "hmac.key"
LOCK_FILE = "supervisor.lock"
CONTROL_SOCKET = "control.sock"
WORKER_SOCKET = "workers.sock"
# What a supervisor does while it starts, before its control socket is up
# (the sealed Hermes preload: seconds to minutes): `status` reads it.
STARTING_FILE = "starting.json"

# sockaddr_un.sun_path is 108 bytes including the terminating NUL.
MAX_IPC_PATH = 107

STATE_DIR_ENV = "HERMES_SUP_STATE_DIR"
DATA_DIR_ENV = "HERMES_SUP_DATA_DIR"
SYSTEM_STATE_DIR = Path("/run/hermes-sup")
SYSTEM_DATA_DIR = Path("/var/lib/hermes-sup")


class StateDirError(Exception):
    """The state directory cannot be used; the message says why and what to do."""


def default_state_dir(environ: os._Environ[str] | dict[str, str] = os.environ) -> Path:
    """Sockets, key and lock: $HERMES_SUP_STATE_DIR, else /run/hermes-sup for
    root (a system service), else $XDG_RUNTIME_DIR/hermes-sup, else
    ~/.local/state/hermes-sup."""
    if environ.get(STATE_DIR_ENV):
        return Path(environ[STATE_DIR_ENV])
    if os.geteuid() == 0:
        return SYSTEM_STATE_DIR
    if environ.get("XDG_RUNTIME_DIR"):
        return Path(environ["XDG_RUNTIME_DIR"]) / "hermes-sup"
    return Path.home() / ".local" / "state" / "hermes-sup"


def default_data_dir(environ: os._Environ[str] | dict[str, str] = os.environ) -> Path:
    """Session workspaces, homes and logs: $HERMES_SUP_DATA_DIR, else
    /var/lib/hermes-sup for root, else $XDG_DATA_HOME/hermes-sup, else
    ~/.local/share/hermes-sup."""
    if environ.get(DATA_DIR_ENV):
        return Path(environ[DATA_DIR_ENV])
    if os.geteuid() == 0:
        return SYSTEM_DATA_DIR
    if environ.get("XDG_DATA_HOME"):
        return Path(environ["XDG_DATA_HOME"]) / "hermes-sup"
    return Path.home() / ".local" / "share" / "hermes-sup"


def endpoint(state_dir: Path, name: str) -> str:
    """The ipc:// endpoint of a socket in the state directory, checked for length."""
    path = str(state_dir.absolute() / name)
    if len(path.encode()) > MAX_IPC_PATH:
        raise StateDirError(
            f"socket path {path} is {len(path.encode())} bytes, over the {MAX_IPC_PATH}-byte "
            "limit of unix sockets; choose a shorter --state-dir"
        )
    return f"ipc://{path}"


def read_key(state_dir: Path) -> bytes:
    """Read the signing key that clients and the supervisor share."""
    path = state_dir / KEY_FILE
    text = path.read_text().strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise StateDirError(
            f"{path} does not hold a hex key; delete it to make a new one"
        ) from None
    if len(key) < 16:
        raise StateDirError(
            f"{path} holds a key shorter than 16 bytes; delete it to make a new one"
        )
    return key


def is_locked(state_dir: Path) -> bool:
    """True if a live supervisor holds the lock on `state_dir`."""
    path = state_dir / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    # A shared lock is refused only while the supervisor holds its exclusive
    # one; the kernel drops that when the supervisor dies, however it dies.
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def write_starting(state_dir: Path, report: dict[str, object]) -> None:
    """Say how far the start is (STARTING_FILE, 0600, replaced whole)."""
    path = state_dir / STARTING_FILE
    tmp = path.with_name(f".{STARTING_FILE}.{os.getpid()}")
    try:
        tmp.unlink()  # one left by a start that died: made anew, never followed
    except FileNotFoundError:
        pass
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(report, f)
    os.replace(tmp, path)


def clear_starting(state_dir: Path) -> None:
    """The start is over (ready, or failed)."""
    try:
        (state_dir / STARTING_FILE).unlink()
    except FileNotFoundError:
        pass


def starting_line(report: dict[str, object]) -> str:
    """A starting supervisor's report as one line: who, doing what, how long."""
    seconds = report.get("seconds")
    so_far = f", {seconds:.0f}s so far" if isinstance(seconds, int | float) else ""
    return f"the supervisor (pid {report.get('pid')}) is starting: {report.get('stage')}{so_far}"


def read_starting(state_dir: Path) -> dict[str, object] | None:
    """How far the start of the supervisor on `state_dir` is, if one is
    starting: it holds the lock and has said so. None otherwise (a file
    left by one that died is not believed: the lock went with it)."""
    try:
        with open(state_dir / STARTING_FILE, encoding="utf-8") as f:
            report = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(report, dict) or not is_locked(state_dir):
        return None
    return report
