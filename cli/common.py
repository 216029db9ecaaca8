"""What the client commands share: connecting to the supervisor with
errors turned into one line, the session argument and its completion, the
options of a session's new worker, durations, and the exit codes.

Exit codes: 0 ok, 1 error, 2 usage, 3 supervisor not running, 130 a turn
cancelled with Ctrl-C.
"""

from __future__ import annotations

import shlex
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import IntEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

# The errors only: the client itself (zmq, its protocol core) is imported
# by `connect`, when a command talks to the supervisor, not for --help or Tab.
from hermes_sup.client.connection import session_options
from hermes_sup.client.errors import ClientError, NotRunning, Starting, SupervisorError

if TYPE_CHECKING:
    from hermes_sup.client.blocking import Client

from .options import parse_pairs
from .terminal import is_terminal, neutralize


class Exit(IntEnum):
    """Every command's exit codes, one table (docs/cli.md shows it; a test
    holds the two alike). `send` is the one exception, and only by choice of
    the turn: where the runtime reports the turn's own exit status (the
    probe's `sh`), send exits with it, as ssh does with the remote command's."""

    OK = 0  # done
    ERROR = 1  # failed; one line on stderr says why
    USAGE = 2  # a bad option, argument or file name (click's own)
    NOT_RUNNING = 3  # no supervisor answers at the state dir; the line says how to start one
    UNKNOWN = 4  # turn status: no such turn (it never started; sending it again runs it once)
    PENDING = 5  # turn status: the turn is queued or running
    STARTING = 6  # the supervisor is starting (the sealed Hermes preload); the line says how far
    INTERRUPTED = 130  # a turn cancelled with Ctrl-C (128 + SIGINT, as shells say)


class NotRunningError(click.ClickException):
    """The supervisor is not running: exit 3 with how to start it."""

    exit_code = Exit.NOT_RUNNING


class StartingError(click.ClickException):
    """The supervisor is starting: exit 6, saying how far it is."""

    exit_code = Exit.STARTING


# While a start is under way, how often `send` looks again.
STARTING_POLL = 0.5


def one_line(exc: BaseException) -> str:
    """An error for stderr: one line, with any control character a session
    put in it made visible on a terminal."""
    text = str(exc)
    return neutralize(text) if is_terminal(sys.stderr) else text


def start_hint(ctx: click.Context) -> str:
    """`hermes-sup [--state-dir D]`: the start of a command to suggest."""
    if ctx.obj.get("connection") is not None:
        return f"hermes-sup --connection {shlex.quote(str(ctx.obj['connection']))}"
    if ctx.obj.get("state_dir_given"):
        return f"hermes-sup --state-dir {shlex.quote(str(ctx.obj['state_dir']))}"
    return "hermes-sup"


@contextmanager
def connect(
    ctx: click.Context, when_down: str = "", wait_start: float | None = 0.0
) -> Iterator[Client]:
    """A client for the command, with errors turned into one-line messages;
    `when_down`, if given, is added to the one saying the supervisor is not
    running (what the command can do without it). A supervisor that is
    starting is waited for up to `wait_start` seconds (None: until its start
    ends, either way), saying so on stderr; past that the command exits 6."""
    from hermes_sup.client.blocking import Client

    state_dir: Path = ctx.obj["state_dir"]
    connection: Path | None = ctx.obj.get("connection")

    def make() -> Client:
        if connection is not None:
            return Client.from_connection_file(connection, timeout=ctx.obj["timeout"])
        return Client(state_dir, timeout=ctx.obj["timeout"])

    try:
        client = _when_started(make, wait_start)
    except Starting as exc:
        raise StartingError(one_line(exc) + "; it answers once that is done") from None
    except NotRunning as exc:
        raise NotRunningError(
            f"{exc}. Start it with: hermes-sup --state-dir {shlex.quote(str(state_dir))} serve"
            + (f"; {when_down}" if when_down else "")
        ) from None
    except ClientError as exc:  # permission denied, a bad connection file
        raise click.ClickException(one_line(exc)) from None
    try:
        yield client
    except NotRunning as exc:
        raise NotRunningError(one_line(exc) + (f"; {when_down}" if when_down else "")) from None
    except SupervisorError as exc:
        raise click.ClickException(one_line(exc)) from None
    except ClientError as exc:
        raise click.ClickException(one_line(exc)) from None
    finally:
        client.close()


def _when_started(make: Callable[[], Client], wait: float | None) -> Client:
    """`make()`, tried again while the supervisor says it is starting, for up
    to `wait` seconds (None: as long as the start goes on; a start that fails
    lets its lock go, and `make` then raises NotRunning)."""
    deadline = None if wait is None else time.monotonic() + wait
    said = ""
    while True:
        try:
            return make()
        except Starting as exc:
            if deadline is not None and time.monotonic() >= deadline:
                raise
            stage = str(exc.report.get("stage"))
            if stage != said:  # one line a stage, not one a poll
                click.echo(f"· {one_line(exc)}; waiting for it", err=True)
                said = stage
            time.sleep(STARTING_POLL)


def complete_sessions(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[Any]:
    """Shell completion of session keys, asked of the running supervisor."""
    from click.shell_completion import CompletionItem

    from hermes_sup.client.blocking import Client

    obj = ctx.obj if isinstance(ctx.obj, dict) else {}
    state_dir = obj.get("state_dir") or ctx.find_root().params.get("state_dir")
    try:
        with Client(Path(state_dir) if state_dir else None, timeout=1.0) as client:
            rows = client.sessions(prefix=incomplete)
    except Exception:
        return []
    return [CompletionItem(r["key"], help=r["state"]) for r in rows]


SESSION = click.argument("session", shell_complete=complete_sessions)
RAW = click.option(
    "--raw",
    is_flag=True,
    help="Write the session's output byte-exact even to a terminal (control sequences "
    "and all); by default they are shown escaped on a terminal.",
)


def options_from(
    session_env: tuple[str, ...], workspace: str | None, runtime: str | None
) -> dict[str, Any] | None:
    return session_options(
        session_env=parse_pairs(session_env, "--session-env") if session_env else None,
        workspace=str(Path(workspace).absolute()) if workspace else None,
        runtime=runtime,
    )


def new_session_options(func: Any) -> Any:
    """--session-env, --workspace, --runtime: options of a session's new worker."""
    func = click.option(
        "--runtime", default=None, help="A runtime the supervisor allows (--allow-runtime)."
    )(func)
    func = click.option(
        "--workspace",
        default=None,
        help="Work in this directory (under one of the supervisor's --workspace-root).",
    )(func)
    return click.option(
        "--session-env",
        "session_env",
        multiple=True,
        help="NAME=VALUE given to a new worker as HERMES_SESSION_NAME (repeat).",
    )(func)


def parse_duration(text: str) -> float:
    """'90', '90s', '10m', '2h', '1h30m', '1d' -> seconds; a usage error else."""
    from hermes_sup.local.durations import parse_duration as parse

    try:
        return parse(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
