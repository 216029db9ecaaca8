"""A service's private directories as only the service touches them:
making one private, creating a signing key in it, and holding the state
directory's single-instance lock. The supervisor and the router each do
this to their own state directory, and to the CURVE keys' directory.

What clients read too (file names, endpoints, reading the key, the lock
check) is `hermes_sup.local.statedir`, the one module named for the state
directory.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import stat
from pathlib import Path

from hermes_sup.local.statedir import KEY_FILE, LOCK_FILE, StateDirError, read_key


def ensure_private_dir(path: Path) -> Path:
    """Create `path` 0700 (with parents) or check an existing one is ours and private."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.geteuid():
        raise StateDirError(
            f"{path} is owned by uid {st.st_uid}, not by this user ({os.geteuid()})"
        )
    if stat.S_IMODE(st.st_mode) & 0o077:
        # Tighten rather than refuse: an operator-created directory is common.
        os.chmod(path, 0o700)
    return path


def load_or_create_key(state_dir: Path) -> bytes:
    """Read the signing key, generating it (0600) on first start."""
    path = state_dir / KEY_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return read_key(state_dir)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return read_key(state_dir)


class InstanceLock:
    """An flock on the state directory's lock file. The kernel drops it when the
    holder dies, so a stale lock from a killed supervisor never blocks a start."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise StateDirError naming the running holder."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise
            holder = self.path.read_text().strip() or "unknown"
            raise StateDirError(
                f"another hermes-sup supervisor (pid {holder}) is already running on "
                f"{self.path.parent}; stop it first or choose another --state-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        """Drop the lock (closing the descriptor releases the flock)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
