"""Bearer keys of the HTTP endpoint, kept like the CURVE client keys.

Each front end gets a name and a random key, shown once when it is made.
Only the key's SHA-256 is stored, one file per front end, in
`<data-dir>/http/keys/<name>.key` (directories 0700, files 0600), so a copy
of the data directory does not hand out working keys. A presented key is
hashed and compared with every stored hash in constant time.

The directory is re-read whenever it changes (its mtime), so `hermes-sup
keys http generate/revoke` take effect for the next request, without a
restart, as the CURVE allowlist does for the next handshake.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from pathlib import Path

HTTP_DIR = "http"
KEYS_DIR = "keys"
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
KEY_PREFIX = "hsk-"  # lets an operator (and secret scanners) recognise one
HASH_RE = re.compile(r"[0-9a-f]{64}")


class KeyFileError(Exception):
    """A key name or key file that cannot be used; the message says why."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def _private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


class KeyStore:
    """The bearer keys allowed to use the endpoint (one data directory's)."""

    def __init__(self, data_dir: Path) -> None:
        self.dir = Path(data_dir) / HTTP_DIR / KEYS_DIR
        self._seen: tuple[int, int] | None = None  # (mtime_ns, inode) of the last read
        self._hashes: dict[str, bytes] = {}

    # ------------------------------------------------------------ managing

    def generate(self, name: str) -> str:
        """Allow a new front end `name`; returns its key (stored only hashed)."""
        path = self._path(name)
        self.dir.parent.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # the data dir
        _private_dir(self.dir.parent)
        _private_dir(self.dir)
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise KeyFileError(
                f"an HTTP key named {name!r} already exists; revoke it first"
            ) from None
        with os.fdopen(fd, "w") as f:
            f.write(f"# hermes-sup HTTP key {name}: sha256 of the key\n{_digest(key).hex()}\n")
        return key

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

    # ------------------------------------------------------------ checking

    def check(self, presented: str) -> str | None:
        """The name whose key this is, or None. Every stored hash is compared
        (in constant time), so the time taken does not tell which was close."""
        digest = _digest(presented)
        found = None
        for name, stored in self._load().items():
            if hmac.compare_digest(digest, stored):
                found = name
        return found

    def _load(self) -> dict[str, bytes]:
        try:
            st = self.dir.stat()
        except FileNotFoundError:
            self._seen, self._hashes = None, {}
            return self._hashes
        seen = (st.st_mtime_ns, st.st_ino)
        if seen != self._seen:
            self._hashes = self._read()
            self._seen = seen
        return self._hashes

    def _read(self) -> dict[str, bytes]:
        hashes = {}
        for path in sorted(self.dir.glob("*.key")):
            try:
                lines = [ln.strip() for ln in path.read_text().splitlines()]
            except OSError:
                continue
            for line in lines:
                if HASH_RE.fullmatch(line):
                    hashes[path.stem] = bytes.fromhex(line)
                    break
        return hashes

    def _path(self, name: str) -> Path:
        if not NAME_RE.fullmatch(name):
            raise KeyFileError(
                f"key name {name!r}: use 1-64 letters, digits and . _ @ - (a letter or digit first)"
            )
        return self.dir / f"{name}.key"
