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
    from prompt_toolkit.filters import Filter
    from prompt_toolkit.formatted_text import StyleAndTextTuples
    from prompt_toolkit.key_binding import KeyBindings

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
        import asyncio  # here: `hermes-sup --help` lists this command without asyncio

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


def _selecting(keys: KeyBindings, top: Top, when: Filter) -> None:
    """Arrows, pages, Home and End move the selection; P M T A N sort."""
    moves = {"up": -1, "down": 1, "pageup": -10, "pagedown": 10, "home": -(10**9), "end": 10**9}
    for name, by in moves.items():

        @keys.add(name, filter=when)
        def _move(event: Any, by: int = by) -> None:
            top.table.move(by)

    for letter in SORTS:

        @keys.add(letter, filter=when)
        def _sort(event: Any, letter: str = letter) -> None:
            top.table.sort_by(letter)
            top.take(top.all_rows)


def _filtering(keys: KeyBindings, top: Top, when: Filter, typing: Filter) -> None:
    """`/` starts a filter, typed live; Enter keeps it, Esc clears it."""

    @keys.add("/", filter=when)
    def _start(event: Any) -> None:
        top.mode, top.typed = "filter", top.table.filter

    @keys.add("<any>", filter=typing)
    def _type(event: Any) -> None:
        if event.data.isprintable():
            top.typed += event.data
            top.table.filter_by(top.typed, top.all_rows)

    @keys.add("backspace", filter=typing)
    def _erase(event: Any) -> None:
        top.typed = top.typed[:-1]
        top.table.filter_by(top.typed, top.all_rows)

    @keys.add("enter", filter=typing)
    def _keep(event: Any) -> None:
        top.mode = "normal"
        top.take(top.all_rows)

    @keys.add("escape", filter=typing, eager=True)
    def _clear(event: Any) -> None:
        top.mode, top.typed = "normal", ""
        top.table.filter_by("", top.all_rows)
        top.take(top.all_rows)


def _acting(keys: KeyBindings, top: Top, when: Filter, asking: Filter) -> None:
    """k and r ask, then kill or restart the selected session; a and Enter
    leave the view to attach to it; q and Ctrl-C quit."""

    @keys.add("q", filter=when)
    @keys.add("c-c")
    def _quit(event: Any) -> None:
        event.app.exit(result=None)

    @keys.add("k", filter=when)
    @keys.add("r", filter=when)
    def _ask(event: Any) -> None:
        if top.table.selected is not None:
            top.mode = "kill" if event.data == "k" else "restart"

    @keys.add("y", filter=asking)
    def _yes(event: Any) -> None:
        action, key, app = top.mode, top.table.selected, event.app
        top.mode, top.message = "normal", f"{action} {key}..."

        async def do() -> None:
            import asyncio

            if key is not None:
                loop = asyncio.get_running_loop()
                top.message = await loop.run_in_executor(None, top.act, action, key)
                app.invalidate()

        app.create_background_task(do())

    @keys.add("<any>", filter=asking)
    def _no(event: Any) -> None:
        top.mode, top.message = "normal", "left as it was"

    @keys.add("a", filter=when)
    @keys.add("enter", filter=when)
    def _attach(event: Any) -> None:
        if top.table.selected is not None:
            event.app.exit(result=top.table.selected)


def run_view(top: Top) -> str | None:
    """Show the view until q (None) or an attach is asked for (its key)."""
    import asyncio

    from prompt_toolkit.application import Application
    from prompt_toolkit.data_structures import Point
    from prompt_toolkit.filters import Condition
    from prompt_toolkit.key_binding import KeyBindings
    from prompt_toolkit.layout import HSplit, Layout, Window
    from prompt_toolkit.layout.controls import FormattedTextControl

    keys = KeyBindings()
    normal = Condition(lambda: top.mode == "normal")
    _selecting(keys, top, normal)
    _filtering(keys, top, normal, Condition(lambda: top.mode == "filter"))
    _acting(keys, top, normal, Condition(lambda: top.mode in ("kill", "restart")))
    body = FormattedTextControl(
        lambda: top.screen(app.output.get_size().columns),
        get_cursor_position=lambda: Point(0, top.cursor_row()),
        show_cursor=False,
    )
    status = Window(FormattedTextControl(top.bottom), height=1)
    app: Application[str | None] = Application(
        layout=Layout(HSplit([Window(body, wrap_lines=False), status])),
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
