"""Man pages made from the commands' own declarations, by click-man: one
page a command, hermes-sup.1, hermes-sup-send.1,
hermes-sup-keys-http-generate.1, ... Nothing is written twice: a page says
what the command's --help says.

The wheel's build writes them (setup.py's build_man, which runs this with
the version being built) and installs them under share/man/man1 of the
environment; in a checkout, `make man` writes them into man/:

    python -m hermes_sup.cli.manpages [--version V] DIR
    man -l man/hermes-sup-send.1
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

import click


def page_date() -> str:
    """The date a page carries: SOURCE_DATE_EPOCH's where the build sets it
    (so that two builds of one commit make the same wheel), else today's."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH", "").strip()
    if epoch.isdigit():
        when = datetime.datetime.fromtimestamp(int(epoch), datetime.UTC)
    else:
        when = datetime.datetime.now(datetime.UTC)
    return when.strftime("%Y-%m-%d")


def write(target: Path, version: str | None = None) -> list[Path]:
    """Write every command's page into `target`; the pages written.

    `version` is the one the pages name; by default the installed one
    (a build names the version it builds, which is not installed yet).
    """
    try:
        from click_man.core import write_man_pages
    except ImportError:
        raise click.ClickException(
            "man pages need click-man (the docs extra: pip install -e '.[docs]')"
        ) from None
    if version is None:
        from hermes_sup.local.version import version as installed

        version = installed()

    from .main import COMMANDS, cli

    # click-man walks each group's loaded commands: load the lazy ones first.
    ctx = click.Context(cli, info_name="hermes-sup")
    for name in COMMANDS:
        cli.get_command(ctx, name)
    target.mkdir(parents=True, exist_ok=True)
    before = set(target.glob("*.1"))
    write_man_pages("hermes-sup", cli, version=version, target_dir=str(target), date=page_date())
    return sorted(set(target.glob("*.1")) | before)


def main() -> None:
    """`python -m hermes_sup.cli.manpages [--version V] DIR`."""
    parser = argparse.ArgumentParser(
        prog="python -m hermes_sup.cli.manpages",
        description="Write a man page for every hermes-sup command into DIR.",
    )
    parser.add_argument("dir", type=Path, metavar="DIR")
    parser.add_argument("--version", help="the version the pages name (default: the installed one)")
    args = parser.parse_args()
    try:
        pages = write(args.dir, args.version)
    except click.ClickException as exc:
        sys.exit(f"error: {exc.message}")
    print(f"wrote {len(pages)} man pages into {args.dir}")


if __name__ == "__main__":
    main()
