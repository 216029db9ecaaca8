"""`hermes-sup serve` and its settings: one flag per setting, made from
the table in supervisor/config.py (`SETTINGS`), the merge of what the
command line sets over the --config file, and `hermes-sup config check`,
which reads that file as serve would."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import click

from hermes_sup.local.version import install_hint
from hermes_sup.supervisor.config import (
    SETTINGS,
    Setting,
    Settings,
    default_data_dir,
    default_state_dir,
)

from . import options
from .options import given_settings, setting_options, state_dir_option

__all__ = ["config", "config_check", "from_command_line", "serve"]


def from_command_line(setting: Setting, value: Any) -> Any:
    """A flag of serve's as Settings holds it (a usage error if it cannot
    be): --agent-config names the file of the [agent] table."""
    if setting.name == "runtime_config":
        from hermes_sup.supervisor import configfile

        try:
            return configfile.load_agent_config(value)
        except configfile.ConfigError as exc:
            raise click.BadParameter(str(exc), param_hint=setting.flag) from None
    return options.from_command_line(setting, value)


@click.command()
@click.option(
    "--config",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    envvar="HERMES_SUP_CONFIG",
    default=None,
    help="TOML file with any of these settings (flags override it), and the [http_api] "
    "table for --http [env HERMES_SUP_CONFIG].",
)
# Every setting that has a flag, but --state-dir: every command takes that
# one (cli/options.py), serve too.
@setting_options(SETTINGS, skip=("state_dir",), read=from_command_line)
@click.pass_context  # type: ignore[arg-type]
def serve(ctx: click.Context, config: Path | None, **given: Any) -> None:
    """Run the supervisor in the foreground until SIGTERM or Ctrl-C.

    \b
    Example:
      hermes-sup --state-dir /tmp/hs serve --data-dir /tmp/hs-data
    """
    from hermes_sup.door.remote import RemoteError
    from hermes_sup.local.statedir import StateDirError
    from hermes_sup.supervisor import configfile
    from hermes_sup.supervisor.server import Supervisor

    # What the command line (or its environment variables) set wins over the file.
    overrides = given_settings(ctx, SETTINGS, given)
    if ctx.obj["state_dir_given"]:
        overrides["state_dir"] = from_command_line(SETTINGS["state_dir"], ctx.obj["state_dir"])
    base = Settings(state_dir=default_state_dir(), data_dir=default_data_dir())
    try:
        settings = configfile.build(base, config, overrides)
    except configfile.ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    settings.config_file = config
    settings.overrides = overrides
    if settings.metrics:
        from hermes_sup.supervisor.metrics import parse_address

        try:
            parse_address(settings.metrics)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--metrics") from None
        if settings.metrics_token_file:
            from hermes_sup.supervisor.metrics import read_token

            try:
                read_token(settings.metrics_token_file)
            except ValueError as exc:
                raise click.BadParameter(str(exc), param_hint="--metrics-token-file") from None
        if importlib.util.find_spec("prometheus_client") is None:
            raise click.ClickException(
                "metrics need prometheus-client (the metrics extra): " + install_hint("metrics")
            )
    if settings.runtime == "hermes":
        from .configcheck import HERMES_MODULES

        missing = [m for m in HERMES_MODULES if importlib.util.find_spec(m) is None]
        if missing:  # else every session would fail to start, one by one
            raise click.ClickException(
                f"--agent hermes needs hermes-agent (the hermes extra; no {', '.join(missing)}): "
                + install_hint("hermes")
            )
    if settings.runtime == "hermes" and not settings.preload:
        from hermes_sup.worker.hermes import HERMES_SAFE_PRELOAD

        settings.preload = tuple(m for m in HERMES_SAFE_PRELOAD if importlib.util.find_spec(m))
    from .serve_log import configure

    configure(settings.log_level, settings.log_format, settings.shutdown_grace)
    if settings.http_web and not settings.http:
        raise click.BadParameter(
            "serves a page beside --http (`http` in the file): give --http too",
            param_hint="--http-web",
        )
    if settings.http:
        from .http import start_http_beside

        start_http_beside(settings, config)  # forks: before anything else starts
    from hermes_sup.supervisor.sealing import SealingUnavailable

    try:
        code = Supervisor(settings).run()
    except (StateDirError, RemoteError, SealingUnavailable) as exc:
        raise click.ClickException(str(exc)) from None
    sys.exit(code)


# serve --state-dir works as hermes-sup --state-dir serve does.
serve.params.append(state_dir_option())


@click.group()
def config() -> None:
    """Check configuration files."""


@config.command(name="check")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
def config_check(file: Path) -> None:
    """Check FILE as `serve --config` would, without starting anything:
    every bad key at once, then whether its runtime can be imported (and
    hermes-agent is installed for hermes), its preload modules exist and its
    workspace roots are directories.

    \b
    Example:
      hermes-sup config check /etc/hermes-sup/config.toml
    """
    from .configcheck import check_file

    values, errors = check_file(file, progress=lambda text: click.echo(text, err=True))
    for error in errors:
        click.echo(f"Error: {error}", err=True)
    if errors:
        raise click.ClickException(f"{file}: {len(errors)} error(s); nothing was started")
    click.echo(f"{file}: ok ({len(values)} setting(s))")
