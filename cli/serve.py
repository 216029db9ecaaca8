"""`hermes-sup serve` and its settings: one flag per lifecycle setting
(TUNABLES), the merge of what the command line sets over the --config file,
and `hermes-sup config check`, which reads that file as serve would."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import click

from hermes_sup.supervisor.config import (
    DATA_DIR_ENV,
    DEFAULT_PASS_ENV,
    Settings,
    default_data_dir,
    default_state_dir,
)
from hermes_sup.supervisor.configfile import OPTIONAL_FIELDS

from .options import LOG_LEVEL, web_dir_option


def parse_pairs(values: tuple[str, ...], what: str) -> dict[str, str]:
    """NAME=VALUE option values as a dict; a usage error names the option `what`."""
    out: dict[str, str] = {}
    for item in values:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise click.BadParameter(f"{item!r} is not NAME=VALUE", param_hint=what)
        out[name] = value
    return out


# Lifecycle settings, one flag each: (flag, Settings field, type, help).
# "none" or 0 turns off a limit that may be off.
TUNABLES: list[tuple[str, str, Any, str]] = [
    ("--max-sessions", "max_sessions", int, "Live workers at most [default: from the fd limit]."),
    (
        "--spare-workers",
        "spare_workers",
        int,
        "Workers forked ahead, waiting for new sessions; 0: none [one per CPU, at most 8].",
    ),
    (
        "--idle-timeout",
        "idle_timeout",
        float,
        "Stop sessions idle this many seconds [default: never].",
    ),
    ("--turn-timeout", "turn_timeout", float, "Cancel turns running longer [default: no limit]."),
    ("--heartbeat-timeout", "heartbeat_timeout", float, "A worker silent this long is hung [10]."),
    (
        "--idle-heartbeat-interval",
        "idle_heartbeat_interval",
        float,
        "Seconds between an idle worker's heartbeats; 3 missed: hung [15].",
    ),
    (
        "--memory-limit",
        "memory_limit_mb",
        int,
        "MiB of memory per session: PSS of the worker and its children [2048].",
    ),
    (
        "--max-procs",
        "max_procs",
        int,
        "Processes per session besides the worker; sealed, also its RLIMIT_NPROC [256].",
    ),
    ("--max-open-files", "max_open_files", int, "Open-file rlimit of each worker [1024]."),
    ("--cpu-seconds", "cpu_seconds", int, "CPU-time rlimit of each worker [default: none]."),
    (
        "--file-size-limit",
        "file_size_limit_mb",
        int,
        "MiB of the largest file a session may write (RLIMIT_FSIZE) [4096].",
    ),
    (
        "--tmp-limit",
        "tmp_limit_mb",
        int,
        "Sealed: MiB of the tmpfs that is a session's /tmp; 0: its tmp/ on disk [256].",
    ),
    ("--min-uptime", "min_uptime", float, "A worker dying sooner is a fast failure [2]."),
    ("--backoff-base", "backoff_base", float, "First back-off delay in seconds; doubles [0.5]."),
    ("--backoff-cap", "backoff_cap", float, "Longest back-off delay in seconds [30]."),
    ("--max-fast-failures", "max_fast_failures", int, "Fast failures before failed [5]."),
    (
        "--failed-cooldown",
        "failed_cooldown",
        float,
        "Seconds a failed session refuses turns [300].",
    ),
    ("--shutdown-grace", "shutdown_grace", float, "Seconds running turns get at shutdown [10]."),
    ("--max-queued-total", "max_queued_total", int, "Turns waiting across all sessions [10000]."),
    ("--log-max-bytes", "log_max_bytes", int, "Rotate a session log at this size [10 MiB]."),
    ("--history", "history", int, "Recent events per session replayed to attach [200]."),
]


def _tunable_type(field: str, kind: Any) -> Any:
    class Tunable(click.ParamType):  # type: ignore[type-arg]
        name = kind.__name__

        def convert(self, value: Any, param: Any, ctx: Any) -> Any:
            if isinstance(value, str) and value.lower() == "none" and field in OPTIONAL_FIELDS:
                return None
            try:
                number = kind(value)
            except (TypeError, ValueError):
                self.fail(f"{value!r} is not a number", param, ctx)
            if number < 0:
                self.fail(f"{value!r} is negative", param, ctx)
            if number == 0 and field in OPTIONAL_FIELDS:
                return None
            return number

    return Tunable()


def tunables(func: Any) -> Any:
    """Add one option per TUNABLES row; unset ones keep Settings' defaults."""
    for flag, field, kind, help_text in reversed(TUNABLES):
        func = click.option(
            flag, field, type=_tunable_type(field, kind), default=None, help=help_text
        )(func)
    return func


@click.command()
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    envvar=DATA_DIR_ENV,
    help=f"Session workspaces and homes [env {DATA_DIR_ENV}].",
)
@click.option(
    "--agent",
    "runtime",
    default="probe",
    show_default=True,
    help="Agent runtime: a built-in name (probe) or module:factory.",
)
@click.option(
    "--metrics",
    default=None,
    metavar="[HOST:]PORT",
    help="Serve Prometheus metrics on 127.0.0.1:PORT (or HOST:PORT) [needs the metrics extra].",
)
@click.option(
    "--config",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    envvar="HERMES_SUP_CONFIG",
    default=None,
    help="TOML file with any of these settings (flags override it) [env HERMES_SUP_CONFIG].",
)
@click.option(
    "--agent-config",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    default=None,
    help="TOML or JSON settings for the runtime (hermes: model, base_url, provider, "
    "toolsets, template_home, api_key_env or api_key_file).",
)
@click.option(
    "--tcp",
    default=None,
    help="Also serve remote front ends on TCP with CURVE: PORT (127.0.0.1) or HOST:PORT; "
    "0.0.0.0:PORT listens on every interface. Clients need `hermes-sup keys generate`.",
)
@click.option(
    "--http",
    "http_listen",
    default=None,
    metavar="[HOST:]PORT",
    help="Also serve Hermes's HTTP API (chat completions, runs) on 127.0.0.1:PORT or HOST:PORT, "
    "in a process of its own; needs `hermes-sup keys http generate` and the http extra.",
)
@web_dir_option("--http-web", "http_web", "With --http, also")
@click.option(
    "--workspace-root",
    "workspace_roots",
    multiple=True,
    help="A directory under which front ends may choose a session's workspace (repeat).",
)
@click.option(
    "--allow-runtime",
    "runtimes",
    multiple=True,
    help="A runtime front ends may choose per session besides --agent (repeat).",
)
@click.option(
    "--allow-env",
    "allow_env",
    multiple=True,
    help="A variable that decides the agent's approvals (HERMES_EXEC_ASK, "
    "HERMES_GATEWAY_SESSION, HERMES_YOLO_MODE) that front ends may set all the same (repeat).",
)
@click.option(
    "--sealed",
    type=click.Choice(["off", "auto", "on"]),
    default=None,
    help="Each worker in its own mount and PID namespaces, seeing only its session's files "
    "and processes: auto (where the kernel allows, else a warning), on (refuse to start "
    "without it) or off (a session is then no boundary) [auto].",
)
@click.option(
    "--repo",
    default=None,
    metavar="PATH",
    help="A git repository: each session works in its own worktree of it, on its own branch.",
)
@click.option(
    "--repo-root",
    "repo_roots",
    multiple=True,
    help="A directory under which front ends may name a session's repository (repeat).",
)
@click.option("--preload", multiple=True, help="Module the zygote imports before forking (repeat).")
@click.option(
    "--pass-env",
    multiple=True,
    help="Also pass this variable (or PREFIX*) from our environment to workers (repeat).",
)
@click.option("--env", "env_pairs", multiple=True, help="Set NAME=VALUE in every worker (repeat).")
@click.option(
    "--max-frame-size",
    type=click.IntRange(1024),
    default=16 * 1024 * 1024,
    show_default=True,
    help="Largest frame a peer may send, in bytes.",
)
@click.option(
    "--stop-timeout",
    type=click.FloatRange(0),
    default=5.0,
    show_default=True,
    help="Seconds a worker gets to stop before SIGTERM (then SIGKILL).",
)
@click.option(
    "--max-queue",
    type=click.IntRange(1),
    default=256,
    show_default=True,
    help="Turns one session may have waiting before senders get a busy error.",
)
@LOG_LEVEL
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    envvar="HERMES_SUP_LOG_FORMAT",
    default="text",
    show_default=True,
    help="json: one object a line ({ts, level, event, session, pid, ...}) for journald "
    "and log shippers [env HERMES_SUP_LOG_FORMAT].",
)
@tunables
@click.pass_context  # type: ignore[arg-type]
def serve(
    ctx: click.Context,
    data_dir: Path | None,
    runtime: str,
    agent_config: Path | None,
    metrics: str | None,
    config: Path | None,
    tcp: str | None,
    http_listen: str | None,
    http_web: Path | None,
    workspace_roots: tuple[str, ...],
    runtimes: tuple[str, ...],
    allow_env: tuple[str, ...],
    sealed: str | None,
    repo: str | None,
    repo_roots: tuple[str, ...],
    preload: tuple[str, ...],
    pass_env: tuple[str, ...],
    env_pairs: tuple[str, ...],
    max_frame_size: int,
    stop_timeout: float,
    max_queue: int,
    log_level: str,
    log_format: str,
    **tuned: Any,
) -> None:
    """Run the supervisor in the foreground until SIGTERM or Ctrl-C.

    \b
    Example:
      hermes-sup --state-dir /tmp/hs serve --data-dir /tmp/hs-data
    """
    from hermes_sup.door.remote import RemoteError
    from hermes_sup.local.statedir import StateDirError
    from hermes_sup.supervisor import configfile
    from hermes_sup.supervisor.server import Supervisor

    def given(name: str) -> bool:
        return ctx.get_parameter_source(name) in (
            click.core.ParameterSource.COMMANDLINE,
            click.core.ParameterSource.ENVIRONMENT,
        )

    # What the command line (or its environment variables) set wins over the file.
    overrides: dict[str, Any] = {}
    # Absolute: the zygote and workers run in other directories than ours.
    if ctx.obj["state_dir_given"]:
        overrides["state_dir"] = Path(ctx.obj["state_dir"]).absolute()
    if data_dir is not None:
        overrides["data_dir"] = data_dir.absolute()
    if agent_config is not None:
        try:
            overrides["runtime_config"] = configfile.load_agent_config(agent_config)
        except configfile.ConfigError as exc:
            raise click.BadParameter(str(exc), param_hint="--agent-config") from None
    if preload:
        overrides["preload"] = preload
    if workspace_roots:
        overrides["workspace_roots"] = tuple(str(Path(r).absolute()) for r in workspace_roots)
    if runtimes:
        overrides["runtimes"] = runtimes
    if allow_env:
        overrides["allow_env"] = allow_env
    if sealed is not None:
        overrides["sealed"] = sealed
    if repo is not None:
        overrides["repo"] = str(Path(repo).absolute()) if repo else ""
    if repo_roots:
        overrides["repo_roots"] = tuple(str(Path(r).absolute()) for r in repo_roots)
    if pass_env:
        overrides["pass_env"] = DEFAULT_PASS_ENV + pass_env
    if env_pairs:
        overrides["env"] = parse_pairs(env_pairs, "--env")
    plain = {
        "runtime": runtime,
        "metrics": metrics,
        "tcp": tcp,
        "max_frame_size": max_frame_size,
        "stop_timeout": stop_timeout,
        "max_queue": max_queue,
        "log_level": log_level,
        **tuned,
    }
    overrides.update({name: value for name, value in plain.items() if given(name)})
    base = Settings(state_dir=default_state_dir(), data_dir=default_data_dir())
    try:
        settings = configfile.build(base, config, overrides)
    except configfile.ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    settings.config_file = config
    settings.overrides = overrides
    if settings.metrics:
        from hermes_sup.supervisor.metrics import parse_address

        try:
            parse_address(settings.metrics)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--metrics") from None
        if importlib.util.find_spec("prometheus_client") is None:
            raise click.ClickException(
                "metrics need prometheus-client: pip install 'hermes-sup[metrics]'"
            )
    if settings.tcp:
        from hermes_sup.door.remote import RemoteError, parse_tcp

        try:
            parse_tcp(settings.tcp)
        except RemoteError as exc:
            raise click.BadParameter(str(exc), param_hint="--tcp") from None
    if settings.runtime == "hermes" and not settings.preload:
        from hermes_sup.worker.hermes import HERMES_SAFE_PRELOAD

        settings.preload = tuple(m for m in HERMES_SAFE_PRELOAD if importlib.util.find_spec(m))
    from .logformat import configure

    configure(settings.log_level, log_format, settings.shutdown_grace)
    if http_web is not None and not http_listen:
        raise click.BadParameter(
            "serves a page beside --http: give --http too", param_hint="--http-web"
        )
    if http_listen:
        from .http import start_http_beside

        start_http_beside(settings, http_listen, http_web)  # forks: before anything else starts
    from hermes_sup.supervisor.sealing import SealingUnavailable

    try:
        code = Supervisor(settings).run()
    except (StateDirError, RemoteError, SealingUnavailable) as exc:
        raise click.ClickException(str(exc)) from None
    sys.exit(code)


@click.group()
def config() -> None:
    """Check configuration files."""


@config.command(name="check")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
def config_check(file: Path) -> None:
    """Check FILE as `serve --config` would, without starting anything:
    every bad key at once, then whether its runtime can be imported (and
    hermes-agent is installed for hermes), its preload modules exist and its
    workspace roots are directories.

    \b
    Example:
      hermes-sup config check /etc/hermes-sup/config.toml
    """
    from .configcheck import check_file

    values, errors = check_file(file, progress=lambda text: click.echo(text, err=True))
    for error in errors:
        click.echo(f"Error: {error}", err=True)
    if errors:
        raise click.ClickException(f"{file}: {len(errors)} error(s); nothing was started")
    click.echo(f"{file}: ok ({len(values)} setting(s))")
