"""Man pages made from the commands' own declarations, by click-man (in the
dev extra): one page a command, hermes-sup.1, hermes-sup-send.1,
hermes-sup-keys-http-generate.1, ... Nothing is written twice: a page says
what the command's --help says.

    python -m hermes_sup.cli.manpages DIR      (make man: into man/)
    man -l man/hermes-sup-send.1
"""

from __future__ import annotations

import sys
from pathlib import Path

import click


def write(target: Path) -> list[Path]:
    """Write every command's page into `target`; the pages written."""
    try:
        from click_man.core import write_man_pages
    except ImportError:
        raise click.ClickException(
            "man pages need click-man (the dev extra: make install)"
        ) from None
    from hermes_sup.local.version import version

    from .main import COMMANDS, cli

    # click-man walks each group's loaded commands: load the lazy ones first.
    ctx = click.Context(cli, info_name="hermes-sup")
    for name in COMMANDS:
        cli.get_command(ctx, name)
    target.mkdir(parents=True, exist_ok=True)
    before = set(target.glob("*.1"))
    write_man_pages("hermes-sup", cli, version=version(), target_dir=str(target))
    return sorted(set(target.glob("*.1")) | before)


def main() -> None:
    """`python -m hermes_sup.cli.manpages DIR`."""
    if len(sys.argv) != 2:
        sys.exit("usage: python -m hermes_sup.cli.manpages DIR")
    try:
        pages = write(Path(sys.argv[1]))
    except click.ClickException as exc:
        sys.exit(f"error: {exc.message}")
    print(f"wrote {len(pages)} man pages into {sys.argv[1]}")


if __name__ == "__main__":
    main()
