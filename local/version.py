"""hermes-sup's installed version, as every part reports it (ping, status,
health, `--version`), and the `pong` that carries it.

Looked up once per process: the lookup scans the installed packages'
metadata, and the supervisor and the router answer it on every ping.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from typing import Any


@functools.cache
def version() -> str:
    """The installed hermes-sup version ("0+unknown" when not installed)."""
    found = _version_from_dist_info()
    if found:
        return found
    # importlib.metadata, which reads any kind of install, costs more than
    # the whole of `hermes-sup --version` else: only when the above fails.
    from importlib import metadata

    try:
        return metadata.version("hermes-sup")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def dist_info() -> str | None:
    """The first hermes_sup-*.dist-info directory on sys.path, the one
    importlib.metadata would read (a wheel's install and an editable one
    both leave it there), or None."""
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            if name.startswith("hermes_sup-") and name.endswith(".dist-info"):
                return os.path.join(entry or ".", name)
    return None


def _version_from_dist_info() -> str | None:
    """The Version line of dist_info()'s METADATA, or None."""
    found = dist_info()
    if found is None:
        return None
    try:
        with open(os.path.join(found, "METADATA"), encoding="utf-8") as f:
            for line in f:
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
                if not line.strip():  # the headers end at the first blank line
                    break
    except OSError:
        pass
    return None


def install_hint(extra: str) -> str:
    """The command that adds the optional dependencies `extra` (http,
    metrics, hermes, ray) to this install, from what it was installed from:
    hermes-sup is installed from a clone or a wheel (pip records which, PEP
    610's direct_url.json), not from a package index."""
    import json
    import shlex
    from urllib.parse import unquote, urlparse

    pip = f"{shlex.quote(sys.executable)} -m pip install"
    source, editable = None, False
    found = dist_info()
    try:
        if found is not None:
            with open(os.path.join(found, "direct_url.json"), encoding="utf-8") as f:
                recorded = json.load(f)
            url = urlparse(recorded.get("url", ""))
            if url.scheme == "file":
                source = unquote(url.path)
                editable = bool((recorded.get("dir_info") or {}).get("editable"))
    except (OSError, ValueError, AttributeError):
        pass
    if source is None:
        return (
            f"{pip} '/path/to/hermes-sup[{extra}]' (a clone), or "
            f"'/path/to/hermes_sup-*.whl[{extra}]' (a wheel)"
        )
    if editable:
        return (
            f"{pip} -e {shlex.quote(f'{source}[{extra}]')} --config-settings editable_mode=strict"
        )
    return f"{pip} {shlex.quote(f'{source}[{extra}]')}"


def pong_body(started: float) -> dict[str, Any]:
    """What a service's `pong` says (PROTOCOL.md, "ping"): its version, the
    protocol's, its pid and its uptime since `started` (epoch seconds)."""
    from hermes_sup.protocol import PROTOCOL_VERSION

    return {
        "version": version(),
        "protocol": PROTOCOL_VERSION,
        "pid": os.getpid(),
        "uptime": time.time() - started,
    }
