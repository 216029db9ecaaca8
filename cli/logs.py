"""`hermes-sup logs`: a session's worker log, from the supervisor or, with
--data-dir, from disk while the supervisor is down (logfiles.py)."""

from __future__ import annotations

from pathlib import Path

import click

from hermes_sup.client import Timeout
from hermes_sup.protocol import Kind
from hermes_sup.supervisor.config import DATA_DIR_ENV, default_data_dir

from .common import RAW, SESSION, connect
from .options import client_options
from .terminal import Screen


@client_options
@click.command()
@SESSION
@click.option("-n", "--lines", default=50, show_default=True, help="Lines to show from the end.")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines (across rotation).")
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Read the log from this data directory, without the supervisor (it may be down); "
    f"'-' for the default one [env {DATA_DIR_ENV}].",
)
@RAW
@click.pass_context
def logs(
    ctx: click.Context, session: str, lines: int, follow: bool, data_dir: Path | None, raw: bool
) -> None:
    """Print a session's worker log (its stdout and stderr).

    With --data-dir it is read from disk, so it works with the supervisor
    down (hermes-sup inspect names a session's directory).

    \b
    Examples:
      hermes-sup logs alice -n 100
      hermes-sup logs alice -f
      hermes-sup logs alice --data-dir /var/lib/hermes-sup
    """
    screen = Screen(raw)
    if data_dir is not None:
        _logs_from_disk(screen, session, lines, follow, data_dir)
        return
    with connect(ctx) as client:
        req = client.submit(Kind.LOGS, {"lines": max(0, lines), "follow": follow}, session=session)
        first = client.answer(req)
        for line in first.body["lines"]:
            screen.out(line)
        if not follow:
            return
        try:
            while True:
                try:
                    msg = client.answer(req, timeout=1.0)
                except Timeout:
                    continue  # a supervisor that went away raises NotRunning instead
                if msg.body.get("type") == "log":
                    screen.out(msg.body["data"])
        except KeyboardInterrupt:
            client.submit(Kind.UNWATCH, {"watch": req})


def _logs_from_disk(screen: Screen, key: str, lines: int, follow: bool, data_dir: Path) -> None:
    from hermes_sup.protocol import RemoteProtocolError, check_session_key

    from .logfiles import follow as follow_file
    from .logfiles import session_log, tail

    try:
        check_session_key(key)
    except RemoteProtocolError as exc:
        raise click.BadParameter(exc.message, param_hint="SESSION") from None
    if str(data_dir) == "-":
        data_dir = default_data_dir()
    path = session_log(data_dir, key)
    if not path.parent.is_dir():
        if not (data_dir / "sessions").is_dir():
            raise click.ClickException(
                f"{data_dir} holds no sessions: is it the supervisor's --data-dir?"
            )
        raise click.ClickException(f"no session {key!r} in {data_dir} (no {path.parent})")
    try:
        for line in tail(path, max(0, lines)):
            screen.out(line)
        if follow:
            for line in follow_file(path):
                screen.out(line)
    except KeyboardInterrupt:
        pass
    except PermissionError as exc:
        raise click.ClickException(
            f"permission denied reading {exc.filename}: run this as the supervisor's user"
        ) from None
