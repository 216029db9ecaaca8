"""Where a client connects and how it proves who it is.

Local front ends use the supervisor's state directory: the ipc control
socket and the HMAC key beside it. Remote front ends use a connection file
made by `hermes-sup keys generate`: a TCP endpoint, the HMAC key, the
supervisor's CURVE public key and the client's own CURVE key pair.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hermes_sup.local import statedir

from .errors import AccessDenied, NotRunning, Starting


@dataclass(frozen=True)
class Curve:
    """CURVE keys of a remote connection, Z85 text (40 characters each)."""

    server_public: str
    public: str
    secret: str


@dataclass(frozen=True)
class Connection:
    """An endpoint, the HMAC key to sign with, and CURVE keys for TCP."""

    endpoint: str
    key: bytes
    curve: Curve | None = None
    state_dir: Path | None = None  # local: lets the client tell "gone" from "slow"

    @classmethod
    def local(cls, state_dir: Path | str | None = None) -> Connection:
        """The supervisor serving `state_dir` (default: this user's)."""
        path = Path(state_dir) if state_dir is not None else statedir.default_state_dir()
        sock_path = path / statedir.CONTROL_SOCKET
        try:
            sock_path.stat()
        except PermissionError:
            raise AccessDenied(
                f"permission denied on {path}: it is private to the user the supervisor "
                "runs as; run this as that user"
            ) from None
        except FileNotFoundError:
            pass
        if not sock_path.exists() or not statedir.is_locked(path):
            starting = statedir.read_starting(path)
            if starting is not None:  # its lock is held and it says how far it is
                raise Starting(statedir.starting_line(starting), starting)
            raise NotRunning(f"no hermes-sup supervisor is running on {path}")
        try:
            key = statedir.read_key(path)
        except (OSError, statedir.StateDirError) as exc:
            raise NotRunning(f"cannot read the supervisor's key: {exc}") from None
        return cls(statedir.endpoint(path, statedir.CONTROL_SOCKET), key, state_dir=path)

    @classmethod
    def from_file(cls, path: Path | str) -> Connection:
        """A connection file written by `hermes-sup keys generate`."""
        path = Path(path)
        try:
            mode = path.stat().st_mode
        except OSError as exc:
            raise AccessDenied(f"{path}: cannot read the connection file: {exc}") from None
        if mode & 0o077:
            # It holds a secret key and the signing key: like ssh with a key file.
            raise AccessDenied(
                f"{path} is readable by others (mode {mode & 0o777:o}); chmod 600 it"
            )
        try:
            raw: dict[str, Any] = json.loads(path.read_text())
            curve = raw.get("curve")
            return cls(
                endpoint=str(raw["endpoint"]),
                key=bytes.fromhex(raw["hmac_key"]),
                curve=Curve(
                    server_public=curve["server_public"],
                    public=curve["public"],
                    secret=curve["secret"],
                )
                if curve
                else None,
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise AccessDenied(f"{path}: not a usable connection file: {exc}") from None

    def alive(self) -> bool | None:
        """Whether the supervisor still holds its lock (None: cannot tell, remote)."""
        if self.state_dir is None:
            return None
        return statedir.is_locked(self.state_dir)

    def refreshed(self) -> Connection:
        """The same connection with the key re-read (a restarted supervisor may
        have made a new one)."""
        if self.state_dir is None:
            return self
        return Connection.local(self.state_dir)


def write_connection_file(
    path: Path, endpoint: str, key: bytes, server_public: str, public: str, secret: str
) -> None:
    """Write a connection file, private to its owner (it holds secrets)."""
    data = {
        "endpoint": endpoint,
        "hmac_key": key.hex(),
        "curve": {"server_public": server_public, "public": public, "secret": secret},
    }
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def session_options(
    *,
    workspace: str | Path | None = None,
    session_env: dict[str, str] | None = None,
    env: dict[str, str] | None = None,
    runtime: str | None = None,
    agent: dict[str, Any] | None = None,
) -> dict[str, Any] | None:
    """The `options` map of an open/send request (None when empty)."""
    options: dict[str, Any] = {}
    if workspace is not None:
        options["workspace"] = str(workspace)
    if session_env:
        options["session_env"] = dict(session_env)
    if env:
        options["env"] = dict(env)
    if runtime is not None:
        options["runtime"] = runtime
    if agent:
        options["agent"] = dict(agent)
    return options or None
