"""Settings declared once, for every service of hermes-sup.

A service's settings are the fields of one dataclass (`serve`'s `Settings`,
the HTTP endpoint's `ApiSettings`, the router's, `ray up`'s). A field's type
and default are the setting's; everything else about it (its flag and
environment variable, bounds, help, whether a reload may change it) is a
`Setting` in the field's metadata, made with `setting()`, as gunicorn
declares each of its settings once. `declare(cls)` reads them into a table,
{field name: Setting}, and from that one table come:

- the command's flags (cli/options.py, `setting_option`),
- the checks of a value from the TOML file (`from_file`), an environment
  variable or a process's argument list (`from_text`),
- the reference of the documentation site (`reference_table`).

The configuration file holds `serve`'s settings as top-level keys and each
other service's in a table of its own (`SECTIONS`), so one file describes
what a host runs and `hermes-sup config check` knows every key in it.

Standard library only: the supervisor, the router, the HTTP endpoint and
the command line all import it, and none of them imports another for it.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .durations import parse_duration

__all__ = [
    "SECTIONS",
    "Setting",
    "SettingError",
    "declare",
    "did_you_mean",
    "either",
    "from_file",
    "from_text",
    "plain",
    "read_table",
    "reference_table",
    "setting",
    "to_argv",
]

# The tables of the configuration file beside `serve`'s top-level keys: one
# per other service, named for what reads it. Kept here, by name only, so
# that the supervisor skips them without importing the services.
SECTIONS: dict[str, str] = {
    "http_api": "the HTTP endpoint (`hermes-sup http`, and `serve` with `http` set)",
    "route": "the router (`hermes-sup route`)",
    "ray": "the node agents (`hermes-sup ray up`)",
}


class SettingError(ValueError):
    """A value a setting cannot take; the message names the key (or is the
    setting's own check's sentence, which names what it is about)."""


@dataclass(frozen=True)
class Setting:
    """One setting of a service, all that is said about it.

    `name`, `type` and `default` are those of its dataclass field; the rest
    is declared in the field's metadata with `setting()`. A setting whose
    type admits None reads 0 (in the file, or on the command line, where
    "none" means it too) as None: `zero` says what that means ("off", "from
    the fd limit"); for any other setting `zero` says what its 0 or "" does.
    """

    name: str
    type: Any
    default: Any
    help: str
    # "--memory-limit"; "" for a setting only the file can set.
    flag: str
    # More flags for the same setting, kept working for compatibility.
    aliases: tuple[str, ...] = ()
    envvar: str | None = None
    zero: str | None = None
    # Numbers: the least value allowed (0: not negative), whether that
    # least value itself is refused ("more than"), and the most allowed.
    minimum: float = 0
    exclusive: bool = False
    maximum: float | None = None
    choices: tuple[str, ...] = ()
    # False: only a restart changes it (sockets, directories, the zygote's
    # imports); a reload keeps the old value and says so.
    reload: bool = True
    # A filesystem path (or a list of them): made absolute on the command
    # line, since the zygote and workers run in other directories; a list of
    # them in the file must be absolute already.
    path: bool = False
    # The file's (or the flag's) list adds to the default instead of replacing it.
    extends: bool = False
    # A table whose values are counts, written as numbers in TOML
    # (`webui = 1_000_000`) and held as text like the flag's NAME=COUNT.
    counts: bool = False
    # A float is a time in seconds unless its name ends in _ms or this says
    # it is a plain number (a weight).
    duration: bool = True
    # Its key in the file when not its name (the [agent] table).
    key: str = ""
    metavar: str | None = None
    # The reference's default column, when the value itself would not say it.
    shown: str | None = None
    # Further check of a value from the file or the command line: why it
    # cannot be used, or None.
    check: Callable[[Any], str | None] | None = None

    @property
    def file_key(self) -> str:
        """Its key in the configuration file."""
        return self.key or self.name

    @property
    def optional(self) -> bool:
        """Its value may be None, written 0 in the file and on the command line."""
        return type(None) in typing.get_args(self.type)

    @property
    def base(self) -> Any:
        """Its type without None: int, float, str, Path, tuple[str, ...], dict[...]."""
        if self.optional:
            return next(a for a in typing.get_args(self.type) if a is not type(None))
        return self.type

    @property
    def seconds(self) -> bool:
        """A time in seconds (every float setting but the `_ms` ones and
        plain numbers): also written as a duration, "30m" or "1h30m", in the
        file and on the command line, as `kill --idle-for` takes it."""
        return self.base is float and self.duration and not self.name.endswith("_ms")

    @property
    def table(self) -> bool:
        """A TOML table of its own ([agent], [session_defaults])."""
        return self.base == dict[str, Any]

    @property
    def repeatable(self) -> bool:
        """Given once per value on the command line (--pass-env A --pass-env B)."""
        return self.base in (tuple[str, ...], dict[str, str])

    def default_text(self, markdown: bool = True) -> str:
        """The default as the reference shows it (Markdown), or as --help does
        ("" when there is nothing to say)."""
        if self.shown is not None:
            return self.shown if markdown else plain(self.shown)
        value, zero = self.default, self.zero
        if value is None:
            text = f"`0` ({zero})" if zero else "none"
        elif isinstance(value, str):
            if not markdown:
                return value or zero or ""
            text = f'`"{value}"`' + (f" ({zero})" if zero and not value else "")
        elif isinstance(value, (tuple, dict)):
            if value:
                text = f"`{' '.join(value)}`"
            elif not markdown:
                return ""
            else:
                text = "`[]`" if isinstance(value, tuple) else "`{}`"
        elif zero:
            text = f"`{value}` (0 = {zero})" if value else f"`{value}` ({zero})"
        else:
            text = f"`{value}`"
        return text if markdown else plain(text)

    def flag_text(self) -> str:
        """Its flags and environment variable, in Markdown."""
        if not self.flag:
            return f"env `{self.envvar}`" if self.envvar else ""
        shape = f" {self.metavar}" if self.metavar else ""
        text = f"`{self.flag}{shape}`" + "".join(f" (or `{a}`)" for a in self.aliases)
        return text + (f", env `{self.envvar}`" if self.envvar else "")

    def bounds(self) -> str:
        """Its bounds as the reference says them ("" for none)."""
        parts = []
        if self.minimum or self.exclusive:
            parts.append(f"{'more than' if self.exclusive else 'at least'} {self.minimum:g}")
        if self.maximum is not None:
            parts.append(f"at most {self.maximum:g}")
        return "; " + ", ".join(parts) if parts else ""

    def meaning(self) -> str:
        """What it means, with its bounds (Markdown)."""
        return self.help + self.bounds()

    def reference_help(self) -> str:
        """What the reference says it means."""
        return self.meaning() + ("" if self.reload else ". Needs a restart")

    def option_help(self) -> str:
        """Its --help text: the reference's, as a sentence, without Markdown,
        then its environment variable and default."""
        text = plain(self.meaning()).removesuffix(".")
        text = text[:1].upper() + text[1:] + (" (repeat)." if self.repeatable else ".")
        if self.seconds:
            text += " Also a duration: 90s, 30m, 2h."
        extra = [f"env {self.envvar}"] if self.envvar else []
        if self.default_text(markdown=False):
            extra.append(f"default: {self.default_text(markdown=False)}")
        return text + (f" [{'; '.join(extra)}]" if extra else "")

    def out_of_bounds(self, number: float) -> str | None:
        """What is wrong with a number for it, said after the value or the
        key ("must be at least 1024"), or None."""
        if number < 0:
            return "must not be negative"
        if number < self.minimum or (self.exclusive and number == self.minimum):
            return f"must be {'more than' if self.exclusive else 'at least'} {self.minimum:g}"
        if self.maximum is not None and number > self.maximum:
            return f"must be at most {self.maximum:g}"
        return None


def plain(markdown: str) -> str:
    """Text without the reference's code quotes."""
    return markdown.replace("`", "")


def either(names: Iterable[str]) -> str:
    """`a`, `b` or `c`."""
    quoted = [f"`{n}`" for n in names]
    return ", ".join(quoted[:-1]) + " or " + quoted[-1]


def setting(flag: str, help: str, **more: Any) -> dict[str, Any]:
    """A field's metadata declaring it a setting (see `Setting`)."""
    return {"setting": {"flag": flag, "help": help, **more}}


def declare(cls: type) -> dict[str, Setting]:
    """The settings of a dataclass by field name, in the order of its
    fields; fields without `setting()` metadata (bookkeeping) are left out."""
    # The annotations are strings (PEP 563): evaluated in the module that
    # declares each field (a base class may live in another module).
    hints = typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))
    table: dict[str, Setting] = {}
    for f in dataclasses.fields(cls):
        if "setting" not in f.metadata:
            continue
        if f.default is not dataclasses.MISSING:
            default: Any = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None  # required (the directories): `shown` says it
        table[f.name] = Setting(f.name, hints[f.name], default, **f.metadata["setting"])
    return table


def did_you_mean(key: str, known: Iterable[str]) -> str:
    """ "; did you mean 'x'?" for the known key nearest `key`, or ""."""
    close = difflib.get_close_matches(key, list(known), 1)
    return f"; did you mean {close[0]!r}?" if close else ""


# ---------------------------------------------------------------- values


def _number(s: Setting, value: Any, where: str) -> Any:
    kind = s.base
    if s.seconds and isinstance(value, str):
        try:
            value = parse_duration(value)  # "30m", as `kill --idle-for` takes
        except ValueError as exc:
            raise SettingError(f"{where}: {exc}") from None
    whole = kind is int
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (whole and not isinstance(value, int))
    ):
        off = " (0 = off)" if s.optional else ""
        also = ' or a duration ("30m")' if s.seconds else ""
        raise SettingError(f"{where} must be a {'whole ' if whole else ''}number{also}{off}")
    fault = s.out_of_bounds(value)
    if fault is not None and not (s.optional and value == 0):
        raise SettingError(f"{where} {fault}")
    return None if s.optional and value == 0 else kind(value)


def _checked(s: Setting, value: Any) -> Any:
    why = s.check(value) if s.check else None
    if why is not None:
        raise SettingError(why)
    return value


def from_file(s: Setting, value: Any) -> Any:
    """A value of the TOML file as the service holds it; SettingError
    naming the key and what is wrong."""
    kind, where = s.base, s.file_key
    if kind in (int, float):
        return _number(s, value, where)
    if kind is Path:
        if not isinstance(value, str) or not value:
            raise SettingError(f"{where} must be a path")
        # Absolute (from our directory): the zygote and workers run elsewhere.
        return Path(value).expanduser().absolute()
    if kind is str:
        if not isinstance(value, str):
            raise SettingError(f"{where} must be a string")
        if s.choices and value not in s.choices:
            raise SettingError(f"{where} must be one of {', '.join(s.choices)}")
        return _checked(s, value)
    if kind == tuple[str, ...]:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise SettingError(f"{where} must be a list of strings")
        if s.path:
            # Relative to what? The supervisor's directory is not the file's.
            relative = [v for v in value if not Path(v).is_absolute()]
            if relative:
                raise SettingError(f"{where}: {relative[0]!r} is not an absolute path")
        return _checked(s, (s.default if s.extends else ()) + tuple(value))
    if kind == dict[str, str]:
        if isinstance(value, dict) and s.counts:
            value = {k: str(v) if type(v) is int else v for k, v in value.items()}
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise SettingError(f"{where} must be a table of strings")
        return _checked(s, dict(value))
    raise SettingError(f"{where} cannot be set in a file")


def from_text(s: Setting, text: str) -> Any:
    """A value written as text (an environment variable, a process's
    argument) as the service holds it: a number as on the command line
    ("none" or 0 for off, a duration for seconds), a list comma-separated.
    SettingError naming the setting otherwise."""
    kind = s.base
    if kind in (int, float):
        if s.optional and text.strip().lower() == "none":
            return None
        try:
            value: Any = kind(text)
        except ValueError:
            value = text  # a duration, or refused as not a number
        return _number(s, value, s.file_key)
    if kind == tuple[str, ...]:
        return (s.default if s.extends else ()) + tuple(
            part.strip() for part in text.split(",") if part.strip()
        )
    if kind is Path:
        return Path(text).expanduser().absolute() if text else None
    return from_file(s, text)


def to_argv(table: Mapping[str, Setting], values: Mapping[str, Any]) -> list[str]:
    """The flags that say `values` (those that differ from the defaults) to
    a process reading its arguments with the same table (`from_text`)."""
    argv: list[str] = []
    for name, value in values.items():
        s = table[name]
        if value == s.default or not s.flag:
            continue
        if isinstance(value, tuple):
            argv += [a for v in value for a in (s.flag, v)]
        else:
            argv += [s.flag, "0" if value is None else str(value)]
    return argv


# ---------------------------------------------------------------- the reference


def reference_table(table: Mapping[str, Setting]) -> str:
    """A configuration reference: a Markdown table, a row a setting."""
    rows = ["| key | flag | default | meaning |", "|---|---|---|---|"]
    for s in table.values():
        key = f"`[{s.file_key}]`" if s.table else f"`{s.file_key}`"
        rows.append(f"| {key} | {s.flag_text()} | {s.default_text()} | {s.reference_help()} |")
    return "\n".join(rows) + "\n"


def read_table(
    table: Mapping[str, Setting], raw: object, where: str
) -> tuple[dict[str, Any], list[str]]:
    """A table of the configuration file (`[route]`) read with `table`,
    each key on its own: the good values by field name, and one error a bad
    key, each starting with `where` ("FILE: [route]")."""
    if not isinstance(raw, dict):
        return {}, [f"{where} must be a table"]
    by_key = {s.file_key: s for s in table.values()}
    values: dict[str, Any] = {}
    errors: list[str] = []
    for key, value in raw.items():
        s = by_key.get(key)
        if s is None:
            errors.append(f"{where}: unknown key {key!r}{did_you_mean(key, by_key)}")
            continue
        try:
            values[s.name] = from_file(s, value)
        except SettingError as exc:
            errors.append(f"{where}: {exc}")
    return values, errors
