"""What building the docs installs, and the man pages made from the commands.

`make docs` is run for real in a copy of the Makefile whose venv holds
stand-ins for python and mkdocs that write down how they were called: no
install runs, nothing waits.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import click
import pytest

REPO = Path(__file__).resolve().parent.parent
STAND_IN = '#!/bin/sh\necho "$(basename "$0") $*" >> "$(dirname "$0")/../calls"\n'


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """The Makefile, pyproject.toml, the package folders and a venv of stand-ins."""
    shutil.copy(REPO / "Makefile", tmp_path / "Makefile")
    (tmp_path / "pyproject.toml").write_text("")
    dirs = re.search(r"^PACKAGE_DIRS := (.*)$", (REPO / "Makefile").read_text(), re.M)
    assert dirs is not None
    for name in dirs.group(1).split():
        (tmp_path / name).mkdir()
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("python", "mkdocs"):
        (bin_dir / name).write_text(STAND_IN)
        (bin_dir / name).chmod(0o755)
    for path in tmp_path.rglob("*"):
        os.utime(path, (1_000_000, 1_000_000))  # everything long ago
    return tmp_path


def make(tree: Path, target: str) -> list[str]:
    """Run `make TARGET`; the calls of python and mkdocs it made."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    done = subprocess.run(
        ["make", "--no-print-directory", target],
        cwd=tree, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    calls = tree / ".venv" / "calls"
    lines = calls.read_text().splitlines() if calls.exists() else []
    calls.unlink(missing_ok=True)
    return lines


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_docs_installs_the_docs_extra_only(tree: Path) -> None:
    calls = make(tree, "docs")
    installs = [call for call in calls if " pip install" in call]
    assert len(installs) == 1, calls
    # The strict editable install, as everywhere else, with no other extra.
    assert "-e .[docs] --config-settings editable_mode=strict" in installs[0]
    assert calls[-1] == "mkdocs build --strict"
    # Built again: nothing to install.
    assert make(tree, "docs") == ["mkdocs build --strict"]


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_docs_after_make_install_installs_nothing(tree: Path) -> None:
    stamp = tree / ".venv" / ".installed-dev"
    stamp.touch()  # `make install` ran since the last change: the docs extra is there
    assert make(tree, "docs") == ["mkdocs build --strict"]
    assert make(tree, "man") == ["python -m hermes_sup.cli.manpages man"]


# click-man 0.6.0 calls a click helper click 8.2 deprecates.
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_every_command_has_a_man_page(tmp_path: Path) -> None:
    from hermes_sup.cli.main import cli
    from hermes_sup.cli.manpages import write

    pages = {page.name for page in write(tmp_path, version="9.8.7")}

    def visit(command: click.Command, path: str) -> None:
        assert path.replace(" ", "-") + ".1" in pages, path
        if isinstance(command, click.Group):
            ctx = click.Context(command, info_name=path)
            for name in command.list_commands(ctx):
                sub = command.get_command(ctx, name)
                if sub is not None and not sub.hidden:
                    visit(sub, f"{path} {name}")

    visit(cli, "hermes-sup")
    page = (tmp_path / "hermes-sup-send.1").read_text()
    assert page.startswith('.TH "HERMES-SUP SEND" "1" ') and '"9.8.7"' in page
    if shutil.which("man"):
        shown = subprocess.run(
            ["man", "-l", str(tmp_path / "hermes-sup-send.1")],
            env={**os.environ, "LC_ALL": "C", "MANWIDTH": "100"},
            capture_output=True, text=True, check=True, timeout=60,
        ).stdout  # fmt: skip
        assert "hermes-sup send [OPTIONS] SESSION TEXT" in shown


def test_a_build_dates_its_pages_by_source_date_epoch(monkeypatch: pytest.MonkeyPatch) -> None:
    from hermes_sup.cli.manpages import page_date

    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    assert page_date() == "2023-11-14"
