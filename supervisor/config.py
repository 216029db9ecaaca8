"""Supervisor settings: each declared once, and (re-exported) where state and
data live by default.

Every setting of `hermes-sup serve` is a field of `Settings`, the object the
supervisor reads. Its type and default are the field's; everything else
about it (its flag and environment variable, bounds, help, whether a reload
may change it) is a `Setting` in the field's metadata (local/settings.py,
which the other services' tables use too). From that one declaration come:

- the flags of `serve` (cli/serve.py, `setting_options`),
- the checks of the TOML file (configfile.py),
- the configuration reference of the documentation site (`reference_table`,
  put into docs/configuration.md while the site builds).

The fields are grouped by what they are about, a dataclass each, and
`Settings` is all of them: what a session runs and may choose, the
supervisor's clock over its workers, what a session may take of the
machine, what it is sealed from, and how the supervisor faces the world.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Where state and data live by default is the client's business too (it
# finds the supervisor by it): hermes_sup.local holds it, re-exported here.
from hermes_sup.local.addresses import parse_listen
from hermes_sup.local.settings import Setting, declare, either, setting
from hermes_sup.local.settings import reference_table as markdown_table
from hermes_sup.local.statedir import (
    DATA_DIR_ENV,
    STATE_DIR_ENV,
    SYSTEM_DATA_DIR,
    SYSTEM_STATE_DIR,
    default_data_dir,
    default_state_dir,
)
from hermes_sup.protocol import DEFAULT_MAX_FRAME_SIZE

from .egress import check_rules

__all__ = [
    "AGENT_KEYS",
    "DATA_DIR_ENV",
    "DEFAULT_PASS_ENV",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "SEALED_CHOICES",
    "SETTINGS",
    "STATE_DIR_ENV",
    "SYSTEM_DATA_DIR",
    "SYSTEM_STATE_DIR",
    "Setting",
    "Settings",
    "default_data_dir",
    "default_spare_workers",
    "default_state_dir",
    "reference_table",
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
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
SEALED_CHOICES = ("off", "auto", "on")
NETWORK_CHOICES = ("egress", "none", "host")
# The keys of the [agent] table (and of an --agent-config file), with the
# type each must have.
AGENT_KEYS: dict[str, type] = {
    "model": str,
    "base_url": str,
    "provider": str,
    "toolsets": list,
    "max_iterations": int,
    "template_home": str,
    "api_key_env": str,
    "api_key_file": str,
    # The header the supervisor's model endpoint sends the key in:
    # "authorization" (Bearer, the default) or e.g. "x-api-key".
    "api_key_header": str,
}


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


def _tcp_address(value: str) -> str | None:
    """Why `value` cannot be the TCP endpoint (naming it), or None."""
    if value:
        try:
            parse_listen(value, "tcp")
        except ValueError as exc:
            return str(exc)
    return None


def _http_address(value: str) -> str | None:
    """Why `value` cannot be the HTTP endpoint's address (naming it), or None."""
    if value:
        try:
            parse_listen(value, "http", any_port=True)
        except ValueError as exc:
            return str(exc)
    return None


def _budgets_fault(value: dict[str, str]) -> str | None:
    """Why `value` cannot be model_budgets (naming the entry), or None."""
    from .model_meter import parse_budgets

    try:
        parse_budgets(value)
    except ValueError as exc:
        return str(exc)
    return None


@dataclass
class SessionSettings:
    """What a session runs, where its files live, and what its front end may
    choose for it (the `open` options the supervisor allows)."""

    state_dir: Path = field(
        metadata=setting(
            "--state-dir",
            "sockets, key, lock (0700)",
            envvar=STATE_DIR_ENV,
            reload=False,
            path=True,
            shown="per user; `/run/hermes-sup` as root",
        )
    )
    data_dir: Path = field(
        metadata=setting(
            "--data-dir",
            "session workspaces, homes, logs (0700)",
            envvar=DATA_DIR_ENV,
            reload=False,
            path=True,
            shown="per user; `/var/lib/hermes-sup` as root",
        )
    )
    runtime: str = field(
        default="probe",
        metadata=setting(
            "--runtime",
            "agent runtime: `probe`, `hermes`, or `module:factory`",
            aliases=("--agent",),
            reload=False,
        ),
    )
    # Handed to the runtime (the api key resolved from api_key_env or
    # api_key_file, so that the key itself never sits in a config file).
    runtime_config: dict[str, Any] = field(
        default_factory=dict,
        metadata=setting(
            "--agent-config",
            f"runtime settings: {either(AGENT_KEYS)}; `--agent-config` names a TOML or JSON "
            "file of them",
            key="agent",
            metavar="FILE",
            shown="",
        ),
    )
    # Imported by the zygote before it forks workers (shared copy-on-write).
    preload: tuple[str, ...] = field(
        default=(),
        metadata=setting(
            "--preload",
            "modules the zygote imports before forking; a module of hermes-agent itself "
            "(`run_agent`, `tools`, ...) is refused: it captures HERMES_HOME at import, so "
            "every session's logs and state would land in the zygote's home",
            reload=False,
            metavar="MODULE",
            shown="`[]` (hermes: its safe libraries)",
        ),
    )
    pass_env: tuple[str, ...] = field(
        default=DEFAULT_PASS_ENV,
        metadata=setting(
            "--pass-env",
            "more variables (or `PREFIX*`) passed from our environment to workers; adds to "
            "the default",
            extends=True,
            metavar="NAME",
        ),
    )
    # Given to every worker after the allowlisted base.
    env: dict[str, str] = field(
        default_factory=dict,
        metadata=setting("--env", "variables set in every worker", metavar="NAME=VALUE"),
    )
    # Tokens each HTTP key's sessions may spend on the model, counted by the
    # supervisor's model endpoint (model_gate.py) since it started.
    model_budgets: dict[str, str] = field(
        default_factory=dict,
        metadata=setting(
            "--model-budget",
            "model tokens an HTTP key's sessions may use (`NAME=TOKENS`; `*` for every key "
            "not named); sealed sessions only",
            metavar="NAME=TOKENS",
            counts=True,
            check=_budgets_fault,
        ),
    )
    workspace_roots: tuple[str, ...] = field(
        default=(),
        metadata=setting(
            "--workspace-root",
            "directories under which a front end may choose a session's workspace "
            "(`workspace` option)",
            path=True,
            metavar="DIR",
        ),
    )
    runtimes: tuple[str, ...] = field(
        default=(),
        metadata=setting(
            "--allow-runtime",
            "runtimes a front end may choose per session (`runtime` option) besides `runtime`",
            metavar="RUNTIME",
        ),
    )
    # environment.APPROVAL_ENV.
    allow_env: tuple[str, ...] = field(
        default=(),
        metadata=setting(
            "--allow-env",
            "variables that decide whether the agent asks before a dangerous command "
            "(`HERMES_EXEC_ASK`, `HERMES_GATEWAY_SESSION`, `HERMES_YOLO_MODE`) that front "
            "ends may set all the same through the `env` option; others are refused "
            "(`bad_field`), so a front end cannot switch approvals off for its own session",
            metavar="NAME",
        ),
    )
    # supervisor/worktrees.py.
    repo: str = field(
        default="",
        metadata=setting(
            "--repo",
            "a git repository: each session's workspace is a repository of its own that "
            "borrows its objects, on its own branch",
            zero="off",
            path=True,
            metavar="PATH",
        ),
    )
    repo_roots: tuple[str, ...] = field(
        default=(),
        metadata=setting(
            "--repo-root",
            "directories under which a front end may name a session's repository (`repo` option)",
            path=True,
            metavar="DIR",
        ),
    )
    # In wire form.
    session_defaults: dict[str, Any] = field(
        default_factory=dict,
        metadata=setting(
            "",
            "options a new session gets when its front end passes none: `session_env`, "
            "`env`, `agent`",
            shown="",
        ),
    )


@dataclass(kw_only=True)
class LifecycleSettings:
    """When a worker is started, judged hung, stopped or started again, and
    when a session sleeps: the supervisor's clock over its workers."""

    # A new session takes one instead of waiting for a fork (see
    # supervisor/spare_workers.py).
    spare_workers: int = field(
        default_factory=default_spare_workers,
        metadata=setting(
            "--spare-workers",
            "workers forked ahead of need, connected and waiting for a new session (see "
            '"Starting fast")',
            shown=f"one per CPU, at most {MAX_DEFAULT_SPARES} (0 = none)",
        ),
    )
    # Graceful kill: ask the worker to stop, then SIGTERM its group, then SIGKILL.
    stop_timeout: float = field(
        default=5.0,
        metadata=setting("--stop-timeout", "seconds a worker gets to stop before SIGTERM"),
    )
    term_timeout: float = field(
        default=2.0, metadata=setting("--term-timeout", "seconds after SIGTERM before SIGKILL")
    )
    start_timeout: float = field(
        default=30.0,
        metadata=setting("--start-timeout", "seconds a new worker may take to say hello"),
    )
    shutdown_grace: float = field(
        default=10.0,
        metadata=setting("--shutdown-grace", "seconds running turns get at shutdown"),
    )
    # Workers heartbeat from their main loop (never from the turn thread), so
    # a long turn is busy, not hung. Silent too long: SIGABRT (a traceback
    # lands in the session log), then SIGKILL after abort_grace.
    heartbeat_interval: float = field(
        default=2.0,
        metadata=setting(
            "--heartbeat-interval",
            "seconds between the heartbeats of a worker running a turn (at most a quarter "
            "of the timeout)",
        ),
    )
    heartbeat_timeout: float = field(
        default=10.0,
        metadata=setting(
            "--heartbeat-timeout",
            "a worker silent this long during a turn, and making no progress (CPU time, "
            "a runnable thread), is hung; one that is, gets up to 3 more",
        ),
    )
    # An idle worker beats less often: a thousand idle sessions beating
    # every 2 s kept a 2-core machine a fifth busy.
    idle_heartbeat_interval: float = field(
        default=15.0,
        metadata=setting(
            "--idle-heartbeat-interval",
            "seconds between an idle worker's heartbeats; an idle worker is hung after 3 "
            "missed (45 s), or the timeout if longer",
        ),
    )
    abort_grace: float = field(
        default=2.0,
        metadata=setting("--abort-grace", "seconds between SIGABRT and SIGKILL for a hung worker"),
    )
    # No limit by default, for agents; a runtime that ignores the cancel is killed.
    turn_timeout: float | None = field(
        default=None,
        metadata=setting("--turn-timeout", "seconds before a turn is cancelled", zero="off"),
    )
    cancel_grace: float = field(
        default=5.0,
        metadata=setting(
            "--cancel-grace", "seconds a cancelled turn may take before its worker is killed"
        ),
    )
    # A worker that dies sooner than min_uptime after its spawn is a fast
    # failure: back off backoff_base * 2^(n-1) seconds (at most backoff_cap);
    # after max_fast_failures in a row the session is failed until killed or
    # until failed_cooldown passes.
    min_uptime: float = field(
        default=2.0,
        metadata=setting("--min-uptime", "seconds: a worker dying sooner is a fast failure"),
    )
    backoff_base: float = field(
        default=0.5,
        metadata=setting(
            "--backoff-base", "first back-off delay in seconds; doubles each fast failure"
        ),
    )
    backoff_cap: float = field(
        default=30.0, metadata=setting("--backoff-cap", "longest back-off delay in seconds")
    )
    max_fast_failures: int = field(
        default=5,
        metadata=setting("--max-fast-failures", "fast failures in a row before `failed`"),
    )
    failed_cooldown: float = field(
        default=300.0,
        metadata=setting("--failed-cooldown", "seconds a failed session refuses turns"),
    )
    # When full, the least recently used idle session is stopped to make room.
    max_sessions: int | None = field(
        default=None,
        metadata=setting("--max-sessions", "live workers at most", zero="from the fd limit"),
    )
    # Busy sessions never are stopped for it, nor those with a process of
    # their own still running (health.py).
    idle_timeout: float | None = field(
        default=600.0,
        metadata=setting(
            "--idle-timeout",
            "hibernate sessions idle this many seconds: their worker stops, their files and "
            "history stay, the next turn wakes them",
            zero="off",
        ),
    )
    # A session with processes of its own running never is idle (health.py):
    # past this while awake, with no turn, they are ended and it hibernates.
    max_awake_seconds: float | None = field(
        default=3600.0,
        metadata=setting(
            "--max-awake",
            "seconds a session with background processes may stay awake without a turn "
            "before they get SIGTERM, then SIGKILL after `awake_grace`, and it hibernates",
            zero="off",
        ),
    )
    awake_grace: float = field(
        default=10.0,
        metadata=setting(
            "--awake-grace",
            "seconds a session's background processes have to end after SIGTERM at "
            "`max_awake`, before SIGKILL",
        ),
    )
    awake_exempt: tuple[str, ...] = field(
        default=(),
        metadata=setting(
            "--awake-exempt",
            "session keys (or `PREFIX*`) never stopped by `max_awake`",
            metavar="KEY",
        ),
    )
    # Told to each worker in its spawn request (`coalesce_ms`; worker/coalesce.py).
    stream_coalesce_ms: float = field(
        default=10.0,
        metadata=setting(
            "--stream-coalesce-ms",
            "a worker merges a turn's `token` and `output` events made within this many "
            "milliseconds into one, in order and byte for byte; the first, and tools, "
            "approvals and replies, go at once",
            zero="off",
        ),
    )


@dataclass(kw_only=True)
class LimitSettings:
    """What one session may take of the machine: memory, processes, CPU, IO,
    files, disk and log volume, and how often each is sampled."""

    # Per-session limits. Memory and processes are counted over the worker
    # and all its descendants (see limits.py), sampled every limits_interval;
    # over either, the session is recycled. max_open_files and cpu_seconds
    # are rlimits set in the worker.
    memory_limit_mb: int | None = field(
        default=2048,
        metadata=setting(
            "--memory-limit",
            "MiB of memory a worker and its descendants may use: their PSS summed, so pages "
            "they share (libraries, copy-on-write) count once; read only for trees whose RSS "
            "sum is over the limit",
            zero="off",
        ),
    )
    max_procs: int | None = field(
        default=256,
        metadata=setting(
            "--max-procs",
            "descendants of a worker; sealed, also the session's `RLIMIT_NPROC` (its "
            "processes and threads, counted by the kernel: a fork over it fails at once)",
            zero="off",
        ),
    )
    # supervisor/cgroups.py: a kernel control group per session's worker,
    # where the host delegates one; memory_limit_mb and max_procs become its
    # memory.max and pids.max.
    cgroups: str = field(
        default="auto",
        metadata=setting(
            "--cgroups",
            "a cgroup per session (v2 delegated subtree, or v1 as root): its memory, "
            "processes, CPU and IO bounded by the kernel, and an OOM kill ends that "
            'session only; `"auto"` uses them where the host allows and says why not in '
            '`status`; `"on"` refuses to start without them; `"off"` never',
            choices=SEALED_CHOICES,
            reload=False,
        ),
    )
    cpu_weight: int | None = field(
        default=100,
        metadata=setting(
            "--cpu-weight",
            "with cgroups: a session's CPU weight, 1-10000, more is 10000 (`cpu.weight`; v1 "
            "`cpu.shares` x10.24): sessions share the CPUs in proportion, however many "
            "processes each runs",
            zero="the kernel's default",
        ),
    )
    io_weight: int | None = field(
        default=100,
        metadata=setting(
            "--io-weight",
            "with cgroups: a session's IO weight, 1-10000, more is 10000 (`io.weight`, where "
            "the kernel's IO controller weighs; v1 `blkio.weight`, 10-1000)",
            zero="the kernel's default",
        ),
    )
    max_open_files: int | None = field(
        default=1024,
        metadata=setting("--max-open-files", "open-file rlimit of each worker", zero="off"),
    )
    cpu_seconds: int | None = field(
        default=None,
        metadata=setting("--cpu-seconds", "CPU-time rlimit of each worker", zero="off"),
    )
    file_size_limit_mb: int | None = field(
        default=4096,
        metadata=setting(
            "--file-size-limit",
            "MiB of the largest file a session may write (`RLIMIT_FSIZE`: a write past it "
            'fails with "File too large")',
            zero="off",
        ),
    )
    tmp_limit_mb: int | None = field(
        default=256,
        metadata=setting(
            "--tmp-limit",
            "sealed: MiB of the tmpfs that is a session's `/tmp`, `/var/tmp` and `/dev/shm` "
            "(gone with its worker); 0: its `tmp/` on disk, unbounded",
            zero="off",
        ),
    )
    limits_interval: float = field(
        default=2.0,
        metadata=setting(
            "--limits-interval",
            "seconds between memory/process samples (longer under load)",
        ),
    )
    # Disk (see supervisor/disk.py): the supervisor's reserve for its own
    # state, and each session's bound on its workspace, home and tmp.
    disk_reserve_mb: int | None = field(
        default=64,
        metadata=setting(
            "--disk-reserve",
            "MiB kept free for the supervisor's own state (turn journal, session records) on "
            "the data and state directories' disks: below it, new turns are refused with "
            "`disk_full` (safe to send again) and `status` says so",
            zero="off",
        ),
    )
    disk_limit_mb: int | None = field(
        default=10240,
        metadata=setting(
            "--disk-limit",
            "MiB a session's workspace, home and tmp may take on disk; over it the session is "
            "stopped with the reason `disk` (sampled every `disk_interval`; `status` says how "
            "it is enforced)",
            zero="off",
        ),
    )
    disk_interval: float = field(
        default=5.0,
        metadata=setting(
            "--disk-interval",
            "seconds between two rounds of the disk sampler over a session's files (each "
            "round is read a slice per tick, so a large tree takes longer)",
        ),
    )
    log_max_bytes: int = field(
        default=10 * 1024 * 1024,
        metadata=setting("--log-max-bytes", "rotate a session log at this size, bytes"),
    )
    log_backups: int = field(
        default=3, metadata=setting("--log-backups", "rotated session logs kept")
    )
    # See supervisor/logs.py.
    log_rate_limit: int | None = field(
        default=1024 * 1024,
        metadata=setting(
            "--log-rate-limit",
            "bytes a second a session's log may take after a burst; over it, the supervisor "
            "reads that session's output pipe only as fast as the rate, so its writers wait "
            "and no line is dropped (a dying worker's last output is read at once)",
            zero="off",
        ),
    )
    log_rate_burst: int = field(
        default=4 * 1024 * 1024,
        metadata=setting(
            "--log-rate-burst",
            "bytes a session may log at once before `log_rate_limit` applies (at least 65536)",
        ),
    )


@dataclass(kw_only=True)
class IsolationSettings:
    """What a session is sealed from: the host's files and processes, and the
    network beyond what the egress policy lets through."""

    # worker/seal.py. "off" is the operator's choice: a session is then no
    # boundary (its shell can read the supervisor's key).
    sealed: str = field(
        default="auto",
        metadata=setting(
            "--sealed",
            "each worker in its own mount and PID namespaces, seeing only its own session's "
            'files and processes (see "Sealed sessions"): `"auto"` seals where the kernel '
            "allows it and otherwise runs unsealed with a warning at start, in `status`, "
            '`list` and the HTTP endpoint; `"on"` refuses to start without it; `"off"` runs '
            "unsealed by choice, and a session is then no boundary",
            choices=SEALED_CHOICES,
            reload=False,
        ),
    )
    network: str = field(
        default="egress",
        metadata=setting(
            "--network",
            'a sealed session\'s network: `"egress"`, a network namespace of its own with '
            "only `lo`, the outside reached through the supervisor's proxy by policy; "
            '`"none"`, the namespace and no way out; `"host"`, the host\'s network, '
            "its loopback services and every other session's listeners included (a warning "
            'at start). Where the kernel cannot make the namespace, `sealed = "auto"` '
            'runs with the host\'s network and says so; `"on"` refuses to start',
            choices=NETWORK_CHOICES,
            reload=False,
        ),
    )
    egress_allow: tuple[str, ...] = field(
        default=(),
        metadata=setting(
            "--egress-allow",
            "destinations a session may reach besides the public internet: `host`, "
            "`*.domain`, an address range (`10.1.0.0/16`, `[fd00::/8]`) or `*`, each with "
            "an optional `:PORT` or `:LOW-HIGH`; only an address range opens loopback, "
            "private, link-local and the host's own addresses",
            metavar="RULE",
            check=check_rules,
        ),
    )
    egress_deny: tuple[str, ...] = field(
        default=(),
        metadata=setting(
            "--egress-deny",
            "destinations no session may reach, in the form of `egress_allow`; a deny "
            "always wins over an allow, but `*` alone only closes what `egress_allow` "
            "does not name",
            metavar="RULE",
            check=check_rules,
        ),
    )


@dataclass(kw_only=True)
class ServiceSettings:
    """How the supervisor faces its clients and operators: its sockets and
    their bounds, the endpoints beside it, its logs and its name."""

    max_frame_size: int = field(
        default=DEFAULT_MAX_FRAME_SIZE,
        metadata=setting(
            "--max-frame-size",
            "largest frame a peer may send, bytes",
            minimum=1024,
            reload=False,
        ),
    )
    # Over either queue limit, a `busy` error: nothing is dropped silently.
    max_queue: int = field(
        default=256,
        metadata=setting(
            "--max-queue",
            "turns one session may have waiting; more get a `busy` error",
            minimum=1,
        ),
    )
    max_queued_total: int = field(
        default=10_000,
        metadata=setting("--max-queued-total", "turns waiting across all sessions"),
    )
    # See door/gate.py.
    max_clients: int | None = field(
        default=None,
        metadata=setting(
            "--max-clients",
            "client connections at once, local and TCP together (with `tcp`, half each); "
            "more are refused with `overloaded`",
            zero="from the fd limit",
            reload=False,
        ),
    )
    # See door/fronts.py, "Slow consumers".
    client_queue: int = field(
        default=10_000,
        metadata=setting(
            "--client-queue",
            "messages queued for one client connection; a client that does not read them "
            "lags: its events are dropped and counted (a `dropped` event tells it how many "
            "when it reads again), its answers kept for it; 0: no limit, so such a client can "
            "hold any amount of the supervisor's memory",
            reload=False,
        ),
    )
    history: int = field(
        default=200,
        metadata=setting("--history", "recent events per session replayed to `attach`"),
    )
    tcp: str = field(
        default="",
        metadata=setting(
            "--tcp",
            "CURVE TCP endpoint for remote front ends, `PORT` (127.0.0.1) or `HOST:PORT` "
            "(`0.0.0.0:PORT` listens on every interface); clients need "
            "`hermes-sup keys generate`",
            zero="off",
            reload=False,
            metavar="[HOST:]PORT",
            check=_tcp_address,
        ),
    )
    metrics: str = field(
        default="",
        metadata=setting(
            "--metrics",
            "Prometheus endpoint, `PORT` (127.0.0.1) or `HOST:PORT` (needs the `metrics` extra)",
            zero="off",
            reload=False,
            metavar="[HOST:]PORT",
        ),
    )
    metrics_token_file: str = field(
        default="",
        metadata=setting(
            "--metrics-token-file",
            "a file holding a token the metrics endpoint requires (`Authorization: Bearer "
            "TOKEN`, or basic auth with the token as password); without one, a `metrics` "
            "address beyond loopback is warned of at start",
            zero="no credentials",
            reload=False,
            path=True,
            metavar="FILE",
        ),
    )
    # Started by the serve command before the supervisor (cli/http.py), in a
    # process of its own; the endpoint's own settings are the [http_api]
    # table (httpapi/settings.py).
    http: str = field(
        default="",
        metadata=setting(
            "--http",
            "also serve Hermes's HTTP API (chat completions, Responses, runs) on `PORT` "
            "(127.0.0.1) or `HOST:PORT`, in a process of its own, with the settings of the "
            "`[http_api]` table; needs `hermes-sup keys http generate` and the `http` extra",
            zero="off",
            reload=False,
            metavar="[HOST:]PORT",
            check=_http_address,
        ),
    )
    http_web: str = field(
        default="",
        metadata=setting(
            "--http-web",
            "with `http`, also serve this directory's static files at / (a page such as "
            "examples/web, with its `index.html`; they need no key, the API still does)",
            zero="none",
            reload=False,
            path=True,
            metavar="DIR",
        ),
    )
    log_level: str = field(
        default="info",
        metadata=setting(
            "--log-level", f"what the supervisor logs: {either(LOG_LEVELS)}", choices=LOG_LEVELS
        ),
    )
    log_format: str = field(
        default="text",
        metadata=setting(
            "--log-format",
            "how the supervisor's log lines read: `text`, for a person, or `json`, one object "
            "a line (`ts`, `level`, `event`, `session`, `pid`, ...) for journald and log "
            "shippers",
            envvar="HERMES_SUP_LOG_FORMAT",
            choices=LOG_FORMATS,
            reload=False,
        ),
    )
    # `hermes-sup route`, Ray.
    node: str = field(
        default="",
        metadata=setting(
            "--node",
            "this supervisor's name among a cluster's nodes (see \"Beyond one machine\")",
            zero="the host's name",
            reload=False,
        ),
    )
    # A node lease with a deadline (supervisor/node_lease.py), for a data
    # directory shared by nodes behind routers.
    lease_time: float = field(
        default=0.0,
        metadata=setting(
            "--lease-time",
            "seconds this node holds its sessions' leases past the last router ping it "
            "heard: it renews them while routers reach it, and stops its sessions' workers "
            "before they run out; another node may take a session whose holder's lease ran "
            "out (a frozen or cut-off node). For a data directory shared by nodes behind "
            "routers (`ray up --data-dir` sets it)",
            zero="off: a session's lock alone, held until its holder dies",
            reload=False,
        ),
    )
    # Whether leases can be lost while held (supervisor/leases.py).
    shared_data: str = field(
        default="auto",
        metadata=setting(
            "--shared-data",
            "whether the data directory is shared with other hosts (NFS, a cluster file "
            "system), where a lock can expire behind its holder: then each session's fencing "
            "epoch is read back twice a second; `auto` asks the directory's file system type "
            "(ext4, xfs, btrfs, tmpfs, zfs ... are local; anything else counts as shared)",
            choices=("auto", "yes", "no"),
            reload=False,
        ),
    )


@dataclass(kw_only=True)
class Settings(
    ServiceSettings, IsolationSettings, LimitSettings, LifecycleSettings, SessionSettings
):
    """Everything `hermes-sup serve` can be told (see `Setting`): the groups'
    fields, in the order SessionSettings, LifecycleSettings, LimitSettings,
    IsolationSettings, ServiceSettings (a dataclass lists its bases' fields
    from the last base to the first)."""

    # Where these settings came from, for reload: the file and what the
    # command line set over it. Bookkeeping, not settings.
    config_file: Path | None = None
    overrides: dict[str, Any] = field(default_factory=dict)


# Every setting by its Settings field name, in the order of the fields.
SETTINGS: dict[str, Setting] = declare(Settings)


def reference_table() -> str:
    """The configuration reference of `serve`: a Markdown table, a row a setting."""
    return markdown_table(SETTINGS)
