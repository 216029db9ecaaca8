"""`hermes-sup serve` and its settings: one flag per setting, made from
the table in supervisor/config.py (`SETTINGS`), the merge of what the
command line sets over the --config file, and `hermes-sup config check`,
which reads that file as serve would."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from hermes_sup.local.durations import parse_duration
from hermes_sup.local.version import install_hint
from hermes_sup.supervisor.config import (
    SETTINGS,
    Setting,
    Settings,
    default_data_dir,
    default_state_dir,
)

from .options import state_dir_option, web_dir_option

F = TypeVar("F", bound=Callable[..., Any])


def parse_pairs(values: tuple[str, ...], what: str) -> dict[str, str]:
    """NAME=VALUE option values as a dict; a usage error names the option `what`."""
    out: dict[str, str] = {}
    for item in values:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise click.BadParameter(f"{item!r} is not NAME=VALUE", param_hint=what)
        out[name] = value
    return out


class SettingNumber(click.ParamType):  # type: ignore[type-arg]
    """A number setting's value: not negative, at least its minimum, and
    for one that may be off (or derived), 0 or "none" is None."""

    def __init__(self, setting: Setting) -> None:
        self.setting = setting
        self.kind = setting.base
        self.name = self.kind.__name__

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        optional = self.setting.optional
        if isinstance(value, str) and value.lower() == "none" and optional:
            return None
        try:
            number = self.kind(value)
        except (TypeError, ValueError):
            if not (self.setting.seconds and isinstance(value, str)):
                self.fail(f"{value!r} is not a number", param, ctx)
            try:
                number = parse_duration(value)  # 30m, as kill --idle-for takes
            except ValueError as exc:
                self.fail(str(exc), param, ctx)
        if number < 0:
            self.fail(f"{value!r} is negative", param, ctx)
        if number < self.setting.minimum:
            self.fail(f"{value!r} is less than {self.setting.minimum:g}", param, ctx)
        return None if number == 0 and optional else number


def _option_type(setting: Setting) -> Any:
    if setting.table:  # --agent-config: the file that holds the table
        return click.Path(dir_okay=False, exists=True, path_type=Path)
    if setting.base in (int, float):
        return SettingNumber(setting)
    if setting.base is Path:
        return click.Path(file_okay=False, path_type=Path)
    if setting.choices:
        return click.Choice(setting.choices)
    return click.STRING


def from_command_line(setting: Setting, value: Any) -> Any:
    """A flag's value as Settings holds it (a usage error if it cannot be)."""
    if setting.name == "runtime_config":
        from hermes_sup.supervisor import configfile

        try:
            return configfile.load_agent_config(value)
        except configfile.ConfigError as exc:
            raise click.BadParameter(str(exc), param_hint=setting.flag) from None
    if setting.path:
        # Absolute: the zygote and workers run in other directories than ours.
        if isinstance(value, tuple):
            value = tuple(str(Path(v).absolute()) for v in value)
        elif isinstance(value, Path):
            value = value.absolute()
        elif value:
            value = str(Path(value).absolute())
    if setting.base == dict[str, str]:
        value = parse_pairs(value, setting.flag)
    if setting.extends:
        value = setting.default + value
    why = setting.check(value) if setting.check else None
    if why is not None:
        raise click.BadParameter(why, param_hint=setting.flag)
    return value


def _convert(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    # Only what was given: the rest stays None (or ()), for the file and
    # the defaults to decide.
    if value is None or value == ():
        return value
    assert param.name is not None
    return from_command_line(SETTINGS[param.name], value)


def setting_option(setting: Setting) -> Callable[[F], F]:
    """The option of one setting, `setting.flag` (and its aliases)."""
    return click.option(
        setting.flag,
        *setting.aliases,
        setting.name,
        type=_option_type(setting),
        multiple=setting.repeatable,
        default=None,
        envvar=setting.envvar,
        metavar=setting.metavar,
        callback=_convert,
        help=setting.option_help(),
    )


# Every setting that has a flag, but --state-dir: every command takes that
# one (cli/options.py), serve too.
SERVE_SETTINGS = [s for s in SETTINGS.values() if s.flag and s.name != "state_dir"]


def setting_options(func: F) -> F:
    """One option per setting, in the table's order."""
    for setting in reversed(SERVE_SETTINGS):
        func = setting_option(setting)(func)
    return func


@click.command()
@click.option(
    "--config",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    envvar="HERMES_SUP_CONFIG",
    default=None,
    help="TOML file with any of these settings (flags override it) [env HERMES_SUP_CONFIG].",
)
@click.option(
    "--http",
    "http_listen",
    default=None,
    metavar="[HOST:]PORT",
    help="Also serve Hermes's HTTP API (chat completions, runs) on 127.0.0.1:PORT or HOST:PORT, "
    "in a process of its own; needs `hermes-sup keys http generate` and the http extra.",
)
@web_dir_option("--http-web", "http_web", "With --http, also")
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    envvar="HERMES_SUP_LOG_FORMAT",
    default="text",
    show_default=True,
    help="json: one object a line ({ts, level, event, session, pid, ...}) for journald "
    "and log shippers [env HERMES_SUP_LOG_FORMAT].",
)
@setting_options
@click.pass_context  # type: ignore[arg-type]
def serve(
    ctx: click.Context,
    config: Path | None,
    http_listen: str | None,
    http_web: Path | None,
    log_format: str,
    **given: Any,
) -> None:
    """Run the supervisor in the foreground until SIGTERM or Ctrl-C.

    \b
    Example:
      hermes-sup --state-dir /tmp/hs serve --data-dir /tmp/hs-data
    """
    from hermes_sup.door.remote import RemoteError
    from hermes_sup.local.statedir import StateDirError
    from hermes_sup.supervisor import configfile
    from hermes_sup.supervisor.server import Supervisor

    sources = (click.core.ParameterSource.COMMANDLINE, click.core.ParameterSource.ENVIRONMENT)
    # What the command line (or its environment variables) set wins over the file.
    overrides: dict[str, Any] = {
        name: value for name, value in given.items() if ctx.get_parameter_source(name) in sources
    }
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
    if settings.runtime == "hermes" and not settings.preload:
        from hermes_sup.worker.hermes import HERMES_SAFE_PRELOAD

        settings.preload = tuple(m for m in HERMES_SAFE_PRELOAD if importlib.util.find_spec(m))
    from .serve_log import configure

    configure(settings.log_level, log_format, settings.shutdown_grace)
    if http_web is not None and not http_listen:
        raise click.BadParameter(
            "serves a page beside --http: give --http too", param_hint="--http-web"
        )
    if http_listen:
        from .http import start_http_beside

        start_http_beside(settings, http_listen, http_web)  # forks: before anything else starts
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
