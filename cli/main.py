"""The `hermes-sup` command line: serve, and a thin client for everything else.

Exit codes: 0 ok, 1 error, 2 usage, 3 supervisor not running.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from hermes_sup.protocol import Kind
from hermes_sup.supervisor.config import (
    DATA_DIR_ENV,
    DEFAULT_PASS_ENV,
    STATE_DIR_ENV,
    Settings,
    default_data_dir,
    default_state_dir,
)

from .client import Client, ClientError, NotRunning, SupervisorError

EXIT_NOT_RUNNING = 3


class NotRunningError(click.ClickException):
    """The supervisor is not running: exit 3 with how to start it."""

    exit_code = EXIT_NOT_RUNNING


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
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
    """hermes-sup: one real process per agent session, routed over ZeroMQ."""
    ctx.obj = {"state_dir": state_dir or default_state_dir(), "timeout": timeout}


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
        "--idle-timeout",
        "idle_timeout",
        float,
        "Stop sessions idle this many seconds [default: never].",
    ),
    ("--turn-timeout", "turn_timeout", float, "Cancel turns running longer [default: no limit]."),
    ("--heartbeat-timeout", "heartbeat_timeout", float, "A worker silent this long is hung [10]."),
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
]
OPTIONAL = {
    "max_sessions",
    "idle_timeout",
    "turn_timeout",
    "memory_limit_mb",
    "max_procs",
    "max_open_files",
    "cpu_seconds",
}


def _tunable_type(field: str, kind: Any) -> click.ParamType:
    class Tunable(click.ParamType):
        name = kind.__name__

        def convert(self, value: Any, param: Any, ctx: Any) -> Any:
            if isinstance(value, str) and value.lower() == "none" and field in OPTIONAL:
                return None
            try:
                number = kind(value)
            except (TypeError, ValueError):
                self.fail(f"{value!r} is not a number", param, ctx)
            if number < 0:
                self.fail(f"{value!r} is negative", param, ctx)
            if number == 0 and field in OPTIONAL:
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
@click.pass_context
def serve(
    ctx: click.Context,
    data_dir: Path | None,
    runtime: str,
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
    from hermes_sup.supervisor.server import Supervisor
    from hermes_sup.supervisor.statedir import StateDirError

    logging.basicConfig(
        level=log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    settings = Settings(
        state_dir=ctx.obj["state_dir"],
        data_dir=data_dir or default_data_dir(),
        runtime=runtime,
        preload=preload,
        pass_env=DEFAULT_PASS_ENV + pass_env,
        env=_parse_pairs(env_pairs, "--env"),
        max_frame_size=max_frame_size,
        stop_timeout=stop_timeout,
        max_queue=max_queue,
        log_level=log_level,
    )
    for field, value in tuned.items():
        if (
            value is not None
            or ctx.get_parameter_source(field) is click.core.ParameterSource.COMMANDLINE
        ):
            setattr(settings, field, value)
    try:
        code = Supervisor(settings).run()
    except StateDirError as exc:
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
        f"hermes-sup {info['version']} pid {info['pid']} up {info['uptime']:.1f}s "
        f"(answered in {took:.1f} ms)"
    )


@cli.command()
@click.argument("session")
@click.argument("text")
@click.option(
    "--session-env",
    "session_env",
    multiple=True,
    help="NAME=VALUE given to a new worker as HERMES_SESSION_NAME (repeat).",
)
@click.option("--turn-timeout", type=float, default=None, help="Give up after this many seconds.")
@click.pass_context
def send(
    ctx: click.Context,
    session: str,
    text: str,
    session_env: tuple[str, ...],
    turn_timeout: float | None,
) -> None:
    """Send TEXT to SESSION, print its streamed output, then its reply.

    \b
    Examples:
      hermes-sup send alice 'setenv COLOR blue'
      hermes-sup send alice 'sh echo $COLOR; pwd'
    """
    options: dict[str, Any] | None = None
    if session_env:
        options = {"session_env": _parse_pairs(session_env, "--session-env")}
    with connect(ctx) as client:
        for msg in client.send(session, text, options=options, turn_timeout=turn_timeout):
            if msg.kind is Kind.EVENT:
                _print_event(msg.body)
            elif msg.kind is Kind.REPLY:
                click.echo(msg.body["text"])


def _print_event(body: dict[str, Any]) -> None:
    kind, data = body.get("type"), body.get("data")
    if kind == "output":
        click.echo(str(data))
    elif kind == "token":
        click.echo(str(data), nl=False)


@cli.command(name="list")
@click.option(
    "--json", "as_json", is_flag=True, help="Print a JSON array (times in epoch seconds)."
)
@click.option("--prefix", default="", help="Only sessions whose key starts with this.")
@click.option("--state", default=None, help="Only sessions in this state.")
@click.pass_context
def list_(ctx: click.Context, as_json: bool, prefix: str, state: str | None) -> None:
    """List sessions.

    \b
    Example:
      hermes-sup list --json
    """
    with connect(ctx) as client:
        rows = client.sessions(prefix=prefix, state=state)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    now = time.time()
    click.echo(f"{'SESSION':<32} {'STATE':<9} {'PID':>7} {'UPTIME':>8} {'IDLE':>8} {'TURNS':>6}")
    for r in rows:
        key = r["key"] if len(r["key"]) <= 32 else r["key"][:31] + "~"
        up = _duration(now - r["started"]) if r["pid"] and r["started"] else "-"
        click.echo(
            f"{key:<32} {r['state']:<9} {r['pid'] or '-':>7} {up:>8} "
            f"{_duration(now - r['last_activity']):>8} {r['turns']:>6}"
        )
    click.echo(f"{len(rows)} session(s)")


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


@cli.command()
@click.argument("session")
@click.option("--force", is_flag=True, help="SIGKILL at once instead of asking the worker to stop.")
@click.pass_context
def kill(ctx: click.Context, session: str, force: bool) -> None:
    """Kill SESSION's worker and every process it started. Its data stays.

    \b
    Example:
      hermes-sup kill alice
    """
    with connect(ctx) as client:
        result = client.kill(session, force=force)
    pid = result.get("pid")
    click.echo(f"{session}: {result['reason']}" + (f" (pid {pid})" if pid else ""))


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="hermes-sup")


if __name__ == "__main__":
    main()
