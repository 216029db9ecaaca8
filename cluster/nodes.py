"""The nodes a router forwards to: what it needs to reach each one, read
from a static TOML file or from the Ray registry. No I/O beyond reading the
file.

A node is reached as a remote front end reaches a supervisor (PROTOCOL.md,
"Remote front ends"): a TCP endpoint, the node's CURVE server key, a client
key pair in the node's allowlist and the node's remote HMAC key. The file
names a connection file (`hermes-sup keys generate`) per node, or gives the
fields inline:

    [[node]]
    name = "a"
    connection = "/etc/hermes-sup/router-a.json"
    capacity = 200

    [[node]]
    name = "b"
    endpoint = "tcp://10.0.0.2:7788"
    server_key = "<Z85>"
    hmac_key = "<64 hex digits>"
    public = "<Z85>"
    secret = "<Z85>"
    capacity = 100
    draining = false
    shared_data = "nfs-sessions"

`shared_data` names the data directory a node serves sessions from when
several nodes share one (NFS, a cluster file system): nodes with the same
name are known to share it, so a turn in flight on one that is lost may be
sent to another, which answers it from the session's turn journal instead
of running it again. Without it, such a turn ends with `node_lost`.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .homes import OWN_DATA

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
Z85_KEY_LENGTH = 40


class NodeConfigError(Exception):
    """A node list that cannot be used; the message names the node and field."""


@dataclass(frozen=True)
class NodeSpec:
    """How to reach one node, and how much it should take."""

    name: str
    endpoint: str
    server_key: str
    hmac_key: bytes
    public: str
    secret: str
    capacity: float = 1.0
    draining: bool = False
    shared_data: str | None = None  # the same for nodes that share one data directory

    @property
    def data(self) -> str:
        """The data directory its sessions' histories are in, as a key's
        home names it (homes.py): the shared one's id, else its own."""
        return self.shared_data if self.shared_data is not None else OWN_DATA + self.name

    def describe(self) -> dict[str, Any]:
        """What `status` shows of it (never a key)."""
        return {
            "endpoint": self.endpoint,
            "capacity": self.capacity,
            "draining": self.draining,
            "shared_data": self.shared_data,
        }


DATA_ID_FILE = ".data-id"


def data_id(data_dir: Path) -> str:
    """The identity of a data directory (made at its first use, random): the
    same for every node that serves sessions from it."""
    path = data_dir / DATA_ID_FILE
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    made = os.urandom(16).hex()
    # Written whole under a name of our own, then linked into place: a node
    # starting beside us never reads the file between its creation and its
    # write (it read "", and refused the registry entry it made of it).
    own = data_dir / f".{DATA_ID_FILE}.{made}"
    fd = os.open(own, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(made + "\n")
    try:
        os.link(own, path)
    except FileExistsError:
        return path.read_text().strip()  # another node made it first
    finally:
        own.unlink()
    return made


def check_name(name: object, where: str) -> str:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise NodeConfigError(
            f"{where}: node name {name!r}: use 1-64 letters, digits and . _ @ - "
            "(a letter or digit first)"
        )
    return name


def spec_from_map(raw: dict[str, Any], where: str, base: Path | None = None) -> NodeSpec:
    """One node from a TOML table or a registry entry."""
    name = check_name(raw.get("name"), where)
    where = f"{where} (node {name})"
    fields = dict(raw)
    conn = fields.pop("connection", None)
    if conn is not None:
        path = Path(str(conn))
        if base is not None and not path.is_absolute():
            path = base / path
        fields.update(read_connection_file(path, where))
    try:
        capacity = fields.get("capacity", 1.0)
        if isinstance(capacity, bool) or not isinstance(capacity, (int, float)) or capacity <= 0:
            raise NodeConfigError(f"{where}: capacity must be a positive number")
        draining = fields.get("draining", False)
        if not isinstance(draining, bool):
            raise NodeConfigError(f"{where}: draining must be true or false")
        shared_data = fields.get("shared_data")
        if shared_data is not None and (not isinstance(shared_data, str) or not shared_data):
            raise NodeConfigError(f"{where}: shared_data must be a non-empty string")
        endpoint = str(fields["endpoint"])
        if not endpoint.startswith("tcp://"):
            raise NodeConfigError(f"{where}: endpoint {endpoint!r} must be tcp://HOST:PORT")
        spec = NodeSpec(
            name=name,
            endpoint=endpoint,
            server_key=str(fields["server_key"]),
            hmac_key=bytes.fromhex(str(fields["hmac_key"])),
            public=str(fields["public"]),
            secret=str(fields["secret"]),
            capacity=float(capacity),
            draining=draining,
            shared_data=shared_data,
        )
    except KeyError as exc:
        raise NodeConfigError(
            f"{where}: missing {exc.args[0]!r} (give `connection` or the fields inline)"
        ) from None
    except ValueError as exc:
        raise NodeConfigError(f"{where}: {exc}") from None
    for field in ("server_key", "public", "secret"):
        if len(getattr(spec, field)) != Z85_KEY_LENGTH:
            raise NodeConfigError(f"{where}: {field} must be a Z85 CURVE key (40 characters)")
    if len(spec.hmac_key) < 16:
        raise NodeConfigError(f"{where}: hmac_key must be at least 16 bytes (hex)")
    return spec


def read_connection_file(path: Path, where: str) -> dict[str, Any]:
    """The fields of a connection file (client/connection.py writes them)."""
    try:
        if path.stat().st_mode & 0o077:
            raise NodeConfigError(
                f"{where}: {path} is readable by others (it holds secrets); chmod 600 it"
            )
        raw = json.loads(path.read_text())
        curve = raw["curve"]
        return {
            "endpoint": raw["endpoint"],
            "hmac_key": raw["hmac_key"],
            "server_key": curve["server_public"],
            "public": curve["public"],
            "secret": curve["secret"],
        }
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise NodeConfigError(f"{where}: {path}: not a usable connection file: {exc}") from None


def load_nodes(path: Path) -> list[NodeSpec]:
    """The nodes of a TOML file, checked; names must be unique."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise NodeConfigError(f"{path}: {exc}") from None
    tables = data.get("node", [])
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise NodeConfigError(f"{path}: nodes are [[node]] tables")
    unknown = set(data) - {"node"}
    if unknown:
        raise NodeConfigError(f"{path}: unknown key(s) {', '.join(sorted(unknown))}")
    specs = [
        spec_from_map(t, f"{path} [[node]] #{i + 1}", path.parent) for i, t in enumerate(tables)
    ]
    names = [s.name for s in specs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise NodeConfigError(f"{path}: node name(s) given twice: {', '.join(dupes)}")
    return specs
