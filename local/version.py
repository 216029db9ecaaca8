"""hermes-sup's installed version, as every part reports it (ping, status,
health, `--version`).

Looked up once per process: the lookup scans the installed packages'
metadata, and the supervisor and the router answer it on every ping.
"""

from __future__ import annotations

import functools
from importlib import metadata


@functools.cache
def version() -> str:
    """The installed hermes-sup version ("0+unknown" when not installed)."""
    try:
        return metadata.version("hermes-sup")
    except metadata.PackageNotFoundError:
        return "0+unknown"
