"""`hermes-sup ray`: one supervisor per Ray node (cluster/ray_agents.py).

hermes-sup ray up --address HEAD:6379 --base-dir /var/lib/hermes-sup-ray
hermes-sup route --ray HEAD:6379
"""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path
from types import ModuleType

import click

from hermes_sup.local.version import install_hint

ADDRESS = click.option(
    "--address",
    required=True,
    help="The Ray cluster, as for ray.init (HOST:PORT of the head, or auto).",
)


@click.group(name="ray")
def ray_group() -> None:
    """Node agents on a Ray cluster (needs the ray extra)."""


def _agents() -> ModuleType:
    try:
        from hermes_sup.cluster import ray_agents
    except ImportError as exc:
        raise click.ClickException(
            f"Ray is not installed ({exc}); add the ray extra: {install_hint('ray')}"
        ) from None
    return ray_agents


@ray_group.command()
@ADDRESS
@click.option(
    "--base-dir",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="A node-local directory on every node: each supervisor's state and data "
    "under BASE/<node> (keep it short: unix socket paths are limited to 107 bytes).",
)
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="A shared data directory (the same path on every node, e.g. NFSv4) instead "
    "of a node-local one under --base-dir.",
)
@click.option("--capacity", type=click.FloatRange(min=0, min_open=True), default=1.0,
              show_default=True, help="Each node's weight for new sessions.")  # fmt: skip
@click.option("--serve-arg", "serve_args", multiple=True,
              help="An argument for every node's `serve` (repeat it).")  # fmt: skip
@click.option("--ping-every", type=click.FloatRange(min=0, min_open=True), default=1.0,
              show_default=True,
              help="Seconds between two pings of a node's supervisor by its agent.")  # fmt: skip
@click.option("--ping-timeout", type=click.FloatRange(min=0, min_open=True), default=2.0,
              show_default=True, help="Seconds a ping waits for its answer.")  # fmt: skip
@click.option("--ping-misses", type=click.IntRange(min=1), default=3, show_default=True,
              help="Unanswered pings in a row after which the agent kills its supervisor "
              "(its locks are released, its sessions served elsewhere) and starts another.")  # fmt: skip
@click.option("--resource", default=None, metavar="NAME",
              help="Start agents only on nodes that declare this Ray resource, each "
              "reserving all of it (its amount is the node's weight), so an autoscaler "
              "keeps those nodes while their agents live.")  # fmt: skip
@click.option("--host", default=None, metavar="ADDRESS",
              help="The address every node's supervisor listens on and is reached at "
              "[default: the address Ray knows for its node]. One address for all "
              "nodes: for a cluster on one machine (127.0.0.1).")  # fmt: skip
def up(
    address: str,
    base_dir: Path,
    data_dir: Path | None,
    capacity: float,
    serve_args: tuple[str, ...],
    ping_every: float,
    ping_timeout: float,
    ping_misses: int,
    resource: str | None,
    host: str | None,
) -> None:
    """Start one node agent (and its supervisor) on every alive Ray node,
    and on every node that joins later.

    A node is named by its label hermes-sup-node (ray start --labels
    hermes-sup-node=NAME), else by its host; hermes-sup-capacity=N sets its
    weight. Agents already running are kept; run it again to change settings."""
    agents = _agents()
    from hermes_sup.cluster.nodes import NodeConfigError
    from hermes_sup.cluster.watchdog import WatchdogSettings

    if host is not None:
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise click.BadParameter(
                f"{host!r} is not an IP address", param_hint="--host"
            ) from None
    agents.connect(address)
    watchdog = WatchdogSettings(every=ping_every, timeout=ping_timeout, misses=ping_misses)
    try:
        infos = agents.up(
            base_dir, capacity, data_dir, list(serve_args),
            watchdog=watchdog, resource=resource, host=host,
        )  # fmt: skip
    except NodeConfigError as exc:
        raise click.ClickException(str(exc)) from None
    specs = agents.wait_registered(len(infos))
    for info in infos:
        click.echo(json.dumps(info))
    for why in agents.skipped():
        click.echo(f"no agent: {why}", err=True)
    click.echo(f"{len(infos)} node agent(s) up, {len(specs)} registered")


@ray_group.command()
@ADDRESS
def down(address: str) -> None:
    """Stop every node's supervisor and agent, and the registry."""
    agents = _agents()
    agents.connect(address)
    click.echo(f"stopped {agents.down()} node agent(s)")


@ray_group.command(name="nodes")
@ADDRESS
def nodes(address: str) -> None:
    """The registered nodes of alive Ray nodes (no keys)."""
    agents = _agents()
    agents.connect(address)
    for spec in agents.read_registry():
        click.echo(json.dumps({"name": spec.name, **spec.describe()}))


if __name__ == "__main__":
    ray_group()
