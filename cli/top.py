"""`hermes-sup top`: the sessions live, as top shows processes.

A full-screen view (prompt_toolkit) of every session with its state, CPU,
memory, processes, turns, queue, model tokens and age, redrawn every
--interval seconds from `list`; sorted by a key (P, M, T, A, N as top's),
filtered by a part of the key (/), and acting on the selected session:
kill (k), restart (r) or attach (a, Enter: the view comes back when the
attach detaches). Killing and restarting ask first. What it shows is
table logic apart from drawing (top_table.py).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import click

from .common import connect, one_line
from .options import SECONDS, client_options
from .show import size
from .top_table import SORTS, Table

if TYPE_CHECKING:
    from prompt_toolkit.formatted_text import StyleAndTextTuples

    from hermes_sup.client.blocking import Client

HELP = "q quit  ↑↓ select  P/M/T/A/N sort  / filter  k kill  r restart  a attach"


class Top:
    """The view's state and its actions; prompt_toolkit draws it."""

    def __init__(self, client: Client, interval: float, prefix: str) -> None:
        self.client = client
        self.interval = interval
        self.prefix = prefix
        self.table = Table()
        self.all_rows: list[dict[str, Any]] = []
        self.summary = "asking the supervisor..."
        self.message = ""  # the last action's outcome, or why a refresh failed
        self.mode = "normal"  # or "filter" (typing one), "kill" / "restart" (asking)
        self.typed = ""

    # ------------------------------------------------------------ data

    async def refresh_forever(self, redraw: Any) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                rows = await loop.run_in_executor(None, self.client.sessions, self.prefix)
                self.take(rows)
            except Exception as exc:  # the supervisor went away: say so, keep trying
                self.message = f"no answer: {one_line(exc)}"
            redraw()
            await asyncio.sleep(self.interval)

    def take(self, rows: list[dict[str, Any]]) -> None:
        self.all_rows = rows
        self.table.update(rows)
        live = [r for r in rows if r.get("pid")]
        rss = sum(r.get("rss") or 0 for r in rows)
        cpu = sum(r.get("cpu_percent") or 0.0 for r in rows)
        self.summary = (
            f"{len(rows)} session(s), {len(live)} live; CPU {cpu:.1f}%, RSS {size(rss)}; "
            f"sorted by {SORTS[self.table.sort][1]}"
            + (f"; filter {self.table.filter!r}" if self.table.filter else "")
        )

    # ------------------------------------------------------------ actions

    def act(self, action: str, key: str) -> str:
        """Kill or restart session `key` (in a thread: the client blocks)."""
        try:
            if action == "kill":
                killed = self.client.kill(key, timeout=120.0)
                return f"killed {key} ({killed.reason})"
            self.client.kill(key, timeout=120.0)
            opened = self.client.open(key)
            return f"restarted {key}: pid {opened.pid or '?'}"
        except Exception as exc:
            return f"{action} {key}: {one_line(exc)}"

    # ------------------------------------------------------------ drawing

    def screen(self, width: int) -> StyleAndTextTuples:
        header, rows = self.table.lines(width)
        out: StyleAndTextTuples = [("bold", f"hermes-sup top: {self.summary}\n")]
        out.append(("reverse", header.ljust(width) + "\n"))
        if not rows:
            out.append(("", "(no sessions)\n"))
        for selected, line in rows:
            out.append(("reverse bold" if selected else "", line.ljust(width) + "\n"))
        return out

    def cursor_row(self) -> int:
        """The selected row's line on screen (the window scrolls to it)."""
        keys = [r.get("key") for r in self.table.rows]
        return 2 + (keys.index(self.table.selected) if self.table.selected in keys else 0)

    def bottom(self) -> StyleAndTextTuples:
        if self.mode == "filter":
            return [
                ("bold", f"filter (part of the key, Enter to keep, Esc to clear): {self.typed}")
            ]
        if self.mode in ("kill", "restart"):
            return [("bold fg:ansired", f"{self.mode} {self.table.selected}? [y/N]")]
        return [("", self.message + ("  |  " if self.message else "") + HELP)]


def run_view(top: Top) -> str | None:
    """Show the view until q (None) or an attach is asked for (its key)."""
    from prompt_toolkit.application import Application
    from prompt_toolkit.data_structures import Point
    from prompt_toolkit.filters import Condition
    from prompt_toolkit.key_binding import KeyBindings
    from prompt_toolkit.layout import HSplit, Layout, Window
    from prompt_toolkit.layout.controls import FormattedTextControl

    keys = KeyBindings()
    normal = Condition(lambda: top.mode == "normal")
    filtering = Condition(lambda: top.mode == "filter")
    asking = Condition(lambda: top.mode in ("kill", "restart"))
    app: Application[str | None]

    @keys.add("q", filter=normal)
    @keys.add("c-c")
    def _quit(event: Any) -> None:
        event.app.exit(result=None)

    @keys.add("up", filter=normal)
    def _up(event: Any) -> None:
        top.table.move(-1)

    @keys.add("down", filter=normal)
    def _down(event: Any) -> None:
        top.table.move(1)

    @keys.add("home", filter=normal)
    def _first(event: Any) -> None:
        top.table.move(-len(top.table.rows))

    @keys.add("end", filter=normal)
    def _last(event: Any) -> None:
        top.table.move(len(top.table.rows))

    @keys.add("pageup", filter=normal)
    def _page_up(event: Any) -> None:
        top.table.move(-10)

    @keys.add("pagedown", filter=normal)
    def _page_down(event: Any) -> None:
        top.table.move(10)

    for letter in SORTS:

        @keys.add(letter, filter=normal)
        def _sort(event: Any, letter: str = letter) -> None:
            top.table.sort_by(letter)
            top.take(top.all_rows)

    @keys.add("/", filter=normal)
    def _filter(event: Any) -> None:
        top.mode, top.typed = "filter", top.table.filter

    @keys.add("<any>", filter=filtering)
    def _type(event: Any) -> None:
        if event.data.isprintable():
            top.typed += event.data
            top.table.filter_by(top.typed, top.all_rows)

    @keys.add("backspace", filter=filtering)
    def _erase(event: Any) -> None:
        top.typed = top.typed[:-1]
        top.table.filter_by(top.typed, top.all_rows)

    @keys.add("enter", filter=filtering)
    def _keep(event: Any) -> None:
        top.mode = "normal"
        top.take(top.all_rows)

    @keys.add("escape", filter=filtering, eager=True)
    def _clear(event: Any) -> None:
        top.mode, top.typed = "normal", ""
        top.table.filter_by("", top.all_rows)
        top.take(top.all_rows)

    @keys.add("k", filter=normal)
    def _kill(event: Any) -> None:
        if top.table.selected is not None:
            top.mode = "kill"

    @keys.add("r", filter=normal)
    def _restart(event: Any) -> None:
        if top.table.selected is not None:
            top.mode = "restart"

    @keys.add("y", filter=asking)
    def _yes(event: Any) -> None:
        action, key = top.mode, top.table.selected
        top.mode, top.message = "normal", f"{action} {key}..."

        async def do() -> None:
            loop = asyncio.get_running_loop()
            top.message = await loop.run_in_executor(None, top.act, action, key)
            app.invalidate()

        app.create_background_task(do())

    @keys.add("<any>", filter=asking)
    def _no(event: Any) -> None:
        top.mode, top.message = "normal", "left as it was"

    @keys.add("a", filter=normal)
    @keys.add("enter", filter=normal)
    def _attach(event: Any) -> None:
        if top.table.selected is not None:
            event.app.exit(result=top.table.selected)

    def width() -> int:
        return app.output.get_size().columns

    body = FormattedTextControl(
        lambda: top.screen(width()),
        get_cursor_position=lambda: Point(0, top.cursor_row()),
        show_cursor=False,
    )
    app = Application(
        layout=Layout(
            HSplit(
                [Window(body, wrap_lines=False), Window(FormattedTextControl(top.bottom), height=1)]
            )
        ),
        key_bindings=keys,
        full_screen=True,
        mouse_support=False,
    )

    async def main() -> str | None:
        refresher = asyncio.ensure_future(top.refresh_forever(app.invalidate))
        try:
            return await app.run_async()
        finally:
            refresher.cancel()

    return asyncio.run(main())


@client_options
@click.command()
@click.option("--prefix", default="", help="Only sessions whose key starts with this.")
@click.option(
    "--interval", type=SECONDS, default=2.0, show_default=True, help="Seconds between redraws."
)
@click.pass_context
def top(ctx: click.Context, prefix: str, interval: float) -> None:
    """Watch the sessions live and act on one: state, CPU, memory, processes,
    turns, queue, model tokens and age, redrawn every --interval seconds.

    \b
    Keys:
      ↑ ↓ PgUp PgDn Home End   select a session
      P M T A N       sort by CPU, memory, tokens, age, key
      /               filter by a part of the key (Esc clears)
      k / r           kill / restart the selected session (asks first)
      a or Enter      attach to it (Ctrl-D detaches and comes back here)
      q               quit

    For a script, `hermes-sup list --watch` or `list --json`.

    \b
    Example:
      hermes-sup top --prefix telegram:
    """
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise click.ClickException(
            "top needs a terminal; for a pipe use `hermes-sup list --watch` or `list --json`"
        )
    with connect(ctx) as client:
        view = Top(client, interval, prefix)
        while True:
            chosen = run_view(view)
            if chosen is None:
                return
            # The attach is its own command on this terminal; then back here.
            subprocess.run([*_me(ctx), "attach", chosen], check=False)
            view.message = f"detached from {chosen}"


def _me(ctx: click.Context) -> list[str]:
    """This command line's own hermes-sup, with its state dir or connection."""
    me = [sys.executable, "-m", "hermes_sup.cli"]
    if ctx.obj.get("connection") is not None:
        return [*me, "--connection", os.fspath(ctx.obj["connection"])]
    return [
        *me,
        "--state-dir",
        os.fspath(ctx.obj["state_dir"]),
        "--timeout",
        str(ctx.obj["timeout"]),
    ]
