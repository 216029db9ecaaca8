"""mkdocs hook: the configuration and command references, made while the site
builds from their one declaration each (mkdocs.yml names this file).

A page holds a marker line and the hook puts the reference in its place:

- `<!-- reference: settings -->`: the table of every setting of `serve`,
  from the `Settings` fields in supervisor/config.py (`reference_table`),
  the same declarations the flags of `serve` and the TOML checks are made
  from; `<!-- reference: settings TABLE -->` the same for another service's
  table of the file (`http_api`, `route`, `ray`: cli/configcheck.py's
  `section_tables`);
- `<!-- reference: cli -->`: every command of `hermes-sup`, walked from the
  click command tree: its usage, its help and each option's help.

- `<!-- include: PATH -->`: a file of the repository that lives outside
  docs/ because other things read it there (protocol/PROTOCOL.md ships in
  the package; BENCHMARKS.md and CHANGELOG.md sit at the top), put in whole:
  such a page is only its marker, and takes the file's title.

Nothing generated is kept in the repository, so a change to a flag or a
setting reaches the site at its next build, and cannot differ from it.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

SETTINGS_MARKER = re.compile(r"^<!-- reference: settings(?: (?P<table>\w+))? -->$", re.MULTILINE)
CLI_MARKER = "<!-- reference: cli -->"
INCLUDE = re.compile(r"^<!-- include: (?P<path>[\w./-]+) -->$", re.MULTILINE)
PROG = "hermes-sup"
ROOT = Path(__file__).resolve().parents[2]


def settings_reference(table: str | None = None) -> str:
    """The Markdown table of every setting of `serve` (top-level keys of the
    TOML file), or of another service's `table` of it."""
    if table is None:
        from hermes_sup.supervisor.config import reference_table

        return reference_table()
    from hermes_sup.cli.configcheck import section_tables
    from hermes_sup.local.settings import reference_table as markdown_table

    return markdown_table(section_tables()[table])


def walk(
    command: click.Command, parent: click.Context | None = None, name: str = PROG
) -> Iterator[tuple[click.Context, click.Command]]:
    """Every command under `command`, depth first, each with its context.

    Subcommands are asked for through the group's own `list_commands` and
    `get_command`, so a group that loads its commands lazily is walked too.
    """
    ctx = click.Context(command, info_name=name, parent=parent)
    yield ctx, command
    if isinstance(command, click.Group):
        for sub_name in command.list_commands(ctx):
            sub = command.get_command(ctx, sub_name)
            if sub is not None and not sub.hidden:
                yield from walk(sub, ctx, sub_name)


def _help_text(command: click.Command) -> str:
    """A command's help as Markdown paragraphs (click's `\\b` markers dropped)."""
    text = inspect.cleandoc(command.help or command.short_help or "")
    paragraphs = []
    for block in text.split("\n\n"):
        lines = block.splitlines()
        if lines and lines[0].strip() == "\b":
            # A block click prints unwrapped (examples, key tables): as is.
            paragraphs.append("```text\n" + "\n".join(lines[1:]) + "\n```")
        else:
            paragraphs.append(" ".join(line.strip() for line in lines))
    return "\n\n".join(p for p in paragraphs if p)


# Options every client command takes, described once, under `hermes-sup`.
COMMON = {"--state-dir", "--timeout", "--connection", "--help"}


def _options(ctx: click.Context, command: click.Command, common: bool) -> list[str]:
    """One Markdown list item per option: its flags, then its help."""
    items = []
    for param in command.get_params(ctx):
        if not isinstance(param, click.Option) or "--help" in param.opts:
            continue
        if not common and COMMON.intersection(param.opts):
            continue
        record = param.get_help_record(ctx)
        if record is None:
            continue
        flags, help_text = record
        help_text = " ".join(help_text.split())
        items.append(f"- `{flags}`" + (f": {help_text}" if help_text else ""))
    return items


def cli_reference(root: click.Command | None = None) -> str:
    """Every command of `hermes-sup` as Markdown: a section each, in tree order."""
    if root is None:
        from hermes_sup.cli.main import cli as root
    sections = []
    for ctx, command in walk(root):
        path = ctx.command_path
        level = "#" * min(2 + path.count(" "), 4)
        usage = " ".join(command.collect_usage_pieces(ctx))
        parts = [f"{level} `{path}`", f"```\n{path} {usage}\n```", _help_text(command)]
        options = _options(ctx, command, common=ctx.parent is None)
        if options:
            parts.append("\n".join(options))
        sections.append("\n\n".join(p for p in parts if p))
    return "\n\n".join(sections) + "\n"


def included(path: str) -> str:
    """A file of the repository, as it is."""
    return (ROOT / path).read_text()


def on_page_markdown(markdown: str, **_: Any) -> str:
    """mkdocs' hook: each marker line replaced by its reference."""
    markdown = INCLUDE.sub(lambda m: included(m["path"]), markdown)
    markdown = SETTINGS_MARKER.sub(lambda m: settings_reference(m["table"]), markdown)
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_reference())
    return markdown
