"""hermes-sup's installed version, as every part reports it (ping, status,
health, `--version`), and the `pong` that carries it.

Looked up once per process: the lookup scans the installed packages'
metadata, and the supervisor and the router answer it on every ping.
"""

from __future__ import annotations

import functools
import os
import time
from importlib import metadata
from typing import Any

from hermes_sup.protocol import PROTOCOL_VERSION


@functools.cache
def version() -> str:
    """The installed hermes-sup version ("0+unknown" when not installed)."""
    try:
        return metadata.version("hermes-sup")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def pong_body(started: float) -> dict[str, Any]:
    """What a service's `pong` says (PROTOCOL.md, "ping"): its version, the
    protocol's, its pid and its uptime since `started` (epoch seconds)."""
    return {
        "version": version(),
        "protocol": PROTOCOL_VERSION,
        "pid": os.getpid(),
        "uptime": time.time() - started,
    }
