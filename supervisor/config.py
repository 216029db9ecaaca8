"""Supervisor settings, and (re-exported) where state and data live by default."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Where state and data live by default is the client's business too (it
# finds the supervisor by it): hermes_sup.local holds it, re-exported here.
from hermes_sup.local.statedir import (
    DATA_DIR_ENV,
    STATE_DIR_ENV,
    SYSTEM_DATA_DIR,
    SYSTEM_STATE_DIR,
    default_data_dir,
    default_state_dir,
)
from hermes_sup.protocol import DEFAULT_MAX_FRAME_SIZE

__all__ = [
    "DATA_DIR_ENV",
    "DEFAULT_PASS_ENV",
    "STATE_DIR_ENV",
    "SYSTEM_DATA_DIR",
    "SYSTEM_STATE_DIR",
    "Settings",
    "default_data_dir",
    "default_spare_workers",
    "default_state_dir",
]

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


# A burst of new sessions beyond the spares waits for forks anyway; more
# spares than this only hold memory and fds.
MAX_DEFAULT_SPARES = 8


def default_spare_workers() -> int:
    """Spare workers by default: one per CPU this process may run on (its
    affinity, which a container or cgroup cpuset narrows, not the host's
    count), between 1 and MAX_DEFAULT_SPARES. Each spare is a forked, idle
    worker (a few MiB, a handful of fds); with them a new session's first
    reply comes about twice as fast (BENCHMARKS.md), and as many can be
    refilled at once as there are CPUs to run their starts."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, MAX_DEFAULT_SPARES))


@dataclass
class Settings:
    """Everything `hermes-sup serve` can be told."""

    state_dir: Path
    data_dir: Path
    runtime: str = "probe"
    # Settings handed to the runtime (e.g. hermes: model, base_url, provider,
    # toolsets, template_home, api_key resolved from api_key_env/api_key_file).
    runtime_config: dict[str, Any] = field(default_factory=dict)
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
    # Turns one session may have waiting, and all sessions together; over
    # either, a `busy` error: nothing is dropped silently.
    max_queue: int = 256
    max_queued_total: int = 10_000
    # Workers heartbeat from their main loop (never from the turn thread), so
    # a long turn is busy, not hung. Silent this long: SIGABRT (a traceback
    # lands in the session log), then SIGKILL after abort_grace.
    heartbeat_interval: float = 2.0
    heartbeat_timeout: float = 10.0
    # An idle worker beats this often instead, and is hung only after
    # IDLE_BEATS_PER_TIMEOUT of them are missed: a thousand idle sessions
    # beating every 2 s kept a 2-core machine a fifth busy.
    idle_heartbeat_interval: float = 15.0
    abort_grace: float = 2.0
    # A turn running longer is cancelled and reported (None: no limit, the
    # default for agents); a runtime that ignores the cancel is killed.
    turn_timeout: float | None = None
    cancel_grace: float = 5.0
    # A worker that dies sooner than min_uptime after its spawn is a fast
    # failure: back off backoff_base * 2^(n-1) seconds (at most backoff_cap);
    # after max_fast_failures in a row the session is failed until killed or
    # until failed_cooldown passes.
    min_uptime: float = 2.0
    backoff_base: float = 0.5
    backoff_cap: float = 30.0
    max_fast_failures: int = 5
    failed_cooldown: float = 300.0
    # Per-session limits. Memory is the PSS of the worker and all its
    # descendants (a page they share counts once; see limits.py), sampled
    # every limits_interval; over it the session is
    # recycled. max_procs counts the worker's descendants the same way.
    # max_open_files and cpu_seconds are rlimits set in the worker.
    memory_limit_mb: int | None = 2048
    # Sealed, max_procs is also the session's RLIMIT_NPROC (its processes
    # and threads, the worker's included), which the kernel enforces.
    max_procs: int | None = 256
    max_open_files: int | None = 1024
    cpu_seconds: int | None = None
    # The largest file a session may write (RLIMIT_FSIZE: a write past it
    # fails with "File too large"), and, sealed, the size of the tmpfs that
    # is its /tmp, /var/tmp and /dev/shm (None: its tmp/ on disk, unbounded).
    file_size_limit_mb: int | None = 4096
    tmp_limit_mb: int | None = 256
    limits_interval: float = 2.0
    # Live workers at most (None: derived from the open-file limit). When
    # full, the least recently used idle session is stopped to make room.
    max_sessions: int | None = None
    # Client connections at once, local and TCP together (None: what the
    # open-file limit leaves after sessions; with tcp, half each). One over
    # it is refused with `overloaded` (see door/gate.py).
    max_clients: int | None = None
    # Workers forked ahead of need, connected and waiting: a new session
    # takes one instead of waiting for a fork (see supervisor/spare_workers.py).
    # By default one per CPU this process may run on, at most
    # MAX_DEFAULT_SPARES; 0 is none.
    spare_workers: int = field(default_factory=default_spare_workers)
    # Stop sessions idle this long (None: never). Busy sessions never are.
    idle_timeout: float | None = None
    # Session logs rotate at this size, keeping this many old files.
    log_max_bytes: int = 10 * 1024 * 1024
    log_backups: int = 3
    # A session's log takes at most log_rate_limit bytes a second (None:
    # no limit) after a burst of log_rate_burst; over it, its output pipe is
    # read only as fast as the rate allows (see supervisor/logs.py).
    log_rate_limit: int | None = 1024 * 1024
    log_rate_burst: int = 4 * 1024 * 1024
    # Recent turns and events kept per session, replayed to `attach`.
    history: int = 200
    # Messages the supervisor queues for one client connection. A client
    # that does not read that many lags: its events are dropped and counted
    # (a `dropped` event tells it how many once it reads again), its answers
    # kept for it (door/fronts.py, "Slow consumers"). 0: no limit
    # (zmq's), so such a client can hold any amount of memory.
    client_queue: int = 10_000
    # A worker merges the stream deltas (`token`, `output`) of a turn made
    # within this many milliseconds into one event, losing nothing; a turn's
    # first delta and every other event go out at once (worker/coalesce.py).
    # Told in the spawn request (`coalesce_ms`). 0 is off.
    stream_coalesce_ms: float = 10.0
    # CURVE-encrypted TCP endpoint for remote front ends, "PORT" (127.0.0.1)
    # or "HOST:PORT" (0.0.0.0 for every interface); "" is off.
    tcp: str = ""
    # Prometheus endpoint, "PORT" (127.0.0.1) or "HOST:PORT"; "" is off.
    metrics: str = ""
    log_level: str = "info"
    # Directories under which a front end may choose a session's workspace
    # (the `workspace` option); none: every session works in its own.
    workspace_roots: tuple[str, ...] = ()
    # Runtimes a front end may choose per session besides `runtime`.
    runtimes: tuple[str, ...] = ()
    # Variables that decide whether the agent asks before a dangerous command
    # (environment.APPROVAL_ENV) that front ends may set all the same.
    allow_env: tuple[str, ...] = ()
    # Sealed sessions (worker/seal.py): each worker in its own mount and PID
    # namespaces, seeing only its own session's files and processes.
    # "auto": sealed where the kernel allows it, else unsealed with a warning
    # at start, in status, list and the HTTP endpoint; "on": refuse to start
    # without it; "off": unsealed, by the operator's choice (a session is
    # then no boundary: its shell can read the supervisor's key).
    sealed: str = "auto"
    # A git repository: each session's workspace is its own `git worktree`
    # of it, on its own branch (supervisor/worktrees.py). "" is off.
    repo: str = ""
    # Directories under which a front end may name a session's repository
    # (the `repo` option); none: only `repo` above.
    repo_roots: tuple[str, ...] = ()
    # This supervisor's name among the nodes of a cluster (`hermes-sup route`,
    # Ray); "" is a single node, named by its host when asked.
    node: str = ""
    # Options a new session gets when its front end passes none (wire form).
    session_defaults: dict[str, Any] = field(default_factory=dict)
    # Where these settings came from, for reload: the file and what the
    # command line set over it.
    config_file: Path | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
