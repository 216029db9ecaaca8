"""`hermes-sup keys`: the CURVE keys of remote front ends (serve --tcp).

Each front end gets a key pair and a connection file; the supervisor's data
directory keeps the allowlist of their public keys.
"""

from __future__ import annotations

from pathlib import Path

import click

from hermes_sup.supervisor.config import DATA_DIR_ENV, default_data_dir

DATA_DIR = click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    envvar=DATA_DIR_ENV,
    default=None,
    help=f"The supervisor's data directory [env {DATA_DIR_ENV}; default as for serve].",
)


@click.group()
def keys() -> None:
    """CURVE keys of remote front ends (serve --tcp).

    The allowlist is read at every connection: changes need no restart.
    A front end named `router` or `router-*` is a router (hermes-sup
    route): besides what every front end may do, it may drain the node.
    """


@keys.command(name="generate")
@click.argument("name")
@click.option(
    "--endpoint",
    required=True,
    help="HOST:PORT the front end will connect to (the address of serve --tcp).",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Where to write the connection file [default: NAME.json here].",
)
@DATA_DIR
def keys_generate(name: str, endpoint: str, output: Path | None, data_dir: Path | None) -> None:
    """Make a key pair for the front end NAME, allow it, and write its
    connection file (0600: it holds secrets; copy it to the front end's host).

    \b
    Example:
      hermes-sup keys generate web-eu --endpoint hs.internal:7788
      # on the front end: Client.from_connection_file("web-eu.json")
    """
    import zmq

    from hermes_sup.client.connection import write_connection_file
    from hermes_sup.door import remote

    data = data_dir or default_data_dir()
    output = output or Path(f"{name}.json")
    try:
        # Everything that can be refused is, before any directory is made.
        host, port = remote.parse_tcp(endpoint)
        remote.check_name(name)
        if output.exists():
            raise remote.RemoteError(f"{output} exists; choose another --output")
        server_public, _ = remote.server_keys(data)
        public, secret = zmq.curve_keypair()
        remote.allow(data, name, public)
        write_connection_file(
            output,
            remote.tcp_endpoint(host, port),
            remote.remote_hmac_key(data),
            server_public.decode(),
            public.decode(),
            secret.decode(),
        )
    except (remote.RemoteError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    role = " as a router: it may also drain this node" if remote.is_router(name) else ""
    click.echo(f"allowed {name} ({public.decode()}){role}\nwrote {output}")


@keys.command(name="list")
@DATA_DIR
def keys_list(data_dir: Path | None) -> None:
    """The allowed front ends and their public keys."""
    from hermes_sup.door import remote

    clients = remote.allowed(data_dir or default_data_dir())
    if not clients:
        click.echo("no remote front ends are allowed")
    for name, public in clients.items():
        role = "  (router: may drain)" if remote.is_router(name) else ""
        click.echo(f"{name}  {public.decode()}{role}")


@keys.command(name="revoke")
@click.argument("name")
@DATA_DIR
def keys_revoke(name: str, data_dir: Path | None) -> None:
    """Refuse the front end NAME from its next connection on (a router's
    drain at once, on the connection it has too)."""
    from hermes_sup.door import remote

    try:
        found = remote.revoke(data_dir or default_data_dir(), name)
    except remote.RemoteError as exc:
        raise click.ClickException(str(exc)) from None
    if not found:
        raise click.ClickException(f"no front end named {name!r} is allowed")
    click.echo(f"revoked {name}")


def _add_http_keys() -> None:
    """`keys http ...`: the HTTP endpoint's keys, beside the front ends'."""
    from .http import http_keys

    keys.add_command(http_keys)


_add_http_keys()
