"""The `hermes-sup` command line: serve, and a thin client for everything else.

Exit codes: 0 ok, 1 error, 2 usage, 3 supervisor not running.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from hermes_sup.client import (
    Client,
    ClientError,
    NotRunning,
    Output,
    Reply,
    SupervisorError,
    Timeout,
    Token,
    session_options,
)
from hermes_sup.protocol import Kind
from hermes_sup.supervisor.config import (
    DATA_DIR_ENV,
    DEFAULT_PASS_ENV,
    STATE_DIR_ENV,
    Settings,
    default_data_dir,
    default_state_dir,
)
from hermes_sup.supervisor.configfile import OPTIONAL_FIELDS

from .show import STATE_ORDER, duration, session_table, size, use_color

EXIT_NOT_RUNNING = 3


class NotRunningError(click.ClickException):
    """The supervisor is not running: exit 3 with how to start it."""

    exit_code = EXIT_NOT_RUNNING


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, readable=False, path_type=Path),
    envvar=STATE_DIR_ENV,
    help=f"Sockets, key and lock [env {STATE_DIR_ENV}; default per user, /run/hermes-sup as root].",
)
@click.option(
    "--timeout",
    type=float,
    default=10.0,
    show_default=True,
    help="Seconds to wait for the supervisor to answer.",
)
@click.pass_context
def cli(ctx: click.Context, state_dir: Path | None, timeout: float) -> None:
    """hermes-sup: one real process per agent session, routed over ZeroMQ.

    \b
    Exit codes: 0 ok, 1 error, 2 usage, 3 supervisor not running.
    Completion: eval "$(_HERMES_SUP_COMPLETE=bash_source hermes-sup)"
    """
    ctx.obj = {
        "state_dir": state_dir or default_state_dir(),
        "state_dir_given": state_dir is not None,
        "timeout": timeout,
    }


@contextmanager
def connect(ctx: click.Context) -> Iterator[Client]:
    """A client for the command, with errors turned into one-line messages."""
    state_dir: Path = ctx.obj["state_dir"]
    try:
        client = Client(state_dir, timeout=ctx.obj["timeout"])
    except NotRunning as exc:
        raise NotRunningError(
            f"{exc}. Start it with: hermes-sup --state-dir {state_dir} serve"
        ) from None
    try:
        yield client
    except NotRunning as exc:
        raise NotRunningError(str(exc)) from None
    except SupervisorError as exc:
        raise click.ClickException(str(exc)) from None
    except ClientError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        client.close()


def complete_sessions(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[Any]:
    """Shell completion of session keys, asked of the running supervisor."""
    from click.shell_completion import CompletionItem

    root = ctx.find_root()
    state_dir = root.params.get("state_dir") or default_state_dir()
    try:
        with Client(Path(state_dir), timeout=1.0) as client:
            rows = client.sessions(prefix=incomplete)
    except Exception:
        return []
    return [CompletionItem(r["key"], help=r["state"]) for r in rows]


SESSION = click.argument("session", shell_complete=complete_sessions)


def _parse_pairs(values: tuple[str, ...], what: str) -> dict[str, str]:
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
        "Workers forked ahead, waiting for new sessions [0].",
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
    ("--memory-limit", "memory_limit_mb", int, "MiB of RSS per session, children included [2048]."),
    ("--max-procs", "max_procs", int, "Processes per session besides the worker [256]."),
    ("--max-open-files", "max_open_files", int, "Open-file rlimit of each worker [1024]."),
    ("--cpu-seconds", "cpu_seconds", int, "CPU-time rlimit of each worker [default: none]."),
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


@cli.command()
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
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    show_default=True,
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
    workspace_roots: tuple[str, ...],
    runtimes: tuple[str, ...],
    preload: tuple[str, ...],
    pass_env: tuple[str, ...],
    env_pairs: tuple[str, ...],
    max_frame_size: int,
    stop_timeout: float,
    max_queue: int,
    log_level: str,
    **tuned: Any,
) -> None:
    """Run the supervisor in the foreground until SIGTERM or Ctrl-C.

    \b
    Example:
      hermes-sup --state-dir /tmp/hs serve --data-dir /tmp/hs-data
    """
    from hermes_sup.supervisor import configfile
    from hermes_sup.supervisor.remote import RemoteError
    from hermes_sup.supervisor.server import Supervisor
    from hermes_sup.supervisor.statedir import StateDirError

    def given(name: str) -> bool:
        return ctx.get_parameter_source(name) in (
            click.core.ParameterSource.COMMANDLINE,
            click.core.ParameterSource.ENVIRONMENT,
        )

    # What the command line (or its environment variables) set wins over the file.
    overrides: dict[str, Any] = {}
    if ctx.obj["state_dir_given"]:
        overrides["state_dir"] = ctx.obj["state_dir"]
    if data_dir is not None:
        overrides["data_dir"] = data_dir
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
    if pass_env:
        overrides["pass_env"] = DEFAULT_PASS_ENV + pass_env
    if env_pairs:
        overrides["env"] = _parse_pairs(env_pairs, "--env")
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
        from hermes_sup.supervisor.remote import RemoteError, parse_tcp

        try:
            parse_tcp(settings.tcp)
        except RemoteError as exc:
            raise click.BadParameter(str(exc), param_hint="--tcp") from None
    if settings.runtime == "hermes" and not settings.preload:
        from hermes_sup.worker.hermes import HERMES_SAFE_PRELOAD

        settings.preload = tuple(m for m in HERMES_SAFE_PRELOAD if importlib.util.find_spec(m))
    logging.basicConfig(
        level=settings.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    try:
        code = Supervisor(settings).run()
    except (StateDirError, RemoteError) as exc:
        raise click.ClickException(str(exc)) from None
    sys.exit(code)


@cli.command()
@click.pass_context
def ping(ctx: click.Context) -> None:
    """Check that the supervisor answers.

    \b
    Example:
      hermes-sup ping
    """
    with connect(ctx) as client:
        started = time.perf_counter()
        info = client.ping()
        took = (time.perf_counter() - started) * 1000
    click.echo(
        f"hermes-sup {info.version} pid {info.pid} up {info.uptime:.1f}s "
        f"(answered in {took:.1f} ms)"
    )


@cli.command()
@SESSION
@click.argument("text")
@click.option(
    "--session-env",
    "session_env",
    multiple=True,
    help="NAME=VALUE given to a new worker as HERMES_SESSION_NAME (repeat).",
)
@click.option(
    "--workspace",
    default=None,
    help="Work in this directory (under one of the supervisor's --workspace-root).",
)
@click.option("--runtime", default=None, help="A runtime the supervisor allows (--allow-runtime).")
@click.option(
    "--turn-timeout",
    type=float,
    default=None,
    help="Cancel the turn and give up after this many seconds.",
)
@click.pass_context
def send(
    ctx: click.Context,
    session: str,
    text: str,
    session_env: tuple[str, ...],
    workspace: str | None,
    runtime: str | None,
    turn_timeout: float | None,
) -> None:
    """Send TEXT to SESSION, print its streamed output, then its reply.

    Options for a new session (--session-env, --workspace, --runtime) apply
    when its worker starts; a running session with other options refuses.

    \b
    Examples:
      hermes-sup send alice 'setenv COLOR blue'
      hermes-sup send alice 'sh echo $COLOR; pwd'
      hermes-sup send bob --workspace /srv/projects/acme 'sh ls'
    """
    options = session_options(
        session_env=_parse_pairs(session_env, "--session-env") if session_env else None,
        workspace=str(Path(workspace).absolute()) if workspace else None,
        runtime=runtime,
    )
    streamed = False
    with connect(ctx) as client:
        for event in client.send(session, text, options=options, turn_timeout=turn_timeout):
            if isinstance(event, Output):
                click.echo(event.line)
            elif isinstance(event, Token):
                click.echo(event.text, nl=False)
                streamed = True
            elif isinstance(event, Reply):
                # A streamed reply is already on screen: end its line instead.
                click.echo("" if streamed else event.text)


def parse_duration(text: str) -> float:
    """'90', '90s', '10m', '2h', '1h30m', '1d' -> seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    total, number = 0.0, ""
    for ch in text.strip().lower():
        if ch.isdigit() or ch == ".":
            number += ch
        elif ch in units and number:
            total += float(number) * units[ch]
            number = ""
        else:
            raise click.BadParameter(f"{text!r} is not a duration like 90s, 10m, 2h or 1h30m")
    if number:
        total += float(number)
    if not text.strip():
        raise click.BadParameter("empty duration")
    return total


@cli.command(name="list")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print a JSON array: numbers as numbers, times as epoch seconds.",
)
@click.option("--prefix", default="", help="Only sessions whose key starts with this.")
@click.option(
    "--state", type=click.Choice(STATE_ORDER), default=None, help="Only sessions in this state."
)
@click.pass_context
def list_(ctx: click.Context, as_json: bool, prefix: str, state: str | None) -> None:
    """List sessions: state, pid, uptime, idle time, turns, memory and CPU.

    Memory (RSS) and CPU% are of the worker and everything it started, sampled
    when you ask (CPU% since the previous list, or since the worker started).

    \b
    JSON fields: key, state, pid (or null), started and last_activity (epoch
    seconds), turns, queued, exits, last_exit, fast_failures, runtime,
    rss (bytes), procs, cpu_percent.

    \b
    Examples:
      hermes-sup list
      hermes-sup list --state busy
      hermes-sup list --json --prefix telegram:
    """
    with connect(ctx) as client:
        rows = client.sessions(prefix=prefix, state=state)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for line in session_table(rows, use_color(ctx), time.time()):
        click.echo(line)


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """Show the supervisor itself: pid, uptime, version, endpoints, sessions, memory.

    \b
    Example:
      hermes-sup status
    """
    with connect(ctx) as client:
        info = client.status()
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    counts = ", ".join(f"{n} {s}" for s, n in sorted(info["sessions"].items())) or "none"
    lines = [
        f"hermes-sup {info['version']} (protocol {info['protocol']}), pid {info['pid']}, "
        f"up {duration(info['uptime'])}",
        f"runtime:   {info['runtime']}   zygote pid {info['zygote_pid']}",
        f"control:   {info['endpoints']['control']}",
        f"workers:   {info['endpoints']['workers']}",
        f"data:      {info['data_dir']}",
        f"sessions:  {info['total_sessions']} ({counts}); at most {info['max_sessions']} live; "
        f"{info['queued']} turn(s) queued"
        + (f"; {info['spare_workers']} spare worker(s) ready" if info.get("spare_workers") else ""),
        f"memory:    {size(info['rss'])} RSS; {info['fds']} of {info['fd_limit']} fds",
    ]
    if info["endpoints"].get("tcp"):
        lines.insert(4, f"tcp:       {info['endpoints']['tcp']} (CURVE; hermes-sup keys list)")
    if not info["accepting"]:
        lines.append("shutting down: not accepting turns")
    click.echo("\n".join(lines))


@cli.command()
@click.argument("sessions", nargs=-1, shell_complete=complete_sessions)
@click.option("--all", "all_", is_flag=True, help="Kill every session.")
@click.option(
    "--idle-for",
    "idle_for",
    default=None,
    metavar="DURATION",
    help="Kill idle sessions idle at least this long (90s, 10m, 2h).",
)
@click.option("--force", is_flag=True, help="SIGKILL at once instead of asking the worker to stop.")
@click.option("--purge", is_flag=True, help="Also delete the sessions' data (asks first).")
@click.option("--yes", "-y", is_flag=True, help="Do not ask before purging.")
@click.pass_context
def kill(
    ctx: click.Context,
    sessions: tuple[str, ...],
    all_: bool,
    idle_for: str | None,
    force: bool,
    purge: bool,
    yes: bool,
) -> None:
    """Kill sessions' workers and every process they started; return when gone.

    Graceful by default: the worker is asked to stop, then its process group
    gets SIGTERM, then SIGKILL. The data (workspace, HERMES_HOME, log) stays,
    and the next message starts a fresh worker on it, unless --purge.

    \b
    Examples:
      hermes-sup kill alice
      hermes-sup kill --idle-for 30m
      hermes-sup kill --all --force
      hermes-sup kill bob --purge --yes
    """
    if not (sessions or all_ or idle_for):
        raise click.UsageError("name sessions to kill, or use --all or --idle-for")
    idle_seconds = parse_duration(idle_for) if idle_for else None
    with connect(ctx) as client:
        targets = list(sessions)
        if all_ or idle_seconds is not None:
            now = time.time()
            for r in client.sessions():
                if all_ or (r["state"] == "idle" and now - r["last_activity"] >= idle_seconds):
                    if r["key"] not in targets:
                        targets.append(r["key"])
        if not targets:
            click.echo("no sessions to kill")
            return
        if purge and not yes:
            if not sys.stdin.isatty():
                raise click.ClickException("refusing to purge without --yes (no terminal to ask)")
            click.confirm(
                f"Delete the data of {len(targets)} session(s) (workspace, HERMES_HOME, logs)?",
                abort=True,
            )
        # All at once: each kill returns when its processes are gone.
        pending = {
            client.submit(Kind.KILL, {"force": force, "purge": purge}, session=k): k
            for k in targets
        }
        failed = 0
        deadline = time.monotonic() + 120
        while pending:
            msg = client.next(timeout=max(1.0, deadline - time.monotonic()))
            key = pending.pop(msg.re, None)
            if key is None:
                continue
            if msg.kind is Kind.ERROR:
                failed += 1
                click.echo(f"{key}: {msg.body['message']}", err=True)
            else:
                pid = msg.body.get("pid")
                click.echo(f"{key}: {msg.body['reason']}" + (f" (pid {pid})" if pid else ""))
    if failed:
        sys.exit(1)


@cli.command()
@SESSION
@click.option("-n", "--lines", default=50, show_default=True, help="Lines to show from the end.")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines (across rotation).")
@click.pass_context
def logs(ctx: click.Context, session: str, lines: int, follow: bool) -> None:
    """Print a session's worker log (its stdout and stderr).

    \b
    Examples:
      hermes-sup logs alice -n 100
      hermes-sup logs alice -f
    """
    with connect(ctx) as client:
        req = client.submit(Kind.LOGS, {"lines": max(0, lines), "follow": follow}, session=session)
        first = client.answer(req)
        for line in first.body["lines"]:
            click.echo(line)
        if not follow:
            return
        try:
            while True:
                try:
                    msg = client.answer(req, timeout=1.0)
                except Timeout:
                    continue  # a supervisor that went away raises NotRunning instead
                if msg.body.get("type") == "log":
                    click.echo(msg.body["data"])
        except KeyboardInterrupt:
            client.submit(Kind.UNWATCH, {"watch": req})


@cli.command()
@SESSION
@click.option("--read-only", is_flag=True, help="Only watch; typed lines are not sent.")
@click.option("--replay", default=50, show_default=True, help="Recent events to show first.")
@click.pass_context
def attach(ctx: click.Context, session: str, read_only: bool, replay: int) -> None:
    """Watch SESSION live and talk to it, like tmux attach.

    Shows the session's recent events, then everything it produces, including
    turns sent by other clients. Each line you type is sent as a turn.

    \b
    Keys:
      Ctrl-D      detach (the session keeps running); Ctrl-] then Enter too
      Ctrl-C      cancel the running turn (never the session)
      /approve once|session|always, /deny   answer an approval request

    \b
    Examples:
      hermes-sup attach alice
      hermes-sup attach alice --read-only
    """
    from .attach import Attached

    key = session
    with connect(ctx) as client:
        client.sessions()  # fail now, with a clear message, if the supervisor is not there
        code = Attached(client, key, read_only, use_color(ctx)).run(replay)
    sys.exit(code)


@cli.command()
@click.pass_context
def reload(ctx: click.Context) -> None:
    """Re-read the supervisor's --config file (as SIGHUP does).

    New sessions get the new settings; running ones keep theirs until they
    restart. An invalid file is refused and the old settings stay in force.

    \b
    Example:
      hermes-sup reload
    """
    with connect(ctx) as client:
        body = client.request(Kind.RELOAD).body
    click.echo("reloaded; changed: " + (", ".join(body["changed"]) or "nothing"))
    if body["restart_needed"]:
        click.echo("needs a restart to change: " + ", ".join(body["restart_needed"]))


@cli.group()
def config() -> None:
    """Check configuration files."""


@config.command(name="check")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
def config_check(file: Path) -> None:
    """Check FILE as `serve --config` would, without starting anything.

    \b
    Example:
      hermes-sup config check /etc/hermes-sup/config.toml
    """
    from hermes_sup.supervisor import configfile

    try:
        values = configfile.load(file)
    except configfile.ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"{file}: ok ({len(values)} setting(s))")


DATA_DIR = click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    envvar=DATA_DIR_ENV,
    default=None,
    help=f"The supervisor's data directory [env {DATA_DIR_ENV}; default as for serve].",
)


@cli.group()
def keys() -> None:
    """CURVE keys of remote front ends (serve --tcp).

    The allowlist is read at every connection: changes need no restart.
    """


@keys.command(name="generate")
@click.argument("name")
@click.option(
    "--endpoint",
    required=True,
    help="HOST:PORT the front end will connect to (the address of serve --tcp).",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Where to write the connection file [default: NAME.json here].",
)
@DATA_DIR
def keys_generate(name: str, endpoint: str, output: Path | None, data_dir: Path | None) -> None:
    """Make a key pair for the front end NAME, allow it, and write its
    connection file (0600: it holds secrets; copy it to the front end's host).

    \b
    Example:
      hermes-sup keys generate web-eu --endpoint hs.internal:7788
      # on the front end: Client.from_connection_file("web-eu.json")
    """
    import zmq

    from hermes_sup.client.connection import write_connection_file
    from hermes_sup.supervisor import remote

    data = data_dir or default_data_dir()
    output = output or Path(f"{name}.json")
    try:
        host, port = remote.parse_tcp(endpoint)
        server_public, _ = remote.server_keys(data)
        public, secret = zmq.curve_keypair()
        if output.exists():
            raise remote.RemoteError(f"{output} exists; choose another --output")
        remote.allow(data, name, public)
        write_connection_file(
            output,
            remote.tcp_endpoint(host, port),
            remote.remote_hmac_key(data),
            server_public.decode(),
            public.decode(),
            secret.decode(),
        )
    except (remote.RemoteError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"allowed {name} ({public.decode()})\nwrote {output}")


@keys.command(name="list")
@DATA_DIR
def keys_list(data_dir: Path | None) -> None:
    """The allowed front ends and their public keys."""
    from hermes_sup.supervisor import remote

    clients = remote.allowed(data_dir or default_data_dir())
    if not clients:
        click.echo("no remote front ends are allowed")
    for name, public in clients.items():
        click.echo(f"{name}  {public.decode()}")


@keys.command(name="revoke")
@click.argument("name")
@DATA_DIR
def keys_revoke(name: str, data_dir: Path | None) -> None:
    """Refuse the front end NAME from its next connection on."""
    from hermes_sup.supervisor import remote

    try:
        found = remote.revoke(data_dir or default_data_dir(), name)
    except remote.RemoteError as exc:
        raise click.ClickException(str(exc)) from None
    if not found:
        raise click.ClickException(f"no front end named {name!r} is allowed")
    click.echo(f"revoked {name}")


@cli.command(name="install-service")
@click.option(
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("/etc/systemd/system/hermes-sup.service"),
    show_default=True,
    help="Where to write the unit file.",
)
@click.option(
    "--user",
    default="hermes-sup",
    show_default=True,
    help="The dedicated user the service runs as.",
)
def install_service(output: Path, user: str) -> None:
    """Write a systemd unit (Type=notify, hardened) for this install.

    It runs `hermes-sup serve` as a dedicated user, with sockets in
    /run/hermes-sup and sessions in /var/lib/hermes-sup (both 0700), and
    KillMode=control-group so no worker outlives the service.

    \b
    Example:
      sudo hermes-sup install-service
      sudo useradd --system --no-create-home hermes-sup
      sudo systemctl daemon-reload && sudo systemctl enable --now hermes-sup
    """
    from .service import render

    exe = Path(sys.argv[0]).resolve() if Path(sys.argv[0]).name == "hermes-sup" else None
    exec_start = str(exe) if exe else f"{Path(sys.executable).resolve()} -m hermes_sup.cli"
    try:
        output.write_text(render(exec_start, user))
    except OSError as exc:
        raise click.ClickException(f"cannot write {output}: {exc}") from None
    click.echo(
        f"wrote {output}\nnext:\n"
        f"  useradd --system --no-create-home --shell /usr/sbin/nologin {user}\n"
        "  systemctl daemon-reload\n  systemctl enable --now hermes-sup\n"
        "  HERMES_SUP_STATE_DIR=/run/hermes-sup hermes-sup status"
    )


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="hermes-sup")


if __name__ == "__main__":
    main()
