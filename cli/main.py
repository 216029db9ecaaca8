"""The `hermes-sup` command group and its client commands, each a thin
client of the running supervisor: ping, send, cancel, approve, open (start),
restart, signal, list, status, inspect, kill, logs, attach, events, reload
and shutdown. Other commands live beside this module and are added to the
group here: serve and config (serve.py), keys (keys.py), install-service
(service.py), http and keys http (http.py). send.py runs a turn, attach.py
an attached terminal, show.py and terminal.py shape what is printed,
options.py holds the options every client command takes, complete.py shell
completion, logfiles.py logs read from disk.

Exit codes: 0 ok, 1 error, 2 usage, 3 supervisor not running, 130 a turn
cancelled with Ctrl-C.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

import click

from hermes_sup.client import (
    Client,
    ClientError,
    NotRunning,
    SupervisorError,
    Timeout,
    session_options,
)
from hermes_sup.protocol import Kind
from hermes_sup.supervisor.config import DATA_DIR_ENV, STATE_DIR_ENV, default_data_dir

from . import complete
from .http import http, http_keys
from .keys import keys
from .options import (
    CONNECTION_ENV,
    CONNECTION_HELP,
    DEFAULT_TIMEOUT,
    SECONDS,
    STATE_DIR_HELP,
    TIMEOUT_HELP,
    client_options,
    init_obj,
    state_dir_option,
)
from .serve import config, parse_pairs, serve
from .service import install_service
from .show import (
    STATE_ORDER,
    duration,
    format_rows,
    inspect_lines,
    session_table,
    size,
    sort_rows,
    use_color,
)
from .terminal import Screen, is_terminal, neutralize

EXIT_NOT_RUNNING = 3
EXIT_INTERRUPTED = 130


class NotRunningError(click.ClickException):
    """The supervisor is not running: exit 3 with how to start it."""

    exit_code = EXIT_NOT_RUNNING


def _version() -> str:
    try:
        return metadata.version("hermes-sup")
    except metadata.PackageNotFoundError:
        return "0+unknown"


complete.install()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, readable=False, path_type=Path),
    envvar=STATE_DIR_ENV,
    help=STATE_DIR_HELP,
)
@click.option("--timeout", type=SECONDS, default=DEFAULT_TIMEOUT, help=TIMEOUT_HELP)
@click.option(
    "--connection",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar=CONNECTION_ENV,
    default=None,
    help=CONNECTION_HELP,
)
@click.version_option(_version(), "--version", "-V", prog_name="hermes-sup")
@click.pass_context
def cli(
    ctx: click.Context, state_dir: Path | None, timeout: float, connection: Path | None
) -> None:
    """hermes-sup: one real process per agent session, routed over ZeroMQ.

    --state-dir, --timeout and --connection may also follow the command's
    name (hermes-sup list --state-dir D).

    \b
    Exit codes: 0 ok, 1 error, 2 usage, 3 supervisor not running,
    130 a turn cancelled with Ctrl-C.
    Completion: eval "$(_HERMES_SUP_COMPLETE=bash_source hermes-sup)"
    """
    init_obj(ctx, state_dir, timeout, connection)


cli.add_command(serve)
# serve --state-dir works as hermes-sup --state-dir serve does.
serve.params.append(state_dir_option())
cli.add_command(config)
cli.add_command(keys)
cli.add_command(install_service)
cli.add_command(http)
keys.add_command(http_keys)


def _one_line(exc: BaseException) -> str:
    """An error for stderr: one line, with any control character a session
    put in it made visible on a terminal."""
    text = str(exc)
    return neutralize(text) if is_terminal(sys.stderr) else text


def start_hint(ctx: click.Context) -> str:
    """`hermes-sup [--state-dir D]`: the start of a command to suggest."""
    if ctx.obj.get("connection") is not None:
        return f"hermes-sup --connection {shlex.quote(str(ctx.obj['connection']))}"
    if ctx.obj.get("state_dir_given"):
        return f"hermes-sup --state-dir {shlex.quote(str(ctx.obj['state_dir']))}"
    return "hermes-sup"


@contextmanager
def connect(ctx: click.Context) -> Iterator[Client]:
    """A client for the command, with errors turned into one-line messages."""
    state_dir: Path = ctx.obj["state_dir"]
    connection: Path | None = ctx.obj.get("connection")
    try:
        if connection is not None:
            client = Client.from_connection_file(connection, timeout=ctx.obj["timeout"])
        else:
            client = Client(state_dir, timeout=ctx.obj["timeout"])
    except NotRunning as exc:
        raise NotRunningError(
            f"{exc}. Start it with: hermes-sup --state-dir {shlex.quote(str(state_dir))} serve"
        ) from None
    except ClientError as exc:  # permission denied, a bad connection file
        raise click.ClickException(_one_line(exc)) from None
    try:
        yield client
    except NotRunning as exc:
        raise NotRunningError(_one_line(exc)) from None
    except SupervisorError as exc:
        raise click.ClickException(_one_line(exc)) from None
    except ClientError as exc:
        raise click.ClickException(_one_line(exc)) from None
    finally:
        client.close()


def complete_sessions(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[Any]:
    """Shell completion of session keys, asked of the running supervisor."""
    from click.shell_completion import CompletionItem

    obj = ctx.obj if isinstance(ctx.obj, dict) else {}
    state_dir = obj.get("state_dir") or ctx.find_root().params.get("state_dir")
    try:
        with Client(Path(state_dir) if state_dir else None, timeout=1.0) as client:
            rows = client.sessions(prefix=incomplete)
    except Exception:
        return []
    return [CompletionItem(r["key"], help=r["state"]) for r in rows]


SESSION = click.argument("session", shell_complete=complete_sessions)
RAW = click.option(
    "--raw",
    is_flag=True,
    help="Write the session's output byte-exact even to a terminal (control sequences "
    "and all); by default they are shown escaped on a terminal.",
)


def _options(
    session_env: tuple[str, ...], workspace: str | None, runtime: str | None
) -> dict[str, Any] | None:
    return session_options(
        session_env=parse_pairs(session_env, "--session-env") if session_env else None,
        workspace=str(Path(workspace).absolute()) if workspace else None,
        runtime=runtime,
    )


def new_session_options(func: Any) -> Any:
    """--session-env, --workspace, --runtime: options of a session's new worker."""
    func = click.option(
        "--runtime", default=None, help="A runtime the supervisor allows (--allow-runtime)."
    )(func)
    func = click.option(
        "--workspace",
        default=None,
        help="Work in this directory (under one of the supervisor's --workspace-root).",
    )(func)
    return click.option(
        "--session-env",
        "session_env",
        multiple=True,
        help="NAME=VALUE given to a new worker as HERMES_SESSION_NAME (repeat).",
    )(func)


# ------------------------------------------------------------------ ping


@client_options
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


# ------------------------------------------------------------------ turns


@client_options
@cli.command()
@SESSION
@click.argument("text")
@new_session_options
@click.option(
    "--turn-timeout",
    type=SECONDS,
    default=None,
    help="Cancel the turn and give up after this many seconds.",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print every event, then the reply, as JSON lines."
)
@RAW
@click.pass_context
def send(
    ctx: click.Context,
    session: str,
    text: str,
    session_env: tuple[str, ...],
    workspace: str | None,
    runtime: str | None,
    turn_timeout: float | None,
    as_json: bool,
    raw: bool,
) -> None:
    """Send TEXT to SESSION, print its streamed output, then its reply.

    What the turn does besides (queued, tools, retries) shows on stderr. An
    approval request is asked at the terminal (once, session, deny); without
    one, send says how to answer (hermes-sup approve) and exits 1 if nobody
    did in time. Ctrl-C cancels the turn (never the session) and exits 130.

    Options for a new session (--session-env, --workspace, --runtime) apply
    when its worker starts; a running session with other options refuses.

    \b
    Examples:
      hermes-sup send alice 'setenv COLOR blue'
      hermes-sup send alice 'sh echo $COLOR; pwd'
      hermes-sup send alice 'ask touch x'          # asks you to approve
      hermes-sup send bob --workspace /srv/projects/acme 'sh ls'
    """
    from .send import Sender

    options = _options(session_env, workspace, runtime)
    body: dict[str, Any] = {"text": text}
    if options:
        body["options"] = options
    with connect(ctx) as client:
        code = Sender(
            client=client,
            key=session,
            body=body,
            screen=Screen(raw),
            interactive=is_terminal(sys.stdin) and not as_json,
            as_json=as_json,
            turn_timeout=turn_timeout,
            hint_prefix=start_hint(ctx),
        ).run()
    sys.exit(code)


@client_options
@cli.command()
@SESSION
@click.option("--turn", default=None, help="Cancel this queued turn (its send id) instead.")
@click.pass_context
def cancel(ctx: click.Context, session: str, turn: str | None) -> None:
    """Cancel SESSION's running turn (the session keeps running).

    The turn's own client gets its end (a reply or an error) as usual.

    \b
    Examples:
      hermes-sup cancel alice
    """
    with connect(ctx) as client:
        cancelled = client.cancel(session, turn)
    if cancelled is None:
        raise click.ClickException(
            f"session {session!r} has no "
            + ("such queued turn" if turn else "running turn")
            + " to cancel"
        )
    click.echo(f"{session}: cancelled turn {cancelled}")


@client_options
@cli.command()
@SESSION
@click.argument("choice", type=click.Choice(["once", "session", "always", "deny"]))
@click.option(
    "--id",
    "approval",
    default=None,
    help="Answer only this request (the id send and attach show), never a later one.",
)
@click.pass_context
def approve(ctx: click.Context, session: str, choice: str, approval: str | None) -> None:
    """Answer SESSION's waiting approval request: once, session, always or deny.

    Without --id it answers the oldest request waiting.

    \b
    Examples:
      hermes-sup approve alice once
      hermes-sup approve alice deny --id probe-3
    """
    with connect(ctx) as client:
        answered = client.approve(session, choice, approval=approval)
    click.echo(f"{session}: answered {answered}")


# ------------------------------------------------------------------ lifecycle


@client_options
@cli.command(name="open")
@SESSION
@new_session_options
@click.option("--json", "as_json", is_flag=True, help="Print the answer as JSON.")
@click.pass_context
def open_(
    ctx: click.Context,
    session: str,
    session_env: tuple[str, ...],
    workspace: str | None,
    runtime: str | None,
    as_json: bool,
) -> None:
    """Start SESSION's worker without sending a turn (also: start).

    A session that does not exist yet is created, with the options given.

    \b
    Examples:
      hermes-sup open alice
      hermes-sup start tg:42 --session-env platform=telegram --session-env chat_id=42
    """
    options = _options(session_env, workspace, runtime)
    with connect(ctx) as client:
        opened = client.open(session, options=options)
    if as_json:
        click.echo(json.dumps({"key": session, **opened.__dict__}))
        return
    what = "created and started" if opened.created else f"already {opened.state}"
    click.echo(f"{session}: {what}" + (f" (pid {opened.pid})" if opened.pid else ""))


cli.add_command(open_, name="start")


@client_options
@cli.command()
@click.argument("sessions", nargs=-1, required=True, shell_complete=complete_sessions)
@click.option("--force", is_flag=True, help="SIGKILL the old worker at once.")
@click.pass_context
def restart(ctx: click.Context, sessions: tuple[str, ...], force: bool) -> None:
    """Stop SESSIONS' workers (as kill does) and start fresh ones on the same data.

    A running turn ends with session_killed; queued ones fail likewise.

    \b
    Examples:
      hermes-sup restart alice
    """
    failed = 0
    with connect(ctx) as client:
        for key in sessions:
            try:
                killed = client.kill(key, force=force, timeout=max(ctx.obj["timeout"], 120.0))
                opened = client.open(key)
            except SupervisorError as exc:
                failed += 1
                click.echo(f"{key}: {_one_line(exc)}", err=True)
                continue
            old = f" (pid {killed.pid})" if killed.pid else ""
            click.echo(f"{key}: {killed.reason}{old}; started pid {opened.pid or '?'}")
    if failed:
        sys.exit(1)


@client_options
@cli.command(name="signal")
@click.argument("sig", metavar="SIGNAL")
@SESSION
@click.option("--group", is_flag=True, help="Signal the worker's whole process group.")
@click.pass_context
def signal_(ctx: click.Context, sig: str, session: str, group: bool) -> None:
    """Send SIGNAL (HUP, TERM, USR1, ... or a number) to SESSION's worker.

    What follows goes the usual way: a worker that dies of it is restarted
    by the session's next turn.

    \b
    Examples:
      hermes-sup signal USR1 alice
      hermes-sup signal INT alice --group
    """
    with connect(ctx) as client:
        done = client.signal(session, sig, group=group)
    click.echo(f"{session}: sent {done.signal} to pid {done.pid}" + (" (group)" if group else ""))


# ------------------------------------------------------------------ observing


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


def _list_lines(
    ctx: click.Context,
    rows: list[dict[str, Any]],
    quiet: bool,
    template: str | None,
    no_trunc: bool,
) -> list[str]:
    if quiet:
        return [r["key"] for r in sort_rows(rows)]
    if template is not None:
        return format_rows(template, sort_rows(rows))
    width = None
    if is_terminal(sys.stdout) and not no_trunc:
        try:  # the terminal's own size, over a COLUMNS that may be stale
            width = os.get_terminal_size(sys.stdout.fileno()).columns
        except OSError:
            width = shutil.get_terminal_size().columns
    return session_table(rows, use_color(ctx), time.time(), width)


@client_options
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
@click.option("-q", "--quiet", is_flag=True, help="Only the keys, one a line.")
@click.option(
    "--format",
    "template",
    default=None,
    metavar="TEMPLATE",
    help="A line per session from a template over the JSON fields: '{key} {state} {pid}' "
    "(Python format specs, \\t a tab); 'json' for one JSON object a line.",
)
@click.option("--no-trunc", is_flag=True, help="Never cut keys to fit the terminal.")
@click.option("-w", "--watch", is_flag=True, help="Redraw every --interval seconds until Ctrl-C.")
@click.option(
    "--interval", type=SECONDS, default=2.0, show_default=True, help="Seconds between redraws."
)
@click.pass_context
def list_(
    ctx: click.Context,
    as_json: bool,
    prefix: str,
    state: str | None,
    quiet: bool,
    template: str | None,
    no_trunc: bool,
    watch: bool,
    interval: float,
) -> None:
    """List sessions: state, pid, uptime, idle time, turns, memory and CPU.

    Memory (RSS) and CPU% are of the worker and everything it started, sampled
    when you ask (CPU% since the previous list, or since the worker started).
    The key column is as wide as the longest key; on a narrower terminal keys
    are cut in the middle (…), unless --no-trunc.

    \b
    JSON fields: key, state, pid (or null), started and last_activity (epoch
    seconds), turns, queued, exits, last_exit, fast_failures, runtime,
    rss (bytes), procs, cpu_percent.

    \b
    Examples:
      hermes-sup list
      hermes-sup list --state busy
      hermes-sup list -q --prefix telegram:
      hermes-sup list --format '{key}\t{state}\t{rss}'
      hermes-sup list --json --prefix telegram:
      hermes-sup list --watch
    """
    if sum([as_json, quiet, template is not None]) > 1:
        raise click.UsageError("choose one of --json, -q and --format")
    clear = watch and is_terminal(sys.stdout)
    with connect(ctx) as client:
        first = True
        try:
            while True:
                rows = client.sessions(prefix=prefix, state=state)
                if as_json:
                    text = json.dumps(rows, indent=None if watch else 2)
                else:
                    text = "\n".join(_list_lines(ctx, rows, quiet, template, no_trunc))
                if clear:
                    stamp = time.strftime("%H:%M:%S")
                    click.echo("\x1b[H\x1b[2J", nl=False)
                    click.echo(f"every {interval:g}s, {stamp}; Ctrl-C stops\n")
                elif watch and not first and not as_json:
                    click.echo()
                if text:
                    click.echo(text)
                if not watch:
                    return
                first = False
                time.sleep(interval)
        except KeyboardInterrupt:
            return  # the way out of --watch


@client_options
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


@client_options
@cli.command()
@SESSION
@click.option("--json", "as_json", is_flag=True, help="Print every field as JSON.")
@click.pass_context
def inspect(ctx: click.Context, session: str, as_json: bool) -> None:
    """Show one session in full: its directories (data, workspace, home), log
    files, options, the names (never the values) of its worker's environment
    variables, pid, state history and last exit.

    \b
    Examples:
      hermes-sup inspect alice
      hermes-sup inspect alice --json
    """
    with connect(ctx) as client:
        info = client.inspect(session)
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    screen = Screen()
    for line in inspect_lines(info, time.time()):
        screen.out(line)


@client_options
@cli.command()
@click.argument("session", required=False, shell_complete=complete_sessions)
@click.option("--json", "as_json", is_flag=True, help="One JSON object a line.")
@click.option("--replay", default=0, show_default=True, help="Recent events to show first.")
@RAW
@click.pass_context
def events(ctx: click.Context, session: str | None, as_json: bool, replay: int, raw: bool) -> None:
    """Print the live events of SESSION, or of every session, until Ctrl-C:
    state changes, turns from any client, what they stream, their ends.

    \b
    Examples:
      hermes-sup events
      hermes-sup events alice --json
    """
    from .send import event_json, short

    screen = Screen(raw)
    with connect(ctx) as client:
        stream = client.watch(session, replay=max(0, replay))
        try:
            for event in stream:
                if as_json:
                    item = event_json(event)
                    if event.type == "state":
                        del item["turn"]  # a change of state belongs to no turn
                    item["time"] = time.time()
                    click.echo(json.dumps(item, default=str), color=True)
                    continue
                data = event.data
                if event.type == "state" and isinstance(data, dict):
                    text = f"{data.get('previous')} -> {data.get('state')}"
                    if data.get("reason"):
                        text += f" ({data['reason']})"
                elif event.type in ("output", "token") and isinstance(data, str):
                    text = data
                else:
                    text = short(data, 200)
                stamp = time.strftime("%H:%M:%S")
                screen.out(f"{stamp} {event.session or '-'} {event.type} {text}")
        except KeyboardInterrupt:
            pass
        finally:
            stream.close()


# ------------------------------------------------------------------ stopping


@client_options
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


@client_options
@cli.command()
@SESSION
@click.option("-n", "--lines", default=50, show_default=True, help="Lines to show from the end.")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines (across rotation).")
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Read the log from this data directory, without the supervisor (it may be down); "
    f"'-' for the default one [env {DATA_DIR_ENV}].",
)
@RAW
@click.pass_context
def logs(
    ctx: click.Context, session: str, lines: int, follow: bool, data_dir: Path | None, raw: bool
) -> None:
    """Print a session's worker log (its stdout and stderr).

    With --data-dir it is read from disk, so it works with the supervisor
    down (hermes-sup inspect names a session's directory).

    \b
    Examples:
      hermes-sup logs alice -n 100
      hermes-sup logs alice -f
      hermes-sup logs alice --data-dir /var/lib/hermes-sup
    """
    screen = Screen(raw)
    if data_dir is not None:
        _logs_from_disk(screen, session, lines, follow, data_dir)
        return
    with connect(ctx) as client:
        req = client.submit(Kind.LOGS, {"lines": max(0, lines), "follow": follow}, session=session)
        first = client.answer(req)
        for line in first.body["lines"]:
            screen.out(line)
        if not follow:
            return
        try:
            while True:
                try:
                    msg = client.answer(req, timeout=1.0)
                except Timeout:
                    continue  # a supervisor that went away raises NotRunning instead
                if msg.body.get("type") == "log":
                    screen.out(msg.body["data"])
        except KeyboardInterrupt:
            client.submit(Kind.UNWATCH, {"watch": req})


def _logs_from_disk(screen: Screen, key: str, lines: int, follow: bool, data_dir: Path) -> None:
    from hermes_sup.protocol import RemoteProtocolError, check_session_key

    from .logfiles import follow as follow_file
    from .logfiles import session_log, tail

    try:
        check_session_key(key)
    except RemoteProtocolError as exc:
        raise click.BadParameter(exc.message, param_hint="SESSION") from None
    if str(data_dir) == "-":
        data_dir = default_data_dir()
    path = session_log(data_dir, key)
    if not path.parent.is_dir():
        if not (data_dir / "sessions").is_dir():
            raise click.ClickException(
                f"{data_dir} holds no sessions: is it the supervisor's --data-dir?"
            )
        raise click.ClickException(f"no session {key!r} in {data_dir} (no {path.parent})")
    try:
        for line in tail(path, max(0, lines)):
            screen.out(line)
        if follow:
            for line in follow_file(path):
                screen.out(line)
    except KeyboardInterrupt:
        pass
    except PermissionError as exc:
        raise click.ClickException(
            f"permission denied reading {exc.filename}: run this as the supervisor's user"
        ) from None


@client_options
@cli.command()
@SESSION
@click.option(
    "--read-only", is_flag=True, help="Only watch: nothing typed is sent, Ctrl-C detaches."
)
@click.option("--create", is_flag=True, help="Start SESSION if it does not exist yet.")
@click.option("--replay", default=50, show_default=True, help="Recent events to show first.")
@RAW
@click.pass_context
def attach(
    ctx: click.Context, session: str, read_only: bool, create: bool, replay: int, raw: bool
) -> None:
    """Watch SESSION live and talk to it, like tmux attach.

    Shows the session's recent events, then everything it produces, including
    turns sent by other clients. Each line you type is sent as a turn. A key
    the supervisor does not know is refused unless --create.

    \b
    Keys:
      Ctrl-D      detach (the session keeps running); Ctrl-] then Enter too
      Ctrl-C      cancel the running turn (never the session); read-only: detach
      /approve once|session|always, /deny   answer an approval request

    \b
    Examples:
      hermes-sup attach alice
      hermes-sup attach alice --read-only
      hermes-sup attach tg:42 --create
      hermes-sup attach alice --connection web-eu.json
    """
    from .attach import Attached

    if create and read_only:
        raise click.UsageError("--create starts a session; a --read-only attach changes nothing")
    key = session
    with connect(ctx) as client:
        # Also fails now, with a clear message, if the supervisor is not there.
        known = any(r["key"] == key for r in client.sessions(prefix=key))
        if not known:
            if not create:
                raise click.ClickException(
                    f"no session {key!r} (`{start_hint(ctx)} list` shows them); "
                    f"to start it, use: {start_hint(ctx)} attach --create {shlex.quote(key)}"
                )
            client.open(key)
        code = Attached(client, key, read_only, use_color(ctx), Screen(raw)).run(replay)
    sys.exit(code)


# ------------------------------------------------------------------ service


@client_options
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


@client_options
@cli.command()
@click.option(
    "--wait/--no-wait",
    default=True,
    show_default=True,
    help="Return once the supervisor has stopped.",
)
@click.pass_context
def shutdown(ctx: click.Context, wait: bool) -> None:
    """Stop the supervisor gracefully, with the same stages as SIGTERM: no
    new turns, running ones get the shutdown grace period, then every
    worker is stopped. Local only: a remote front end cannot.

    \b
    Example:
      hermes-sup shutdown
    """
    with connect(ctx) as client:
        running = sum(1 for r in client.sessions() if r["state"] == "busy")
        info = client.shutdown()
        click.echo(
            f"shutting down pid {info['pid']}: no new turns; {running} running turn(s) get up "
            f"to {info['grace']:g}s, then every worker is stopped"
        )
        if not wait:
            return
        started = time.monotonic()
        said = 0.0
        while client.connection.alive() is not False:
            waited = time.monotonic() - started
            if waited - said >= 5:
                said = waited
                click.echo(f"still stopping ({waited:.0f}s)...", err=True)
            time.sleep(0.1)
    click.echo("stopped")


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="hermes-sup")


if __name__ == "__main__":
    main()
