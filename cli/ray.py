"""`hermes-sup ray`: one supervisor per Ray node (cluster/ray_agents.py).

hermes-sup ray up --address HEAD:6379 --base-dir /var/lib/hermes-sup-ray
hermes-sup route --ray HEAD:6379

`ray up`'s settings are declared once, in `RayUpSettings`: its flags, and
the `[ray]` table of the configuration file (`--config`).
"""

from __future__ import annotations

import ipaddress
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import click

from hermes_sup.local.settings import Setting, declare, setting
from hermes_sup.local.version import install_hint

from .options import config_option, given_settings, section_values, setting_options


def _ip_address(value: str) -> str | None:
    """Why `value` cannot be the nodes' one address, or None."""
    if value:
        try:
            ipaddress.ip_address(value)
        except ValueError:
            return f"{value!r} is not an IP address"
    return None


@dataclass
class RayUpSettings:
    """Everything `hermes-sup ray up` can be told: its flags, the `[ray]`
    table of the configuration file (local/settings.py). `address` is every
    `ray` command's; `address` and `base_dir` must be given, here or there."""

    address: str = field(
        default="",
        metadata=setting(
            "--address",
            "the Ray cluster, as for ray.init (`HOST:PORT` of the head, or `auto`)",
            shown="none: give it",
            metavar="ADDRESS",
        ),
    )
    base_dir: Path | None = field(
        default=None,
        metadata=setting(
            "--base-dir",
            "a node-local directory on every node: each supervisor's state and data under "
            "`BASE/<node>` (keep it short: unix socket paths are limited to 107 bytes)",
            path=True,
            shown="none: give it",
        ),
    )
    data_dir: Path | None = field(
        default=None,
        metadata=setting(
            "--data-dir",
            "a shared data directory (the same path on every node, e.g. NFSv4) instead of a "
            "node-local one under `base_dir`",
            path=True,
            shown="none",
        ),
    )
    capacity: float = field(
        default=1.0,
        metadata=setting(
            "--capacity", "each node's weight for new sessions", exclusive=True, duration=False
        ),
    )
    serve_args: tuple[str, ...] = field(
        default=(),
        metadata=setting("--serve-arg", "arguments for every node's `serve`", metavar="ARG"),
    )
    ping_every: float = field(
        default=1.0,
        metadata=setting(
            "--ping-every",
            "seconds between two pings of a node's supervisor by its agent",
            exclusive=True,
        ),
    )
    ping_timeout: float = field(
        default=2.0,
        metadata=setting("--ping-timeout", "seconds a ping waits for its answer", exclusive=True),
    )
    ping_misses: int = field(
        default=3,
        metadata=setting(
            "--ping-misses",
            "unanswered pings in a row after which the agent kills its supervisor (its locks "
            "are released, its sessions served elsewhere) and starts another",
            minimum=1,
        ),
    )
    lease_time: float = field(
        default=5.0,
        metadata=setting(
            "--lease-time",
            "with `data_dir`: seconds a node keeps its sessions once no router reaches it "
            "(every node's `serve --lease-time`): a frozen or cut-off node's keys are served "
            "by another node within about this plus the router's 4 s",
            zero="off: a node's keys wait for its locks to be let go",
        ),
    )
    resource: str = field(
        default="",
        metadata=setting(
            "--resource",
            "start agents only on nodes that declare this Ray resource, each reserving all "
            "of it (its amount is the node's weight), so an autoscaler keeps those nodes "
            "while their agents live",
            zero="every node",
            metavar="NAME",
        ),
    )
    host: str = field(
        default="",
        metadata=setting(
            "--host",
            "the address every node's supervisor listens on and is reached at; one address "
            "for all nodes: for a cluster on one machine (`127.0.0.1`)",
            zero="the address Ray knows for its node",
            metavar="ADDRESS",
            check=_ip_address,
        ),
    )


RAY_SETTINGS: dict[str, Setting] = declare(RayUpSettings)


def serve_args_for(settings: RayUpSettings) -> list[str]:
    """Every node's `serve` arguments: the operator's, and the node lease
    with a shared data directory (with data of its own, no other node
    could take a node's keys: its lease would only stop its workers)."""
    args = list(settings.serve_args)
    if settings.data_dir is not None and settings.lease_time > 0:
        args += ["--lease-time", f"{settings.lease_time:g}"]
    return args


# `ray down` and `ray nodes` take the same --address, required there.
ADDRESS = click.option(
    "--address", required=True, metavar="ADDRESS", help=RAY_SETTINGS["address"].option_help()
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
@config_option("ray")
@setting_options(RAY_SETTINGS)
@click.pass_context  # type: ignore[arg-type]
def up(ctx: click.Context, config: Path | None, **given: Any) -> None:
    """Start one node agent (and its supervisor) on every alive Ray node,
    and on every node that joins later.

    A node is named by its label hermes-sup-node (ray start --labels
    hermes-sup-node=NAME), else by its host; hermes-sup-capacity=N sets its
    weight. Agents already running are kept; run it again to change settings."""
    values = section_values(config, "ray", RAY_SETTINGS)
    settings = RayUpSettings(**{**values, **given_settings(ctx, RAY_SETTINGS, given)})
    for name in ("address", "base_dir"):
        if not getattr(settings, name):
            flag = RAY_SETTINGS[name].flag
            raise click.UsageError(f"give {flag} (or `{name}` in the [ray] table of --config)")
    assert settings.base_dir is not None
    agents = _agents()
    from hermes_sup.cluster.nodes import NodeConfigError
    from hermes_sup.cluster.watchdog import WatchdogSettings

    agents.connect(settings.address)
    watchdog = WatchdogSettings(
        every=settings.ping_every, timeout=settings.ping_timeout, misses=settings.ping_misses
    )
    try:
        infos = agents.up(
            settings.base_dir,
            settings.capacity,
            settings.data_dir,
            serve_args_for(settings),
            watchdog=watchdog,
            resource=settings.resource or None,
            host=settings.host or None,
        )
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


@ray_group.command(name="drain")
@ADDRESS
@click.argument("node")
@click.option("--off", is_flag=True, help="End the drain: the node takes new sessions again.")
@click.option(
    "--wait", is_flag=True, help="Return once the node holds no session (each stopped when idle)."
)
@click.option("--timeout", default=30.0, show_default=True, help="Seconds to wait for an answer.")
def drain(address: str, node: str, off: bool, wait: bool, timeout: float) -> None:
    """Drain NODE, found in the registry: it takes no new sessions, lets
    running turns finish and stops each session once it is idle, which lets
    its lease go; every router sends its keys' next messages, and new keys,
    to the other nodes (with a shared data directory each session's files
    come along; with node-local data its keys stay its own and wait for it).
    The node takes it from the router's key the registry holds for it.

    \b
    Examples:
      hermes-sup ray drain --address HEAD:6379 gpu-a --wait
      hermes-sup ray drain --address HEAD:6379 gpu-a --off
    """
    from hermes_sup.client import Client, ClientError
    from hermes_sup.protocol import Kind

    agents = _agents()
    agents.connect(address)
    specs = {spec.name: spec for spec in agents.read_registry()}
    spec = specs.get(node)
    if spec is None:
        raise click.ClickException(
            f"no node {node!r} is registered on an alive Ray node (registered: "
            f"{', '.join(sorted(specs)) or 'none'})"
        )
    try:
        with Client(connection=node_connection(spec), timeout=timeout) as client:
            answer = client.request(Kind.DRAIN, {"on": not off}).body["node"]
            if off:
                click.echo(f"node {node}: taking new sessions again")
                return
            click.echo(
                f"node {node} draining: no new sessions; {answer['sessions']} session(s) still "
                "held, each stopped once idle"
            )
            while wait and answer["sessions"]:
                time.sleep(0.2)
                answer = client.status()["node"]
                if not answer["draining"]:
                    raise click.ClickException("the drain was ended (drain --off) while waiting")
            if wait:
                click.echo("drained: no session left")
    except ClientError as exc:
        raise click.ClickException(f"node {node} ({spec.endpoint}): {exc}") from None


def node_connection(spec: Any) -> Any:
    """How to reach a registered node as its router does (its NodeSpec)."""
    from hermes_sup.client import Connection, Curve

    return Connection(
        spec.endpoint, spec.hmac_key, Curve(spec.server_key, spec.public, spec.secret)
    )


if __name__ == "__main__":
    ray_group()
