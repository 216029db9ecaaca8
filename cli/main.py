"""The `hermes-sup` command group, and the commands about the supervisor
itself: ping, status, reload, drain and shutdown. The others live beside this
module and are added to the group here: send, cancel, turn status, approve, attach and
events (conversation.py); open (start), restart, signal, list, inspect,
kill (sessions.py); logs (logs.py); serve and config (serve.py); keys (keys.py);
install-service (service.py); http and keys http (http.py); route
(route.py) and ray (ray.py), for many nodes. common.py holds
what the client commands share, send.py runs a turn, attach.py an attached
terminal, show.py and terminal.py shape what is printed, options.py holds
the options every client command takes, complete.py shell completion,
logfiles.py logs read from disk.

Exit codes: common.Exit (docs/cli.md shows the table).
"""

from __future__ import annotations

import importlib
import json
import time
from pathlib import Path
from typing import Any

import click

from hermes_sup.local.statedir import STATE_DIR_ENV

from . import complete
from .options import (
    CONNECTION_ENV,
    CONNECTION_HELP,
    DEFAULT_TIMEOUT,
    SECONDS,
    STATE_DIR_HELP,
    TIMEOUT_HELP,
    client_options,
    init_obj,
)
from .show import duration, size

complete.install()

# The commands kept beside this module, by name: "module:attribute". Each
# module is imported when its command runs (or is listed, for --help and
# completion), so `--version`, a Tab press or `hermes-sup ping` load click
# and the blocking client, never the supervisor, asyncio or starlette.
COMMANDS = {
    "serve": "serve:serve",
    "config": "serve:config",
    "keys": "keys:keys",
    "install-service": "service:install_service",
    "http": "http:http",
    "send": "conversation:send",
    "cancel": "conversation:cancel",
    "turn": "conversation:turn",
    "approve": "conversation:approve",
    "events": "conversation:events",
    "attach": "conversation:attach",
    "open": "sessions:open_",
    "start": "sessions:open_",
    "restart": "sessions:restart",
    "signal": "sessions:signal_",
    "list": "sessions:list_",
    "top": "top:top",
    "inspect": "sessions:inspect",
    "kill": "sessions:kill",
    "logs": "logs:logs",
    "route": "route:route",
    "ray": "ray:ray_group",
    "repo": "repo:repo",
    "completion": "complete:completion",
}


class LazyGroup(click.Group):
    """A group whose commands in COMMANDS are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in COMMANDS:
            module, attribute = COMMANDS[cmd_name].split(":")
            loaded = importlib.import_module(f"{__package__}.{module}")
            self.commands[cmd_name] = getattr(loaded, attribute)
        return super().get_command(ctx, cmd_name)


def show_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    """--version: the installed version, looked up only when asked for."""
    if not value or ctx.resilient_parsing:
        return
    from hermes_sup.local.version import version

    click.echo(f"hermes-sup, version {version()}")
    ctx.exit()


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
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
@click.option(
    "--version",
    "-V",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=show_version,
    help="Show the version and exit.",
)
@click.pass_context
def cli(
    ctx: click.Context, state_dir: Path | None, timeout: float, connection: Path | None
) -> None:
    """hermes-sup: one real process per agent session, routed over ZeroMQ.

    --state-dir, --timeout and --connection may also follow the command's
    name (hermes-sup list --state-dir D).

    \b
    Exit codes: 0 ok, 1 error, 2 usage, 3 supervisor not running,
    4 turn unknown, 5 turn queued or running, 6 supervisor starting,
    130 a turn cancelled with Ctrl-C; send: the turn's own where it has one.
    Completion: eval "$(hermes-sup completion bash)"
    """
    init_obj(ctx, state_dir, timeout, connection)


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
    from .common import connect

    with connect(ctx) as client:
        started = time.perf_counter()
        info = client.ping()
        took = (time.perf_counter() - started) * 1000
    click.echo(
        f"hermes-sup {info.version} pid {info.pid} up {info.uptime:.1f}s "
        f"(answered in {took:.1f} ms)"
    )


@client_options
@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """Show the supervisor itself: pid, uptime, version, endpoints, sessions, memory.

    Asked of a router (its --state-dir), the router and one line per node.

    \b
    Example:
      hermes-sup status
    """
    from .common import connect

    # A start under way (the sealed Hermes preload) is said, with how far it is.
    with connect(ctx) as client:
        info = client.status()
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    if info.get("role") == "router":
        from .router_status import router_lines

        click.echo("\n".join(router_lines(info)))
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
    node = info.get("node")
    if isinstance(node, dict):
        lines.insert(
            1,
            f"node:      {node['name']}, {node['sessions']} session(s) held"
            + ("; DRAINING: no new sessions" if node["draining"] else ""),
        )
    lines += sealing_lines(info)
    if not info["accepting"]:
        lines.append("shutting down: not accepting turns")
    click.echo("\n".join(lines))


def sealing_lines(info: dict[str, Any]) -> list[str]:
    """How sessions are kept apart, and their limits, for `status`; an
    unsealed supervisor's warning first."""
    sealed = info.get("sealed") or {}
    lines = []
    if sealed.get("warning"):
        lines.append(f"WARNING:   {sealed['warning']}")
    if sealed.get("mode"):
        parts = [f"sealed ({sealed['mode']})"]
        if sealed.get("pid_namespaces"):
            parts.append("own PID namespaces")
        if sealed.get("ipc_namespace"):
            parts.append("own IPC")
        if sealed.get("network_namespace"):
            parts.append(f"own network ({sealed.get('network')})")
        else:
            parts.append("the host's network")
        if sealed.get("read_only_root"):
            parts.append("read-only /")
        if sealed.get("syscall_filter"):
            parts.append("syscall filter")
        if not sealed.get("signals_scoped") and not sealed.get("pid_namespaces"):
            parts.append("signals between sessions not scoped")
        lines.append("sealing:   " + ", ".join(parts))
    groups = info.get("cgroups")
    if isinstance(groups, dict):
        if groups.get("active"):
            lines.append(
                f"cgroups:   {groups.get('version')}, one per session under {groups.get('where')} "
                f"({', '.join(groups.get('controllers') or [])})"
            )
        else:
            lines.append(f"cgroups:   none: {groups.get('reason')}")
    preload = info.get("preload")
    if isinstance(preload, dict) and preload.get("recorded"):
        missing = preload.get("missing") or 0
        lines.append(
            f"preload:   Hermes, {preload['recorded'] - missing} of {preload['recorded']} "
            f"recorded modules ({preload.get('modules')} in all) in "
            f"{preload.get('seconds', 0):.1f}s"
        )
    limits = info.get("limits") or {}
    if limits:
        lines.append(
            "limits:    " + "; ".join(f"{k.replace('_', ' ')} {v}" for k, v in limits.items())
        )
    return lines


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
    from hermes_sup.protocol import Kind

    from .common import connect

    with connect(ctx) as client:
        body = client.request(Kind.RELOAD).body
    click.echo("reloaded; changed: " + (", ".join(body["changed"]) or "nothing"))
    if body["restart_needed"]:
        click.echo("needs a restart to change: " + ", ".join(body["restart_needed"]))


@client_options
@cli.command()
@click.option("--off", is_flag=True, help="End the drain: take new sessions again.")
@click.option(
    "--wait",
    is_flag=True,
    help="Return once the node holds no session (every one finished and stopped).",
)
@click.option(
    "--node",
    "name",
    default=None,
    metavar="NAME",
    help="The node to drain: through a router (hermes-sup route), which one; "
    "on a supervisor, it must be its own name.",
)
@click.pass_context
def drain(ctx: click.Context, off: bool, wait: bool, name: str | None) -> None:
    """Drain a node: take no new sessions (they get `moved`, which a
    router sends elsewhere), let running turns finish, and stop each
    session as it goes idle. From a supervisor's own host, or through a
    router's local socket with --node (the router drains with its key).

    \b
    Examples:
      hermes-sup drain --wait
      hermes-sup drain --off
      hermes-sup --state-dir /run/hermes-route drain --node b --wait
    """
    body: dict[str, object] = {"on": not off}
    if name is not None:
        body["node"] = name
    from hermes_sup.protocol import Kind

    from .common import connect

    with connect(ctx) as client:
        node = client.request(Kind.DRAIN, body).body["node"]
        if off:
            click.echo(f"node {node['name']}: taking new sessions again")
            return
        click.echo(
            f"node {node['name']} draining: no new sessions; {node['sessions']} session(s) "
            "still held, each stopped once idle"
        )
        started = time.monotonic()
        said = 0.0
        while wait and node["sessions"]:
            waited = time.monotonic() - started
            if waited - said >= 5:
                said = waited
                click.echo(f"{node['sessions']} session(s) still held ({waited:.0f}s)...", err=True)
            time.sleep(0.2)
            node = _node_status(client.status(), node["name"])
            if not node["draining"]:
                raise click.ClickException("the drain was ended (drain --off) while waiting")
        if wait:
            click.echo("drained: no session left")


def _node_status(status: dict[str, Any], name: str) -> dict[str, Any]:
    """A node's `node` map in a status answer: a supervisor's own, or, from
    a router, the named node's among its merged `nodes`."""
    for entry in status.get("nodes") or []:
        node = (entry.get("status") or {}).get("node") or {}
        if node.get("name") == name:
            return dict(node)
    if "node" in status and status["node"].get("name") == name:
        return dict(status["node"])
    raise click.ClickException(f"node {name!r} is no longer in the status answer")


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
    from .common import connect

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
