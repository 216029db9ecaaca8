"""The options every client command takes, before or after its name.

`hermes-sup --state-dir D list` and `hermes-sup list --state-dir D` mean the
same: the group stores its values in `ctx.obj`, and a subcommand's own copy
of the option, given on its command line, overrides them there (its
callback runs after the group's). The environment variable is read once,
by the group.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

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


# Options of `http`, which `serve --http` starts in a process of its own,
# passing these on: its --log-level is the log_level setting's.
LOG_LEVEL = click.option(
    "--log-level",
    type=click.Choice(SETTINGS["log_level"].choices),
    default=SETTINGS["log_level"].default,
    show_default=True,
)
WEB_DIR_HELP = (
    "serve this directory's static files at / (a page such as "
    "examples/web; they need no key, the API still does)."
)


def web_dir_option(flag: str, dest: str, help_prefix: str) -> Callable[[F], F]:
    """A directory of static files served beside the HTTP API (`http
    --web`, `serve --http-web`): it must exist when the command starts."""
    return click.option(
        flag,
        dest,
        type=click.Path(file_okay=False, exists=True, path_type=Path),
        default=None,
        metavar="DIR",
        help=f"{help_prefix} {WEB_DIR_HELP}",
    )
