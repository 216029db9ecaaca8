"""The endpoint's log lines: `kv` (local/logfmt.py) with every value made
printable first.

Much of what the endpoint logs came from a client (an id, a path, an
origin) or from a session (an approval's command), and both are hostile: a
newline would start a line of their own in the supervisor's log, a
terminal escape would act on the screen of whoever reads it. So anything
that is not printable is written as its Python escape (`\\n`, `\\x1b`,
`\\ud800`), and each log line stays one line.
"""

from __future__ import annotations

from typing import Any

from hermes_sup.local.logfmt import kv as _kv


def printable(value: Any) -> str:
    """`str(value)` with each character that is not printable escaped."""
    text = str(value)
    if text.isprintable():
        return text  # the usual case, without a copy
    return "".join(
        ch if ch.isprintable() else ch.encode("unicode_escape", "backslashreplace").decode("ascii")
        for ch in text
    )


def kv(event: str, **fields: Any) -> str:
    """A log line as `local.logfmt.kv` makes it, every value printable."""
    return _kv(event, **{name: printable(value) for name, value in fields.items()})
