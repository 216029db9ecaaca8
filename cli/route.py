"""`hermes-sup route`: a router in front of many supervisors (cluster/router.py).

Front ends connect to it as to one supervisor: its state directory (ipc
socket and key) for local ones, `--tcp` with CURVE for remote ones (keys in
its `--data-dir`, made with `hermes-sup keys generate --data-dir`).

`hermes-sup route drain NODE` asks a running router (its state directory)
to drain one of its nodes: the node takes it from the router's key.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import click

from hermes_sup.local.statedir import STATE_DIR_ENV, default_state_dir

from .common import connect
from .options import client_options


@click.group(invoke_without_command=True)
@click.option(
    "--nodes",
    "nodes_file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="A TOML file of [[node]] tables (name, connection or endpoint and keys, "
    "capacity); re-read when it changes.",
)
@click.option(
    "--ray",
    "ray_address",
    default=None,
    metavar="ADDRESS",
    help="Follow the nodes that `hermes-sup ray up` registered in this Ray cluster "
    "(an address as for ray.init, e.g. 10.0.0.1:6379 or auto).",
)
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help=f"The router's own state directory (socket, key, lock) [env {STATE_DIR_ENV}].",
)
@click.option(
    "--tcp",
    default=None,
    metavar="[HOST:]PORT",
    help="Also listen for remote front ends on TCP with CURVE (needs --data-dir).",
)
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where the router keeps its CURVE keys and allowlist (for --tcp).",
)
@click.option(
    "--poll",
    type=click.FloatRange(min=0.05),
    default=1.0,
    show_default=True,
    help="Seconds between reads of the node list.",
)
@click.option(
    "--max-clients",
    type=click.IntRange(min=1),
    default=None,
    help="Front-end connections at once, local and TCP together [default: what the "
    "open-file limit allows]; one over it is refused with `overloaded`.",
)
@click.option(
    "--client-queue",
    type=click.IntRange(min=0),
    default=None,
    help="Messages queued for one front end before it lags: its events are then dropped "
    "and counted (it is told), its answers kept [default: 100000; 0: no limit].",
)
@click.option(
    "--metrics",
    default=None,
    metavar="[HOST:]PORT",
    help="Serve Prometheus metrics at /metrics and a health check at /healthz "
    "(200 while the router runs and a node is linked, else 503) on this address "
    "(a bare port binds 127.0.0.1).",
)
@click.option("--log-level", default="INFO", show_default=True)
@click.pass_context
def route(
    ctx: click.Context,
    nodes_file: Path | None,
    ray_address: str | None,
    state_dir: Path | None,
    tcp: str | None,
    data_dir: Path | None,
    poll: float,
    max_clients: int | None,
    client_queue: int | None,
    metrics: str | None,
    log_level: str,
) -> None:
    """Route every session's requests to the node that owns its key.

    \b
    Placement: rendezvous hashing over the live, non-draining nodes,
    weighted by capacity; only the keys of a node that leaves move.
    list, status and watch of all sessions fan out and merge.

    \b
    With a subcommand, a client of a running router:
      hermes-sup route --state-dir /run/hsr drain b --wait
    """
    if ctx.invoked_subcommand is not None:
        if state_dir is not None:  # the router's state directory, to connect to
            obj = ctx.ensure_object(dict)
            obj["state_dir"], obj["state_dir_given"] = state_dir, True
        return
    from hermes_sup.cluster.nodes import NodeConfigError
    from hermes_sup.cluster.router import CLIENT_QUEUE, serve_router, static_source
    from hermes_sup.door.remote import RemoteError
    from hermes_sup.local.statedir import StateDirError

    if (nodes_file is None) == (ray_address is None):
        raise click.UsageError("give exactly one of --nodes FILE and --ray ADDRESS")
    metrics_at = None
    if metrics is not None:
        from hermes_sup.supervisor.metrics import parse_address

        try:
            metrics_at = parse_address(metrics)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--metrics") from None
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    if state_dir is None:
        obj = ctx.obj if isinstance(ctx.obj, dict) else {}
        state_dir = obj.get("state_dir") or default_state_dir()
    assert state_dir is not None
    if nodes_file is not None:
        source = static_source(nodes_file)
        try:
            source()  # refuse a bad file now, not in the loop (it is read once: cached)
        except (NodeConfigError, OSError) as exc:
            raise click.ClickException(str(exc)) from None
    else:
        from hermes_sup.cluster.ray_agents import registry_source

        assert ray_address is not None
        source = registry_source(ray_address)
    try:
        serve_router(
            state_dir,
            source,
            tcp=tcp,
            data_dir=data_dir,
            poll_interval=poll,
            max_clients=max_clients,
            client_queue=CLIENT_QUEUE if client_queue is None else client_queue,
            metrics=metrics_at,
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


if __name__ == "__main__":
    route()
