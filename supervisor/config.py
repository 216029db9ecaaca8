"""Supervisor settings and where state and data live by default."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from hermes_sup.protocol import DEFAULT_MAX_FRAME_SIZE

# Variables a worker inherits from the supervisor's environment by default.
# Everything else (API keys, tokens, cloud credentials) stays out of workers
# unless an operator allowlists it with --pass-env. Trailing "*" is a prefix.
DEFAULT_PASS_ENV: tuple[str, ...] = (
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "SHELL",
    "LANG",
    "LANGUAGE",
    "LC_*",
    "TZ",
    "TMPDIR",
    "TERM",
)

STATE_DIR_ENV = "HERMES_SUP_STATE_DIR"
DATA_DIR_ENV = "HERMES_SUP_DATA_DIR"
SYSTEM_STATE_DIR = Path("/run/hermes-sup")
SYSTEM_DATA_DIR = Path("/var/lib/hermes-sup")


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


@dataclass
class Settings:
    """Everything `hermes-sup serve` can be told."""

    state_dir: Path
    data_dir: Path
    runtime: str = "probe"
    # Modules the zygote imports before it forks workers (shared copy-on-write).
    preload: tuple[str, ...] = ()
    pass_env: tuple[str, ...] = DEFAULT_PASS_ENV
    # Fixed variables given to every worker (after the allowlisted base).
    env: dict[str, str] = field(default_factory=dict)
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    # Graceful kill: ask the worker to stop, then SIGTERM its group, then SIGKILL.
    stop_timeout: float = 5.0
    term_timeout: float = 2.0
    # How long a new worker may take to say hello before it counts as failed.
    start_timeout: float = 30.0
    # Shutdown: how long running turns may finish before workers are stopped.
    shutdown_grace: float = 10.0
    # Turns one session may have waiting; over it, a `busy` error, nothing dropped.
    max_queue: int = 256
    log_level: str = "info"
