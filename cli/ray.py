"""`hermes-sup ray`: one supervisor per Ray node (cluster/ray_agents.py).

hermes-sup ray up --address HEAD:6379 --base-dir /var/lib/hermes-sup-ray
hermes-sup route --ray HEAD:6379
"""

from __future__ import annotations

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
def up(
    address: str,
    base_dir: Path,
    data_dir: Path | None,
    capacity: float,
    serve_args: tuple[str, ...],
) -> None:
    """Start one node agent (and its supervisor) on every alive Ray node.

    Agents already running are kept; run it again after nodes join."""
    agents = _agents()
    agents.connect(address)
    infos = agents.up(base_dir, capacity, data_dir, list(serve_args))
    specs = agents.wait_registered(len(infos))
    for info in infos:
        click.echo(json.dumps(info))
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
