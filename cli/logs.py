"""`hermes-sup logs`: a session's worker log, from the supervisor or, with
--data-dir, from disk while the supervisor is down (logfiles.py).

Every stored line carries the time the supervisor stored it (see
supervisor/logs.py), so lines can be chosen by time (`--since`, `--until`,
both included) and shown with it (`-t`), as `docker logs` does. The
supervisor chooses the lines of a `logs` request; the lines of a follow come
with their stamp, and this side stops a follow once `--until` has passed.
"""

from __future__ import annotations

import json
import re
import shlex
import time
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

import click

from hermes_sup.client import Timeout
from hermes_sup.protocol import Kind
from hermes_sup.supervisor.config import DATA_DIR_ENV, default_data_dir
from hermes_sup.supervisor.logread import MAX_LOG_TAIL, format_stamp, split_stamp, stamp_seconds

from .common import RAW, SESSION, connect, parse_duration, start_hint
from .options import client_options
from .terminal import Screen

DEFAULT_LINES = 50
_EPOCH = re.compile(r"[0-9]+(\.[0-9]*)?")
_DURATION = re.compile(r"([0-9]+(\.[0-9]*)?[smhd])+")
TIME_FORMS = (
    "an RFC 3339 time (2026-12-01T10:00:00Z), a date (2026-12-01, local time without an "
    "offset), a duration before now (90s, 10m, 2h, 1d, 1h30m) or seconds since the epoch"
)


def parse_time(text: str, now: float) -> float:
    """`text` as seconds since the epoch: an ISO 8601 / RFC 3339 date or
    time (local time if it names no offset, as docker reads it), a duration
    before `now` (`10m`), or a bare number, which is seconds since the epoch
    (as docker reads it). ValueError says what is accepted."""
    value = text.strip()
    if _EPOCH.fullmatch(value):
        return float(value)
    if _DURATION.fullmatch(value.lower()):
        return now - parse_duration(value)
    try:
        # RFC 3339 allows a lower-case t and z; fromisoformat does not.
        return datetime.fromisoformat(value.upper()).timestamp()
    except (ValueError, OverflowError, OSError):
        pass
    raise ValueError(f"{text!r} is not a time: use {TIME_FORMS}")


class TimeParam(click.ParamType):  # type: ignore[type-arg]
    """A point in time given as parse_time reads it; anything else is a
    usage error (exit 2) that names the option."""

    name = "time"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        if isinstance(value, float):
            return value
        try:
            return parse_time(str(value), time.time())
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


TIME = TimeParam()


class Window:
    """The times asked for, as stamps: stamps sort as text, so a line's
    stamp is compared as it is. A line without a stamp (stored before
    stamps were) counts as older than any time: `since` drops it."""

    def __init__(self, since: float | None, until: float | None) -> None:
        self.since, self.until = since, until
        self.low = format_stamp(since, up=True) if since is not None else None
        self.high = format_stamp(until) if until is not None else None

    def keeps(self, stamp: str | None) -> bool:
        """Whether a line stamped `stamp` is in the window."""
        if stamp is None:
            return self.low is None
        return (self.low is None or stamp >= self.low) and (self.high is None or stamp <= self.high)

    def over(self, stamp: str | None, now: float, slack: float) -> bool:
        """Whether a follow is done: a line stamped after `until` came, or
        `until` was `slack` seconds ago (lines are stamped before they are
        written, and read a little after)."""
        if self.until is None:
            return False
        return (stamp is not None and self.high is not None and stamp > self.high) or (
            now > self.until + slack
        )


class LogPrinter:
    """Prints lines as asked: the text alone, `<stamp> <text>` (-t), or
    `{"ts": seconds or null, "line": text}` a line (--json)."""

    def __init__(self, screen: Screen, timestamps: bool, as_json: bool) -> None:
        self.screen = screen
        self.timestamps = timestamps
        self.as_json = as_json

    @property
    def wants_stamps(self) -> bool:
        """Whether lines must come with their stamps."""
        return self.timestamps or self.as_json

    def stored(self, line: str) -> None:
        """A line as stored: its stamp (if any), a space, its text."""
        self.show(*split_stamp(line))

    def show(self, stamp: str | None, text: str) -> None:
        """One line, with its stamp (None: stored without one)."""
        if self.as_json:
            ts = stamp_seconds(stamp) if stamp is not None else None
            # ensure_ascii: every control character arrives escaped.
            click.echo(json.dumps({"ts": ts, "line": text}))
        elif self.timestamps and stamp is not None:
            self.screen.out(f"{stamp} {text}")
        else:
            self.screen.out(text)


@client_options
@click.command()
@SESSION
@click.option(
    "-n",
    "--lines",
    type=int,
    default=None,
    help=f"Lines to show from the end, of those chosen [default: {DEFAULT_LINES}; "
    "with --since or --until, all of them].",
)
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines (across rotation).")
@click.option(
    "--since",
    type=TIME,
    default=None,
    help="Only lines stored at or after TIME: 2026-12-01T10:00:00Z, 2026-12-01, a duration "
    "before now (10m, 2h, 1d) or seconds since the epoch. Lines stored without a "
    "timestamp (an older log) are left out.",
)
@click.option(
    "--until",
    type=TIME,
    default=None,
    help="Only lines stored at or before TIME (same forms as --since); with -f, stop "
    "following once it has passed.",
)
@click.option(
    "-t",
    "--timestamps",
    is_flag=True,
    help="Show when each line was stored (RFC 3339, UTC, to the microsecond).",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help='One JSON object a line: {"ts": seconds since the epoch (null for a line stored '
    'without a timestamp), "line": text}.',
)
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
    ctx: click.Context,
    session: str,
    lines: int | None,
    follow: bool,
    since: float | None,
    until: float | None,
    timestamps: bool,
    as_json: bool,
    data_dir: Path | None,
    raw: bool,
) -> None:
    """Print a session's worker log (its stdout and stderr).

    Every line is stored with the time the supervisor stored it: --since and
    --until choose lines by it, -t shows it. With --data-dir the log is read
    from disk, so it works with the supervisor down (hermes-sup inspect
    names a session's directory).

    \b
    Examples:
      hermes-sup logs alice -n 100
      hermes-sup logs alice -f
      hermes-sup logs alice --since 10m -t
      hermes-sup logs alice --since 2026-12-01T09:00:00Z --until 2026-12-01T10:00:00Z
      hermes-sup logs alice --data-dir /var/lib/hermes-sup
    """
    if lines is None:
        lines = MAX_LOG_TAIL if since is not None or until is not None else DEFAULT_LINES
    count = max(0, lines)
    window = Window(since, until)
    printer = LogPrinter(Screen(raw), timestamps, as_json)
    # A follow whose --until has already passed has nothing to wait for.
    follow = follow and not window.over(None, time.time(), 0.0)
    if data_dir is not None:
        _logs_from_disk(printer, session, count, follow, window, data_dir)
        return
    body: dict[str, Any] = {"lines": count, "follow": follow}
    if printer.wants_stamps:
        body["timestamps"] = True
    if since is not None:
        body["since"] = since
    if until is not None:
        body["until"] = until
    # Down, the supervisor cannot send the log; the log is on disk all the same.
    from_disk = (
        f"or read the log from disk: {start_hint(ctx)} logs {shlex.quote(session)} --data-dir "
        f"DIR ('-': the default, {default_data_dir()})"
    )
    with connect(ctx, when_down=from_disk) as client:
        req = client.submit(Kind.LOGS, body, session=session)
        _print_all(printer, client.answer(req).body["lines"])
        if not follow:
            return
        try:
            while True:
                try:
                    msg = client.answer(req, timeout=1.0)
                except Timeout:
                    # A supervisor that went away raises NotRunning instead.
                    if window.over(None, time.time(), 1.0):
                        break
                    continue
                if msg.body.get("type") != "log":
                    continue
                stamp = msg.body.get("ts")
                stamp = stamp if isinstance(stamp, str) else None
                if window.over(stamp, time.time(), 1.0):
                    break
                if stamp is None or window.keeps(stamp):
                    printer.show(stamp, msg.body["data"])
        except KeyboardInterrupt:
            pass
        client.submit(Kind.UNWATCH, {"watch": req})


def _logs_from_disk(
    printer: LogPrinter, key: str, count: int, follow: bool, window: Window, data_dir: Path
) -> None:
    from hermes_sup.protocol import RemoteProtocolError, check_session_key

    from .logfiles import POLL, session_log, tail
    from .logfiles import follow as follow_file

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
        chosen = tail(path, count, window.since, window.until, printer.wants_stamps)
        _print_all(printer, chosen)
        if follow:
            stop = window.until + 2 * POLL if window.until is not None else None
            for line in follow_file(path, stop_after=stop):
                stamp, text = split_stamp(line)
                if window.over(stamp, time.time(), 2 * POLL):
                    break
                if window.keeps(stamp):
                    printer.show(stamp, text)
    except KeyboardInterrupt:
        pass
    except PermissionError as exc:
        raise click.ClickException(
            f"permission denied reading {exc.filename}: run this as the supervisor's user"
        ) from None


def _print_all(printer: LogPrinter, lines: Iterable[str]) -> None:
    """Lines of a `logs` answer: stored ones (with stamps) if the printer
    asked for them, else the text alone."""
    for line in lines:
        if printer.wants_stamps:
            printer.stored(line)
        else:
            printer.screen.out(line)
