"""Bearer keys of the HTTP endpoint, kept like the CURVE client keys; each
key is a tenant.

Each front end gets a name and a random key, shown once when it is made.
Only the key's SHA-256 is stored, one file per front end, in
`<data-dir>/http/keys/<name>.key` (directories 0700, files 0600), so a copy
of the data directory does not hand out working keys. A presented key is
hashed and compared with every stored hash in constant time.

What a key may reach is stored with it (`Tenant`). Every key has a
namespace: a random id made with the key, so that the session keys its
clients' ids become, `NAME+ID+<id>`, are its own (httpapi/sessions.py).
Key names have no `+`, so no other key's ids can land in that namespace,
and a key revoked and made again under the same name gets a new id and
none of the old key's sessions; `rotate` makes a new key that keeps the id
(the sessions), which is how an operator hands them on. A key may also be
granted sessions outside every key's namespace by key pattern (`telegram:*`,
or an exact key), or everything, every key's sessions, runs and responses
included (admin).

    # hermes-sup HTTP key webui: its sha256, namespace and grants
    3b1f...e9                      (64 hex digits)
    namespace 5f0c2a9d7e41
    grant telegram:*
    admin

A file from before namespaces holds the hash alone; its namespace is then
derived from the stored hash, so it stays the same for as long as the key.

The directory is re-read whenever it changes (its mtime; a file changes by
being replaced), so `hermes-sup keys http generate/grant/rotate/revoke`
take effect for the next request, without a restart, as the CURVE allowlist
does for the next handshake.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import re
import secrets
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

HTTP_DIR = "http"
KEYS_DIR = "keys"
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
KEY_PREFIX = "hsk-"  # lets an operator (and secret scanners) recognise one
HASH_RE = re.compile(r"[0-9a-f]{64}")
NAMESPACE_RE = re.compile(r"[0-9a-f]{12}")
# A grant: an exact session key, or a prefix of one followed by `*`.
GRANT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+=-]{0,127}\*?")
# Directory timestamps are coarse (a few ms on ext4): a change made within
# this many seconds of the last read could leave the mtime as it was read,
# so until then the directory is read again each time.
COARSE_MTIME = 2.0


class KeyFileError(Exception):
    """A key name, grant or key file that cannot be used; the message says why."""


@dataclass(frozen=True)
class Tenant:
    """A key's name, its namespace, and what it was granted beyond it."""

    name: str
    namespace: str
    grants: tuple[str, ...] = ()
    admin: bool = False

    @functools.cached_property
    def prefix(self) -> str:
        """The start of every session key of this key's own namespace."""
        return f"{self.name}+{self.namespace}+"

    def granted(self, key: str) -> bool:
        """Whether a session key outside this key's namespace is reachable:
        every one for an admin; else one its grants name, unless it is in
        another key's namespace (a grant is of the sessions of local and
        CURVE clients, never of another key's)."""
        if self.admin:
            return True
        if not self.grants or in_a_namespace(key):
            return False
        return any(
            key.startswith(grant[:-1]) if grant.endswith("*") else key == grant
            for grant in self.grants
        )

    def scope(self) -> str:
        """What this key reaches, in words (`keys http list`)."""
        if self.admin:
            return "everything (admin)"
        if self.grants:
            return "its own sessions, and " + ", ".join(self.grants)
        return "its own sessions"


_NAMESPACED = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}\+[0-9a-f]{12}\+")


def in_a_namespace(key: str) -> bool:
    """Whether a session key is in some HTTP key's namespace."""
    return _NAMESPACED.match(key) is not None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def _legacy_namespace(stored: bytes) -> str:
    return hashlib.sha256(b"hermes-sup http namespace\n" + stored).hexdigest()[:12]


def _private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def check_grants(grants: Iterable[str]) -> tuple[str, ...]:
    """Grants as given, checked: each a session key or a prefix and `*`."""
    checked: list[str] = []
    for grant in grants:
        if not GRANT_RE.fullmatch(grant):
            raise KeyFileError(
                f"grant {grant!r}: give a session key or the start of one followed by * "
                "(telegram:*); --admin grants everything"
            )
        if grant not in checked:
            checked.append(grant)
    return tuple(checked)


class KeyStore:
    """The bearer keys allowed to use the endpoint (one data directory's)."""

    def __init__(self, data_dir: Path) -> None:
        self.dir = Path(data_dir) / HTTP_DIR / KEYS_DIR
        self._seen: tuple[int, int] | None = None  # (mtime_ns, inode) of the last read
        self._read_at = 0.0
        self._keys: dict[str, tuple[bytes, Tenant]] = {}

    # ------------------------------------------------------------ managing

    def generate(self, name: str, grants: Iterable[str] = (), admin: bool = False) -> str:
        """Allow a new front end `name` in a namespace of its own, with what
        it is granted; returns its key (stored only hashed)."""
        path = self._path(name)
        tenant = Tenant(name, secrets.token_hex(6), check_grants(grants), admin)
        self.dir.parent.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # the data dir
        _private_dir(self.dir.parent)
        _private_dir(self.dir)
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise KeyFileError(
                f"an HTTP key named {name!r} already exists; revoke it first "
                "(or `rotate` it for a new key to the same sessions)"
            ) from None
        with os.fdopen(fd, "w") as f:
            f.write(_file_text(_digest(key), tenant))
        return key

    def rotate(self, name: str) -> str:
        """A new key for `name`, in the same namespace with the same grants:
        the old key is refused from the next request on."""
        stored = self.tenant(name)
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        self._replace(name, _file_text(_digest(key), stored))
        return key

    def grant(
        self, name: str, grants: Iterable[str] = (), admin: bool | None = None, reset: bool = False
    ) -> Tenant:
        """Add `grants` (after dropping every grant, with `reset`) and set
        or clear admin; the key and its namespace stay."""
        tenant = self.tenant(name)
        kept = () if reset else tenant.grants
        updated = replace(
            tenant,
            grants=check_grants([*kept, *grants]),
            admin=(False if reset else tenant.admin) if admin is None else admin,
        )
        digest = self._load()[name][0]
        self._replace(name, _file_text(digest, updated))
        return updated

    def revoke(self, name: str) -> bool:
        """Refuse `name`'s key from the next request on; False if there was none."""
        try:
            self._path(name).unlink()
            return True
        except FileNotFoundError:
            return False

    def names(self) -> list[str]:
        """The names of the allowed front ends."""
        return sorted(self._load())

    def tenants(self) -> list[Tenant]:
        """Every allowed front end with what it reaches, by name."""
        keys = self._load()
        return [keys[name][1] for name in sorted(keys)]

    def tenant(self, name: str) -> Tenant:
        """The front end `name`; KeyFileError if there is none."""
        self._path(name)  # the name's own rules first
        found = self._load().get(name)
        if found is None:
            raise KeyFileError(f"no HTTP key named {name!r}")
        return found[1]

    # ------------------------------------------------------------ checking

    def check(self, presented: str) -> Tenant | None:
        """The tenant whose key this is, or None. Every stored hash is
        compared (in constant time), so the time taken does not tell which
        was close."""
        digest = _digest(presented)
        found = None
        for stored, tenant in self._load().values():
            if hmac.compare_digest(digest, stored):
                found = tenant
        return found

    def _load(self) -> dict[str, tuple[bytes, Tenant]]:
        try:
            st = self.dir.stat()
        except FileNotFoundError:
            self._seen, self._keys = None, {}
            return self._keys
        seen = (st.st_mtime_ns, st.st_ino)
        if seen != self._seen or self._read_at - st.st_mtime_ns / 1e9 < COARSE_MTIME:
            self._read_at = time.time()
            self._keys = self._read()
            self._seen = seen
        return self._keys

    def _read(self) -> dict[str, tuple[bytes, Tenant]]:
        keys = {}
        for path in sorted(self.dir.glob("*.key")):
            if not NAME_RE.fullmatch(path.stem):
                continue
            try:
                found = _parse(path.stem, path.read_text())
            except (OSError, UnicodeDecodeError):
                continue
            if found is not None:
                keys[path.stem] = found
        return keys

    def _replace(self, name: str, text: str) -> None:
        """Write `name`'s file anew, atomically: a reader sees the old file
        or the new one, and the directory's mtime tells it to look."""
        fd, temp = tempfile.mkstemp(dir=self.dir, prefix=".new-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(temp, self._path(name))
        except BaseException:
            Path(temp).unlink(missing_ok=True)
            raise

    def _path(self, name: str) -> Path:
        if not NAME_RE.fullmatch(name):
            raise KeyFileError(
                f"key name {name!r}: use 1-64 letters, digits and . _ @ - (a letter or digit first)"
            )
        return self.dir / f"{name}.key"


def _file_text(digest: bytes, tenant: Tenant) -> str:
    lines = [
        f"# hermes-sup HTTP key {tenant.name}: its sha256, namespace and grants",
        digest.hex(),
        f"namespace {tenant.namespace}",
        *(f"grant {grant}" for grant in tenant.grants),
        *(["admin"] if tenant.admin else []),
    ]
    return "\n".join(lines) + "\n"


def _parse(name: str, text: str) -> tuple[bytes, Tenant] | None:
    """A key file's hash and tenant; None without a hash. Lines it does not
    know are skipped, as a bad grant is (it grants nothing)."""
    digest: bytes | None = None
    namespace: str | None = None
    grants: list[str] = []
    admin = False
    for raw in text.splitlines():
        line = raw.strip()
        word, _, rest = line.partition(" ")
        if digest is None and HASH_RE.fullmatch(line):
            digest = bytes.fromhex(line)
        elif word == "namespace" and NAMESPACE_RE.fullmatch(rest.strip()):
            namespace = rest.strip()
        elif word == "grant" and GRANT_RE.fullmatch(rest.strip()):
            grants.append(rest.strip())
        elif line == "admin":
            admin = True
    if digest is None:
        return None
    return digest, Tenant(name, namespace or _legacy_namespace(digest), tuple(grants), admin)
