"""Commands that manage sessions and their workers: open (start),
restart, signal, list, inspect and kill (logs: logs.py).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import click

from hermes_sup.client import (
    SupervisorError,
)
from hermes_sup.protocol import Kind

from .common import (
    SESSION,
    complete_sessions,
    connect,
    new_session_options,
    one_line,
    options_from,
    parse_duration,
)
from .options import (
    SECONDS,
    client_options,
)
from .show import (
    STATE_ORDER,
    format_rows,
    inspect_lines,
    session_table,
    sort_rows,
    use_color,
)
from .terminal import Screen, is_terminal


@client_options
@click.command(name="open")
@SESSION
@new_session_options
@click.option(
    "--label",
    default=None,
    help="A text shown with the session in list and inspect (at most 200 characters).",
)
@click.option(
    "--repo",
    default=None,
    help="Work in a repository of its own made from this git repository, on a branch of "
    "its own (under one of the supervisor's --repo-root).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the answer as JSON.")
@click.pass_context
def open_(
    ctx: click.Context,
    session: str,
    session_env: tuple[str, ...],
    workspace: str | None,
    runtime: str | None,
    label: str | None,
    repo: str | None,
    as_json: bool,
) -> None:
    """Start SESSION's worker without sending a turn (also: start).

    A session that does not exist yet is created, with the options given.

    \b
    Examples:
      hermes-sup open alice
      hermes-sup start tg:42 --session-env platform=telegram --session-env chat_id=42
      hermes-sup open h:3f9a2c --label 'conversation 8c1e-long-original-id'
      hermes-sup open fix-login --repo ~/src/webapp
    """
    options = options_from(session_env, workspace, runtime)
    if label is not None:
        options = {**(options or {}), "label": label}
    if repo is not None:
        options = {**(options or {}), "repo": str(Path(repo).absolute())}
    with connect(ctx) as client:
        opened = client.open(session, options=options)
    if as_json:
        click.echo(json.dumps({"key": session, **opened.__dict__}))
        return
    what = "created and started" if opened.created else f"already {opened.state}"
    click.echo(f"{session}: {what}" + (f" (pid {opened.pid})" if opened.pid else ""))


@client_options
@click.command()
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
                click.echo(f"{key}: {one_line(exc)}", err=True)
                continue
            old = f" (pid {killed.pid})" if killed.pid else ""
            click.echo(f"{key}: {killed.reason}{old}; started pid {opened.pid or '?'}")
    if failed:
        sys.exit(1)


def _signal_name(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    """A signal this host knows, or a usage error (exit 2) before connecting."""
    from hermes_sup.protocol.exits import signal_named

    try:
        signal_named(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    return value


@client_options
@click.command(name="signal")
@click.argument("sig", metavar="SIGNAL", callback=_signal_name)
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
@click.command(name="list")
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
@click.option(
    "--repo",
    default=None,
    metavar="PATH",
    help="Only sessions working on this git repository (each in a repository of its own).",
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
    repo: str | None,
    quiet: bool,
    template: str | None,
    no_trunc: bool,
    watch: bool,
    interval: float,
) -> None:
    """List sessions: state, pid, uptime, idle time, turns, memory and CPU.

    Memory (RSS) and CPU% are of the worker and everything it started, sampled
    when you ask (CPU% since the previous list, or since the worker started).
    The memory limit (serve --memory-limit) counts the tree's PSS instead,
    shared pages once: a tree's RSS here may be over its limit.
    The key column is as wide as the longest key; on a narrower terminal keys
    are cut in the middle (…), unless --no-trunc.

    \b
    JSON fields: key, state, pid (or null), started and last_activity (epoch
    seconds), turns, queued, exits, last_exit, fast_failures, runtime,
    label, repo and branch (or null), rss (bytes), procs, cpu_percent,
    node (the supervisor's node; a NODE column when there are several),
    tokens (model tokens through the model endpoint, or null).

    \b
    Examples:
      hermes-sup list
      hermes-sup list --state busy
      hermes-sup list -q --prefix telegram:
      hermes-sup list --format '{key}\t{state}\t{rss}'
      hermes-sup list --json --prefix telegram:
      hermes-sup list --repo ~/src/webapp --state idle
      hermes-sup list --watch
    """
    if sum([as_json, quiet, template is not None]) > 1:
        raise click.UsageError("choose one of --json, -q and --format")
    clear = watch and is_terminal(sys.stdout)
    with connect(ctx) as client:
        if not (as_json or quiet or template is not None):
            # A supervisor whose sessions are not a boundary says so here too.
            warning = (client.status().get("sealed") or {}).get("warning")
            if warning:
                click.echo(f"warning: {warning}", err=True)
        first = True
        try:
            while True:
                rows = client.sessions(prefix=prefix, state=state)
                if repo is not None:
                    rows = on_repo(rows, repo)
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


def on_repo(rows: list[dict[str, Any]], repo: str) -> list[dict[str, Any]]:
    """The rows of sessions working on `repo` (symlinks resolved, as the
    supervisor records it)."""
    real = os.path.realpath(repo)
    return [r for r in rows if r.get("repo") == real]


@client_options
@click.command()
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
@click.command()
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
@click.option(
    "--delete-branch",
    is_flag=True,
    help="With --purge: keep nothing of its git work (by default its branch is brought "
    "into the repository first); its own repository always goes.",
)
@click.option("--yes", "-y", is_flag=True, help="Do not ask before purging.")
@click.pass_context
def kill(
    ctx: click.Context,
    sessions: tuple[str, ...],
    all_: bool,
    idle_for: str | None,
    force: bool,
    purge: bool,
    delete_branch: bool,
    yes: bool,
) -> None:
    """Kill sessions' workers and every process they started; return when gone.

    Graceful by default: the worker is asked to stop, then its process group
    gets SIGTERM, then SIGKILL. The data (workspace, HERMES_HOME, log) stays,
    and the next message starts a fresh worker on it, unless --purge. A
    session's own git repository goes with --purge; its branch is brought
    into the repository first (with its commits) unless --delete-branch.

    \b
    Examples:
      hermes-sup kill alice
      hermes-sup kill --idle-for 30m
      hermes-sup kill --all --force
      hermes-sup kill bob --purge --yes
      hermes-sup kill fix-login --purge --delete-branch --yes
    """
    if not (sessions or all_ or idle_for):
        raise click.UsageError("name sessions to kill, or use --all or --idle-for")
    if delete_branch and not purge:
        raise click.UsageError(
            "--delete-branch goes with --purge (a kept session keeps its branch)"
        )
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
            client.submit(
                Kind.KILL,
                {"force": force, "purge": purge, "delete_branch": delete_branch},
                session=k,
            ): k
            for k in targets
        }
        failed = 0
        deadline = time.monotonic() + 120
        while pending:
            msg = client.next(timeout=max(1.0, deadline - time.monotonic()))
            key = pending.pop(msg.re, None) if msg.re is not None else None
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
