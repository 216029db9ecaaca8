"""`hermes-sup route`: a router in front of many supervisors (cluster/router.py).

Front ends connect to it as to one supervisor: its state directory (ipc
socket and key) for local ones, `--tcp` with CURVE for remote ones (keys in
its `--data-dir`, made with `hermes-sup keys generate --data-dir`). Its
settings are declared once, in `RouterSettings`: its flags, and the `[route]`
table of the configuration file (`--config`).

`hermes-sup route drain NODE` asks a running router (its state directory)
to drain one of its nodes: the node takes it from the router's key.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from hermes_sup.local.addresses import parse_listen
from hermes_sup.local.settings import Setting, declare, either, setting
from hermes_sup.local.statedir import STATE_DIR_ENV, default_state_dir
from hermes_sup.supervisor.config import LOG_LEVELS

from .common import connect
from .options import client_options, config_option, given_settings, section_values, setting_options


def _tcp_address(value: str) -> str | None:
    """Why `value` cannot be the router's TCP endpoint, or None."""
    if value:
        try:
            parse_listen(value, "tcp")
        except ValueError as exc:
            return str(exc)
    return None


@dataclass
class RouterSettings:
    """Everything `hermes-sup route` can be told: its flags, the `[route]`
    table of the configuration file (local/settings.py)."""

    nodes_file: str = field(
        default="",
        metadata=setting(
            "--nodes",
            "a TOML file of `[[node]]` tables (name, connection or endpoint and keys, "
            "capacity); re-read when it changes. Give this or `ray`",
            key="nodes",
            zero="none",
            path=True,
            metavar="FILE",
        ),
    )
    ray_address: str = field(
        default="",
        metadata=setting(
            "--ray",
            "follow the nodes that `hermes-sup ray up` registered in this Ray cluster (an "
            "address as for ray.init, e.g. `10.0.0.1:6379` or `auto`). Give this or `nodes`",
            key="ray",
            zero="none",
            metavar="ADDRESS",
        ),
    )
    # As every command's, read by the group from HERMES_SUP_STATE_DIR.
    state_dir: Path | None = field(
        default=None,
        metadata=setting(
            "--state-dir",
            "the router's own state directory (socket, key, lock)",
            path=True,
            shown=f"as for serve (env `{STATE_DIR_ENV}`)",
        ),
    )
    tcp: str = field(
        default="",
        metadata=setting(
            "--tcp",
            "also listen for remote front ends on TCP with CURVE, `PORT` (127.0.0.1) or "
            "`HOST:PORT` (needs `data_dir`)",
            zero="off",
            metavar="[HOST:]PORT",
            check=_tcp_address,
        ),
    )
    data_dir: Path | None = field(
        default=None,
        metadata=setting(
            "--data-dir",
            "where the router keeps its CURVE keys and allowlist (for `tcp`)",
            path=True,
            shown="none",
        ),
    )
    poll: float = field(
        default=1.0,
        metadata=setting("--poll", "seconds between reads of the node list", minimum=0.05),
    )
    max_clients: int | None = field(
        default=None,
        metadata=setting(
            "--max-clients",
            "front-end connections at once, local and TCP together; one over it is refused "
            "with `overloaded`",
            zero="what the open-file limit allows",
            minimum=1,
        ),
    )
    # cluster/router.py's CLIENT_QUEUE (a test holds them equal: the router
    # imports zmq, which `hermes-sup --help` must not pay for).
    client_queue: int = field(
        default=100_000,
        metadata=setting(
            "--client-queue",
            "messages queued for one front end before it lags: its events are then dropped "
            "and counted (it is told), its answers kept",
            zero="no limit",
        ),
    )
    metrics: str = field(
        default="",
        metadata=setting(
            "--metrics",
            "serve Prometheus metrics at /metrics and a health check at /healthz (200 while "
            "the router runs and a node is linked, else 503) on `PORT` (127.0.0.1) or "
            "`HOST:PORT`",
            zero="off",
            metavar="[HOST:]PORT",
        ),
    )
    log_level: str = field(
        default="info",
        metadata=setting(
            "--log-level", f"what the router logs: {either(LOG_LEVELS)}", choices=LOG_LEVELS
        ),
    )


ROUTER_SETTINGS: dict[str, Setting] = declare(RouterSettings)


@click.group(invoke_without_command=True)
@config_option("route")
@setting_options(ROUTER_SETTINGS)
@click.pass_context  # type: ignore[arg-type]
def route(ctx: click.Context, config: Path | None, **given: Any) -> None:
    """Route every session's requests to the node that owns its key.

    \b
    Placement: rendezvous hashing over the live, non-draining nodes,
    weighted by capacity; only the keys of a node that leaves move.
    list, status and watch of all sessions fan out and merge.

    \b
    With a subcommand, a client of a running router:
      hermes-sup route --state-dir /run/hsr drain b --wait
    """
    state_dir = given.get("state_dir")
    if ctx.invoked_subcommand is not None:
        if state_dir is not None:  # the router's state directory, to connect to
            obj = ctx.ensure_object(dict)
            obj["state_dir"], obj["state_dir_given"] = state_dir, True
        return
    from hermes_sup.cluster.homes import HomeStore, MemoryHomes, RayHomes
    from hermes_sup.cluster.nodes import NodeConfigError
    from hermes_sup.cluster.router import serve_router, static_source
    from hermes_sup.door.remote import RemoteError
    from hermes_sup.local.statedir import StateDirError

    values = section_values(config, "route", ROUTER_SETTINGS)
    settings = RouterSettings(**{**values, **given_settings(ctx, ROUTER_SETTINGS, given)})
    if bool(settings.nodes_file) == bool(settings.ray_address):
        raise click.UsageError("give exactly one of --nodes FILE and --ray ADDRESS")
    metrics_at = None
    if settings.metrics:
        from hermes_sup.supervisor.metrics import parse_address

        try:
            metrics_at = parse_address(settings.metrics)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--metrics") from None
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    if settings.state_dir is None:
        obj = ctx.obj if isinstance(ctx.obj, dict) else {}
        settings.state_dir = obj.get("state_dir") or default_state_dir()
    assert settings.state_dir is not None
    homes: HomeStore
    if settings.nodes_file:
        source = static_source(Path(settings.nodes_file))
        try:
            source()  # refuse a bad file now, not in the loop (it is read once: cached)
        except (NodeConfigError, OSError) as exc:
            raise click.ClickException(str(exc)) from None
        homes = MemoryHomes()  # this router's own: a static node list has no shared store
    else:
        from hermes_sup.cluster.ray_agents import registry_source

        source = registry_source(settings.ray_address)
        homes = RayHomes()
    try:
        serve_router(
            settings.state_dir,
            source,
            tcp=settings.tcp or None,
            data_dir=settings.data_dir,
            poll_interval=settings.poll,
            max_clients=settings.max_clients,
            client_queue=settings.client_queue,
            metrics=metrics_at,
            homes=homes,
        )
    except OSError as exc:
        raise click.ClickException(f"cannot serve: {exc.strerror or exc}") from None
    except (StateDirError, RemoteError) as exc:
        raise click.ClickException(str(exc)) from None


@client_options
@route.command(name="drain")
@click.argument("node")
@click.option("--off", is_flag=True, help="End the drain: the node takes new sessions again.")
@click.option(
    "--wait", is_flag=True, help="Return once the node holds no session (each finished and moved)."
)
@click.pass_context
def route_drain(ctx: click.Context, node: str, off: bool, wait: bool) -> None:
    """Drain NODE through the router (its local socket): the node takes no
    new sessions, lets running turns finish and stops each session once it
    is idle; the router sends their next messages, and new keys, to the
    other nodes. The node takes the drain from the router's key (enrolled
    as router-*).

    \b
    Examples:
      hermes-sup route --state-dir /run/hsr drain b --wait
      hermes-sup route --state-dir /run/hsr drain b --off
    """
    from hermes_sup.protocol import Kind

    with connect(ctx) as client:
        answer = client.request(Kind.DRAIN, {"on": not off, "node": node}).body["node"]
        if off:
            click.echo(f"node {answer['name']}: taking new sessions again")
            return
        click.echo(
            f"node {answer['name']} draining: no new sessions; {answer['sessions']} session(s) "
            "still held, each stopped once idle"
        )
        started = time.monotonic()
        said = 0.0
        held: Any = answer.get("sessions")
        while wait and held != 0:
            waited = time.monotonic() - started
            if waited - said >= 5:
                said = waited
                click.echo(f"{held} session(s) still held ({waited:.0f}s)...", err=True)
            time.sleep(0.2)
            row = next((n for n in client.status().get("nodes", []) if n["name"] == node), None)
            if row is None:
                raise click.ClickException(f"node {node} left the router's node list while waiting")
            if not row.get("answered"):
                continue  # not answering now: ask again
            own = row["status"].get("node") or {}
            if own.get("draining") is False:
                raise click.ClickException("the drain was ended (drain --off) while waiting")
            held = own.get("sessions")
        if wait:
            click.echo("drained: no session left")


def forked_keys(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The keys a router's merged `list` shows more than once (on two nodes):
    each a key with two histories, or live on two nodes."""
    by_key: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_key.setdefault(str(row.get("key")), []).append(row)
    return {key: found for key, found in sorted(by_key.items()) if len(found) > 1}


@client_options
@route.command(name="reconcile")
@click.option("--json", "as_json", is_flag=True, help="One JSON object: key -> its rows.")
@click.pass_context
def route_reconcile(ctx: click.Context, as_json: bool) -> None:
    """Find keys that have a session on two nodes, through a running router.

    A key has one history: its router sends it only to nodes that serve
    the data directory it was first placed on. Older versions started a
    key anew on another node while its node was away, so it may have two
    sessions, each with its own turns. This lists each such key with
    where each of its sessions is, its state and when it was made, and
    exits 1 if there is any (0 if none): keep the one to keep, and
    `kill` the other on its node.

    \b
    Example:
      hermes-sup route --state-dir /run/hsr reconcile
    """
    import json

    with connect(ctx) as client:
        info = client.status()
        rows = client.sessions()
    silent = [n["name"] for n in info.get("nodes", []) if not n.get("answered")]
    forked = forked_keys(rows)
    if as_json:
        click.echo(json.dumps({"forked": forked, "not_answered": silent}, indent=2, default=str))
    else:
        for key, found in forked.items():
            click.echo(f"{key}: {len(found)} sessions")
            for row in found:
                made = row.get("created")
                when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(made)) if made else "?"
                click.echo(f"  node {row.get('node')}: {row.get('state')}, made {when}")
        click.echo(f"{len(forked)} key(s) with more than one session")
        if silent:
            click.echo(
                f"not asked (did not answer): {', '.join(silent)}; run it again once they do",
                err=True,
            )
    if forked:
        ctx.exit(1)


if __name__ == "__main__":
    route()
