"""`hermes-sup http` (the HTTP endpoint as a process of its own), `hermes-sup
keys http` (its bearer keys), and what `serve --http` calls to start the
endpoint beside the supervisor. The endpoint itself is hermes_sup.httpapi;
serve.py in that package says how each way of running it works. The
endpoint's settings are its table (httpapi/settings.py): this command's
flags, and the `[http_api]` table of the configuration file, which both
this command (`--config`) and `serve` (with `http` set) read."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click

from hermes_sup.httpapi.settings import API_SETTINGS
from hermes_sup.local.settings import SettingError, from_text, to_argv
from hermes_sup.local.version import install_hint
from hermes_sup.supervisor.config import DATA_DIR_ENV, SETTINGS, default_data_dir

from .options import (
    config_option,
    given_settings,
    section_values,
    setting_option,
    setting_options,
    web_dir_option,
)

# Hermes's API server's port: front ends default to it (httpapi/serve.py's).
DEFAULT_PORT = 8642

DATA_DIR = click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    envvar=DATA_DIR_ENV,
    default=None,
    help=f"Where the keys are (<data-dir>/http/keys) [env {DATA_DIR_ENV}; default as for serve].",
)


def _need_http_extra() -> None:
    missing = [m for m in ("starlette", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise click.ClickException(
            f"the HTTP endpoint needs {' and '.join(missing)} (the http extra): "
            + install_hint("http")
        )


def endpoint_settings(config: Path | None, given: Mapping[str, Any]) -> dict[str, Any]:
    """The endpoint's settings this command sets: the file's [http_api]
    table, then the environment's, then the flags'; the endpoint's process
    takes them as flags, so what is set here wins over its environment."""
    values = section_values(config, "http_api", API_SETTINGS)
    for name, s in API_SETTINGS.items():
        text = os.environ.get(s.envvar, "").strip() if s.envvar else ""
        if text and name != "cors_origins":  # origins: the endpoint reads them, with Hermes's
            try:
                values[name] = from_text(s, text)
            except SettingError as exc:
                raise click.ClickException(f"{s.envvar}: {exc}") from None
    return {**values, **given}


def start_http_beside(settings: Any, config: Path | None) -> None:
    """`serve` with `http` set: start the endpoint for the supervisor this
    process is about to become (before it starts: this forks), with the
    [http_api] table of serve's configuration file; with `http_web`, it
    also serves that directory's static files at /."""
    _need_http_extra()
    from hermes_sup.httpapi.serve import HttpSetupError, start_beside_supervisor
    from hermes_sup.local import statedir

    try:
        # What the supervisor would refuse, refused before the fork.
        for name in (statedir.CONTROL_SOCKET, statedir.WORKER_SOCKET):
            statedir.endpoint(settings.state_dir, name)
    except statedir.StateDirError as exc:
        raise click.ClickException(str(exc)) from None
    web_dir = Path(settings.http_web) if settings.http_web else None
    argv = to_argv(API_SETTINGS, endpoint_settings(config, {}))
    try:
        start_beside_supervisor(
            settings.state_dir, settings.data_dir, settings.http, settings.log_level, web_dir, argv
        )
    except HttpSetupError as exc:
        raise click.ClickException(str(exc)) from None


@click.command()
@click.option(
    "--connection",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    default=None,
    help="A remote supervisor's connection file (`hermes-sup keys generate`); "
    "without it, the local supervisor of --state-dir.",
)
@click.option(
    "--listen",
    default=str(DEFAULT_PORT),
    show_default=True,
    metavar="[HOST:]PORT",
    help="Where to serve: PORT on 127.0.0.1, or HOST:PORT (0.0.0.0:PORT for every interface).",
)
@DATA_DIR
@config_option("http_api")
@setting_options(API_SETTINGS)
@web_dir_option("--web", "web_dir", "Also")
@setting_option(SETTINGS["log_level"])
@click.pass_context  # type: ignore[arg-type]
def http(
    ctx: click.Context,
    connection: Path | None,
    listen: str,
    data_dir: Path | None,
    config: Path | None,
    web_dir: Path | None,
    log_level: str | None,
    **given: Any,
) -> None:
    """Serve Hermes's HTTP API (chat completions, runs) in front of a
    supervisor, each conversation in its own session. Runs until SIGTERM or
    Ctrl-C; answers 503 while the supervisor is unreachable.

    Needs a key from `hermes-sup keys http generate NAME` (the endpoint never
    serves without one). `serve --http PORT` runs the same endpoint beside a
    local supervisor instead.

    \b
    Examples:
      hermes-sup http --listen 8642
      hermes-sup http --connection web-eu.json --listen 0.0.0.0:8642 --data-dir /etc/hs-http
      hermes-sup http --listen 8642 --web examples/web   # the chat page at http://127.0.0.1:8642/
      hermes-sup http --listen 8642 --cors-origin https://chat.example.com
      hermes-sup http --config /etc/hermes-sup/config.toml   # its [http_api] table
    """
    _need_http_extra()
    argv = ["--data-dir", str(data_dir or default_data_dir()), "--listen", listen]
    if connection is not None:
        argv += ["--connection", str(connection)]
    else:
        argv += ["--state-dir", str(ctx.obj["state_dir"])]
    argv += to_argv(
        API_SETTINGS, endpoint_settings(config, given_settings(ctx, API_SETTINGS, given))
    )
    from hermes_sup.httpapi.serve import HttpSetupError, check_web_dir, parse_listen, require_keys
    from hermes_sup.httpapi.serve import main as serve_main

    try:  # the same checks the endpoint makes, as this command's usage errors
        parse_listen(listen)
        require_keys(data_dir or default_data_dir())
        if web_dir is not None:
            argv += ["--web", str(check_web_dir(web_dir))]
    except HttpSetupError as exc:
        raise click.ClickException(str(exc)) from None
    serve_main([*argv, "--log-level", log_level or SETTINGS["log_level"].default])


# ---------------------------------------------------------------- keys


@click.group(name="http")
def http_keys() -> None:
    """Bearer keys of the HTTP endpoint (serve --http, hermes-sup http).

    Each key is a tenant: it reaches its own sessions, runs and responses
    only, unless granted more. Only a hash of each key is stored; keys are
    read at every request, so changes need no restart.
    """


GRANT_OPTIONS = [
    click.option(
        "--prefix",
        "grants",
        multiple=True,
        metavar="PATTERN",
        help="Also reach sessions outside every key's namespace whose key starts so "
        "('telegram:*'), or one session by its key; repeat for more.",
    ),
    click.option(
        "--admin",
        is_flag=True,
        help="Reach everything: any session by its key, every key's runs and responses.",
    ),
]


def _grant_options(command: Any) -> Any:
    for option in reversed(GRANT_OPTIONS):
        command = option(command)
    return command


def _write_key(key: str, output: Path | None, what: str) -> None:
    if output is None:
        click.echo(key)
        return
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    click.echo(f"{what}\nwrote its key to {output}")


@http_keys.command(name="generate")
@click.argument("name")
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the key to this file (0600) instead of printing it.",
)
@_grant_options
@DATA_DIR
def http_keys_generate(
    name: str, output: Path | None, grants: tuple[str, ...], admin: bool, data_dir: Path | None
) -> None:
    """Make a key for the front end NAME and allow it. The key is shown
    once: give it to the front end as its API key (hermes-webui:
    HERMES_WEBUI_GATEWAY_API_KEY; the Hermes gateway: GATEWAY_PROXY_KEY;
    OpenAI clients: api_key).

    A key reaches only its own sessions, runs and responses (a namespace
    of its own: two keys that send the same session id reach two
    sessions), unless granted more with --prefix or --admin, here or later
    with `keys http grant`.

    \b
    Example:
      hermes-sup keys http generate webui
      hermes-sup keys http generate gateway --prefix 'telegram:*'
    """
    from hermes_sup.httpapi.keys import KeyFileError, KeyStore

    if output is not None and output.exists():
        raise click.ClickException(f"{output} exists; choose another --output")
    try:
        key = KeyStore(data_dir or default_data_dir()).generate(name, grants, admin)
    except (KeyFileError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    _write_key(key, output, f"allowed {name}")


@http_keys.command(name="list")
@DATA_DIR
def http_keys_list(data_dir: Path | None) -> None:
    """The allowed front ends: name, the namespace of their sessions, and
    what each may reach."""
    from hermes_sup.httpapi.keys import KeyStore

    tenants = KeyStore(data_dir or default_data_dir()).tenants()
    if not tenants:
        click.echo("no HTTP keys: the endpoint will not serve")
    for tenant in tenants:
        click.echo(f"{tenant.name}  sessions {tenant.prefix}*  reaches {tenant.scope()}")


@http_keys.command(name="grant")
@click.argument("name")
@_grant_options
@click.option("--reset", is_flag=True, help="Drop every grant first (alone: own sessions only).")
@DATA_DIR
def http_keys_grant(
    name: str, grants: tuple[str, ...], admin: bool, reset: bool, data_dir: Path | None
) -> None:
    """Let NAME's key reach more (--prefix, --admin), or less (--reset),
    from the next request on; its key and its sessions stay.

    \b
    Example:
      hermes-sup keys http grant gateway --prefix 'telegram:*'
      hermes-sup keys http grant gateway --reset
    """
    from hermes_sup.httpapi.keys import KeyFileError, KeyStore

    if not (grants or admin or reset):
        raise click.UsageError("give --prefix PATTERN, --admin or --reset")
    try:
        tenant = KeyStore(data_dir or default_data_dir()).grant(
            name, grants, admin=True if admin else None, reset=reset
        )
    except (KeyFileError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"{name} reaches {tenant.scope()}")


@http_keys.command(name="rotate")
@click.argument("name")
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the new key to this file (0600) instead of printing it.",
)
@DATA_DIR
def http_keys_rotate(name: str, output: Path | None, data_dir: Path | None) -> None:
    """Give NAME a new key to the same sessions, runs and grants; the old
    key is refused from the next request on. (A key revoked and generated
    again gets a new namespace: none of the old key's sessions.)"""
    from hermes_sup.httpapi.keys import KeyFileError, KeyStore

    if output is not None and output.exists():
        raise click.ClickException(f"{output} exists; choose another --output")
    try:
        key = KeyStore(data_dir or default_data_dir()).rotate(name)
    except (KeyFileError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    _write_key(key, output, f"rotated {name}")


@http_keys.command(name="revoke")
@click.argument("name")
@DATA_DIR
def http_keys_revoke(name: str, data_dir: Path | None) -> None:
    """Refuse NAME's key from the next request on. Its sessions stay (under
    its namespace, `hermes-sup list --prefix NAME+`) but only an admin key
    reaches them: a key generated again as NAME gets a namespace of its own. To
    give NAME a new key to the same sessions, `rotate` it instead."""
    from hermes_sup.httpapi.keys import KeyFileError, KeyStore

    try:
        found = KeyStore(data_dir or default_data_dir()).revoke(name)
    except KeyFileError as exc:
        raise click.ClickException(str(exc)) from None
    if not found:
        raise click.ClickException(f"no HTTP key named {name!r}")
    click.echo(f"revoked {name}")
