"""The `hermes-sup` command group and its client commands: ping, send, list,
status, kill, logs, attach and reload, each a thin client of the running
supervisor. Other commands live beside this module and are added to the
group here: serve and config (serve.py), keys (keys.py), install-service
(service.py), http and keys http (http.py); show.py formats what the client
commands print.

Exit codes: 0 ok, 1 error, 2 usage, 3 supervisor not running.
"""

from __future__ import annotations

import json
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
from hermes_sup.supervisor.config import STATE_DIR_ENV, default_state_dir

from .http import http, http_keys
from .keys import keys
from .serve import config, parse_pairs, serve
from .service import install_service
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


cli.add_command(serve)
cli.add_command(config)
cli.add_command(keys)
cli.add_command(install_service)
cli.add_command(http)
keys.add_command(http_keys)


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
        session_env=parse_pairs(session_env, "--session-env") if session_env else None,
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


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="hermes-sup")


if __name__ == "__main__":
    main()
