"""What the client commands write to a person's terminal.

A session's output is untrusted: a command it runs may print terminal
control sequences (an OSC that retitles the window or, with OSC 52, writes
the operator's clipboard; a CSI that moves the cursor to hide what was
printed). Written to a terminal, every control character is made visible as
escaped text (ESC as `\\x1b`), so the operator sees what the session sent and
the terminal obeys none of it. Written to a pipe or a file, or with
`--raw`, the text stays byte-exact.
"""

from __future__ import annotations

import re
import sys
from typing import TextIO

import click

# C0 controls but tab and newline, DEL, and the C1 controls (U+0080-U+009F,
# which some terminals read as ESC-sequences: U+009B is a CSI on its own).
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _visible(match: re.Match[str]) -> str:
    return f"\\x{ord(match.group()):02x}"


def neutralize(text: str) -> str:
    """`text` with every control character but tab and newline escaped."""
    if text.endswith("\r"):
        text = text[:-1]  # a CRLF line end: nothing to show
    return _CONTROLS.sub(_visible, text)


def is_terminal(stream: TextIO) -> bool:
    """Whether `stream` is a terminal (False for a closed or odd stream)."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Screen:
    """Writes untrusted text to stdout or stderr: neutralized on a
    terminal unless `raw`, byte-exact otherwise."""

    def __init__(self, raw: bool = False) -> None:
        self.raw = raw
        self.clean_out = not raw and is_terminal(sys.stdout)
        self.clean_err = not raw and is_terminal(sys.stderr)

    def safe(self, text: str, err: bool = False) -> str:
        """`text` as it may be written to stdout (or stderr)."""
        return neutralize(text) if (self.clean_err if err else self.clean_out) else text

    # color=True: click.echo would otherwise strip what looks like a colour
    # code from text bound for a pipe, and the text would not be byte-exact.

    def out(self, text: str, nl: bool = True) -> None:
        """Untrusted text on stdout."""
        click.echo(self.safe(text), nl=nl, color=True)

    def err(self, text: str, nl: bool = True) -> None:
        """Untrusted text on stderr."""
        click.echo(self.safe(text, err=True), nl=nl, err=True, color=True)
