"""The options every client command takes, before or after its name, and
the options of a service's settings.

`hermes-sup --state-dir D list` and `hermes-sup list --state-dir D` mean the
same: the group stores its values in `ctx.obj`, and a subcommand's own copy
of the option, given on its command line, overrides them there (its
callback runs after the group's). The environment variable is read once,
by the group.

A service's settings (`serve`'s, the HTTP endpoint's, the router's, `ray
up`'s: local/settings.py) become its options here, one per setting, each
reading its value as the configuration file would (`setting_options`);
`given_settings` says which the command line (or the environment) set, to
lay over the file's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import click

from hermes_sup.local.durations import parse_duration
from hermes_sup.local.settings import Setting
from hermes_sup.supervisor.config import SETTINGS, default_state_dir

C = TypeVar("C", bound=click.Command)
F = TypeVar("F", bound=Callable[..., Any])
DEFAULT_TIMEOUT = 10.0
CONNECTION_ENV = "HERMES_SUP_CONNECTION"


class Seconds(click.ParamType):  # type: ignore[type-arg]
    """A positive, finite number of seconds: 0, -1, nan and inf are refused
    as usage errors (exit 2) with one line, never a traceback."""

    name = "seconds"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        else:
            try:
                number = float(str(value).strip())
            except ValueError:
                self.fail(f"{value!r} is not a number of seconds (e.g. 10 or 0.5)", param, ctx)
        if not math.isfinite(number) or number <= 0:
            self.fail(f"{value!r} is not a positive number of seconds (e.g. 10 or 0.5)", param, ctx)
        return number


SECONDS = Seconds()
# The state_dir setting's, as every command's --state-dir names it.
STATE_DIR_HELP = SETTINGS["state_dir"].option_help()
TIMEOUT_HELP = "Seconds to wait for the supervisor to answer [10]."
CONNECTION_HELP = (
    f"Talk to a remote supervisor through this connection file (hermes-sup keys "
    f"generate) [env {CONNECTION_ENV}]."
)


def init_obj(
    ctx: click.Context, state_dir: Path | None, timeout: float, connection: Path | None
) -> None:
    """The group's values, which subcommands read (and may override)."""
    ctx.obj = {
        "state_dir": state_dir or default_state_dir(),
        "state_dir_given": state_dir is not None,
        "timeout": timeout,
        "connection": connection,
    }


def _obj(ctx: click.Context) -> dict[str, Any]:
    if ctx.obj is None:  # a subcommand invoked on its own (tests, embedding)
        init_obj(ctx, None, DEFAULT_TIMEOUT, None)
    assert isinstance(ctx.obj, dict)
    return ctx.obj


def _set_state_dir(ctx: click.Context, param: click.Parameter, value: Path | None) -> None:
    obj = _obj(ctx)
    if value is not None:
        obj["state_dir"], obj["state_dir_given"] = value, True


def _set_timeout(ctx: click.Context, param: click.Parameter, value: float | None) -> None:
    obj = _obj(ctx)
    if value is not None:
        obj["timeout"] = value


def _set_connection(ctx: click.Context, param: click.Parameter, value: Path | None) -> None:
    obj = _obj(ctx)
    if value is not None:
        obj["connection"] = value


def state_dir_option() -> click.Option:
    """A subcommand's --state-dir (no envvar: the group reads it)."""
    return click.Option(
        ["--state-dir"],
        type=click.Path(file_okay=False, readable=False, path_type=Path),
        default=None,
        expose_value=False,
        callback=_set_state_dir,
        help=STATE_DIR_HELP,
    )


def timeout_option() -> click.Option:
    """A subcommand's --timeout."""
    return click.Option(
        ["--timeout"],
        type=SECONDS,
        default=None,
        expose_value=False,
        callback=_set_timeout,
        help=TIMEOUT_HELP,
    )


def connection_option() -> click.Option:
    """A subcommand's --connection."""
    return click.Option(
        ["--connection"],
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        expose_value=False,
        callback=_set_connection,
        help=CONNECTION_HELP,
    )


def client_options(command: C) -> C:
    """--state-dir, --timeout and --connection on a client command too
    (a decorator above `@cli.command()`)."""
    command.params.extend([state_dir_option(), timeout_option(), connection_option()])
    return command


WEB_DIR_HELP = (
    "serve this directory's static files at / (a page such as "
    "examples/web; they need no key, the API still does)."
)


def web_dir_option(flag: str, dest: str, help_prefix: str) -> Callable[[F], F]:
    """A directory of static files served beside the HTTP API (`http
    --web`): it must exist when the command starts."""
    return click.option(
        flag,
        dest,
        type=click.Path(file_okay=False, exists=True, path_type=Path),
        default=None,
        metavar="DIR",
        help=f"{help_prefix} {WEB_DIR_HELP}",
    )


# ---------------------------------------------------------------- settings


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
    """A number setting's value: within its bounds, and for one that may be
    off (or derived), 0 or "none" is None."""

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
        if number == 0 and optional:
            return None
        fault = self.setting.out_of_bounds(number)
        if fault is not None:
            # As click's own ranges say it: "'-1' is negative".
            said = fault.replace("must not be negative", "is negative")
            said = said.replace("must be at least", "is less than")
            self.fail(f"{value!r} {said}", param, ctx)
        return number


def option_type(setting: Setting) -> Any:
    """The click type that reads a setting's flag."""
    if setting.table:  # --agent-config: the file that holds the table
        return click.Path(dir_okay=False, exists=True, path_type=Path)
    if setting.base in (int, float):
        return SettingNumber(setting)
    if setting.base is Path:
        return click.Path(file_okay=False, path_type=Path)
    if setting.choices:
        # Case as people type it (--log-level INFO): the value is the choice's.
        return click.Choice(setting.choices, case_sensitive=False)
    return click.STRING


def from_command_line(setting: Setting, value: Any) -> Any:
    """A flag's value as the service holds it (a usage error if it cannot be)."""
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


Reader = Callable[[Setting, Any], Any]


def setting_option(setting: Setting, read: Reader = from_command_line) -> Callable[[F], F]:
    """The option of one setting, `setting.flag` (and its aliases); `read`
    turns what was given into the service's value."""

    def convert(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        # Only what was given: the rest stays None (or ()), for the file and
        # the defaults to decide.
        if value is None or value == ():
            return value
        return read(setting, value)

    return click.option(
        setting.flag,
        *setting.aliases,
        setting.name,
        type=option_type(setting),
        multiple=setting.repeatable,
        default=None,
        envvar=setting.envvar,
        metavar=setting.metavar,
        callback=convert,
        help=setting.option_help(),
    )


def setting_options(
    table: Mapping[str, Setting], skip: tuple[str, ...] = (), read: Reader = from_command_line
) -> Callable[[F], F]:
    """One option per setting of `table` that has a flag (but those in
    `skip`), in the table's order."""
    chosen = [s for s in table.values() if s.flag and s.name not in skip]

    def decorate(func: F) -> F:
        for s in reversed(chosen):
            func = setting_option(s, read)(func)
        return func

    return decorate


def given_settings(
    ctx: click.Context, table: Mapping[str, Setting], params: Mapping[str, Any]
) -> dict[str, Any]:
    """The settings the command line (or an option's environment variable)
    set, which win over the file's."""
    sources = (click.core.ParameterSource.COMMANDLINE, click.core.ParameterSource.ENVIRONMENT)
    return {
        name: value
        for name, value in params.items()
        if name in table and ctx.get_parameter_source(name) in sources
    }


def section_values(path: Path | None, section: str, table: Mapping[str, Setting]) -> dict[str, Any]:
    """A service's table of the configuration file (`[route]`), checked:
    {field name: value}, empty without a file or the table. Every bad key
    at once, as a ClickException naming the file and the key."""
    if path is None:
        return {}
    import tomllib

    from hermes_sup.local.settings import read_table

    try:
        raw = tomllib.loads(path.read_text())
    except OSError as exc:
        raise click.ClickException(f"{path}: cannot read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise click.ClickException(f"{path}: not valid TOML: {exc}") from None
    if section not in raw:
        return {}
    values, errors = read_table(table, raw[section], f"{path}: [{section}]")
    if errors:
        raise click.ClickException("\n".join(errors))
    return values


def config_option(what: str) -> Callable[[F], F]:
    """--config FILE of a service other than serve: the file serve reads,
    of which this service reads its own table."""
    return click.option(
        "--config",
        type=click.Path(dir_okay=False, exists=True, path_type=Path),
        envvar="HERMES_SUP_CONFIG",
        default=None,
        help=f"TOML file whose [{what}] table holds any of these settings (flags override it) "
        "[env HERMES_SUP_CONFIG].",
    )
