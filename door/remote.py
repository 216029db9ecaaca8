"""Front ends on other hosts: a TCP endpoint with CURVE encryption and an
allowlist of client keys.

Everything lives in `<data-dir>/curve/` (0700), which survives restarts and
reboots (the state directory may not):

    server.key, server.key_secret   the service's CURVE key pair
    hmac.key                        the signing key of remote clients; it is
                                    not the local key, so a connection file
                                    never grants the local control socket
    clients/<name>.key              allowed client public keys, one per file;
                                    a name `router` or `router-*` is a
                                    router's, whose key may also drain

The allowlist is read at every handshake: `hermes-sup keys generate/revoke`
take effect for the next connection, without a restart.

Refusals and failed handshakes are logged through throttles (throttle.py):
any peer on the network can cause them, as fast as it likes.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import zmq
import zmq.auth

# The handshake events a client watches too; the supervisor's monitor asks
# for them here as remote.HANDSHAKE_FAILURES.
from hermes_sup.local.addresses import parse_listen
from hermes_sup.local.frames import HANDSHAKE_FAILURES as HANDSHAKE_FAILURES

from . import privatedir
from .throttle import Throttle

log = logging.getLogger("hermes_sup.door")
REFUSED = Throttle(log, "remote_client_refused")
HANDSHAKE_FAILED = Throttle(log, "remote_handshake_failed")

CURVE_DIR = "curve"
CLIENTS_DIR = "clients"
SERVER_NAME = "server"
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
ZAP_DOMAIN = "hermes-sup"
# Client names of routers (is_router): their keys may drain the node.
ROUTER_NAME = "router"


class RemoteError(Exception):
    """A TCP setting or key file that cannot be used."""


def parse_tcp(spec: str) -> tuple[str, int]:
    """'PORT' (loopback only) or 'HOST:PORT' (see local/addresses.py)."""
    try:
        return parse_listen(spec, "tcp")
    except ValueError as exc:
        raise RemoteError(str(exc)) from None


def tcp_endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def curve_dir(data_dir: Path) -> Path:
    path = privatedir.ensure_private_dir(data_dir / CURVE_DIR)
    privatedir.ensure_private_dir(path / CLIENTS_DIR)
    return path


def server_keys(data_dir: Path) -> tuple[bytes, bytes]:
    """The service's (public, secret) CURVE keys, made on first use."""
    base = curve_dir(data_dir)
    secret_file = base / f"{SERVER_NAME}.key_secret"
    if not secret_file.exists():
        old = os.umask(0o077)
        try:
            zmq.auth.create_certificates(str(base), SERVER_NAME)
        finally:
            os.umask(old)
    public, secret = zmq.auth.load_certificate(str(secret_file))
    if secret is None:
        raise RemoteError(f"{secret_file}: holds no secret key")
    return public, secret


def remote_hmac_key(data_dir: Path) -> bytes:
    """The key remote clients sign with, made on first use."""
    return privatedir.load_or_create_key(curve_dir(data_dir))


def check_name(name: str) -> str:
    if not NAME_RE.fullmatch(name):
        raise RemoteError(
            f"client name {name!r}: use 1-64 letters, digits and . _ @ - (a letter or digit first)"
        )
    return name


def allow(data_dir: Path, name: str, public: bytes) -> Path:
    """Add a client's public key to the allowlist under `name`."""
    check_name(name)  # before anything is made
    path = curve_dir(data_dir) / CLIENTS_DIR / f"{name}.key"
    if path.exists():
        raise RemoteError(f"a client named {name!r} is already allowed; revoke it first")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(
            f'# hermes-sup client {name}\nmetadata\ncurve\n    public-key = "{public.decode()}"\n'
        )
    return path


def revoke(data_dir: Path, name: str) -> bool:
    """Remove a client from the allowlist; False if it was not there."""
    check_name(name)  # before anything is made
    try:
        (curve_dir(data_dir) / CLIENTS_DIR / f"{name}.key").unlink()
        return True
    except FileNotFoundError:
        return False


def allowed(data_dir: Path) -> dict[str, bytes]:
    """Allowed clients: name -> Z85 public key."""
    out = {}
    for path in sorted((data_dir / CURVE_DIR / CLIENTS_DIR).glob("*.key")):
        try:
            public, _ = zmq.auth.load_certificate(str(path))
        except (OSError, ValueError) as exc:
            log.warning("unreadable client key %s: %s", path, exc)
            continue
        out[path.stem] = public
    return out


def name_of(data_dir: Path, public: bytes) -> str | None:
    """The name an allowed client key (Z85) is enrolled under, or None."""
    return next((name for name, key in allowed(data_dir).items() if key == public), None)


def is_router(name: str | None) -> bool:
    """Whether a client name is a router's: `router`, or `router-<anything>`
    (as `hermes-sup ray up` enrolls `router-<node>`). A router's key may
    also drain the node (`drain` through `hermes-sup route`); no other
    remote front end may."""
    return name is not None and (name == ROUTER_NAME or name.startswith(ROUTER_NAME + "-"))


class Allowlist:
    """The ZAP callback: a client key is allowed if a file in clients/ holds it."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir

    def callback(self, domain: str, key: bytes) -> bool:
        names = [name for name, public in allowed(self.data_dir).items() if public == key]
        if names:
            log.info("remote_client_allowed name=%s", names[0])
            return True
        REFUSED.warning(
            f"remote_client_refused key={key.decode()} reason=not in the allowlist "
            f"({self.data_dir / CURVE_DIR / CLIENTS_DIR})"
        )
        return False


def log_handshake_failure(frames: list[bytes]) -> None:
    """Log one handshake failure reported by the TCP socket's monitor."""
    from zmq.utils.monitor import parse_monitor_message

    event = parse_monitor_message(frames)
    if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return  # the allowlist already said why
    HANDSHAKE_FAILED.warning(
        f"remote_handshake_failed peer={event['endpoint'].decode(errors='replace')} "
        "reason=not CURVE, or the wrong server key (a client needs a connection file "
        "from `hermes-sup keys generate`)"
    )
