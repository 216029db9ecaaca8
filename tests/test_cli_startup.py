"""A command loads what it uses: `--version`, Tab completion and --help
import click and the command table, not the asyncio client, the
supervisor's modules or starlette (what made every command slow to start).

Checked by the modules a real `hermes-sup` process holds once it is done,
not by a timing (bench/startup.py measures the times).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# Run as the console script runs: main() with these arguments, then the
# names of every module the process imported, as the last line.
PROBE = """
import json, sys
sys.argv = ["hermes-sup", *json.loads(sys.argv[1])]
from hermes_sup.cli.main import main
try:
    main()
except SystemExit:
    pass
print()
print(json.dumps(sorted(sys.modules)))
"""

# What no startup of these needs; each of them was loaded by every command.
HEAVY = (
    "asyncio",
    "hermes_sup.client.aio",
    "hermes_sup.supervisor.configfile",
    "hermes_sup.supervisor.worktrees",
    "hermes_sup.supervisor.server",
    "hermes_sup.httpapi",
    "starlette",
    "importlib.metadata",
)


def modules_after(*args: str, env: dict[str, str] | None = None) -> tuple[str, set[str]]:
    """Run hermes-sup with `args`; what it printed and the modules it loaded."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(list(args))],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )
    printed, _, last = done.stdout.rstrip("\n").rpartition("\n")
    return printed, set(json.loads(last))


# The endpoint's settings table is standard library only (its flags are the
# `http` command's, listed by --help); the package's __init__ loads nothing.
LIGHT = {"hermes_sup.httpapi", "hermes_sup.httpapi.settings"}


def heavy_in(loaded: set[str]) -> list[str]:
    return sorted(m for m in loaded - LIGHT if any(m == h or m.startswith(h + ".") for h in HEAVY))


def test_version_loads_no_client_supervisor_or_http() -> None:
    printed, loaded = modules_after("--version")
    assert "hermes-sup, version" in printed
    assert heavy_in(loaded) == []
    assert "zmq" not in loaded  # not even the transport


def test_tab_completion_of_a_command_name_loads_no_heavy_module() -> None:
    line = "hermes-sup se"
    printed, loaded = modules_after(
        env={
            "_HERMES_SUP_COMPLETE": "bash_complete",
            "COMP_LINE": line,
            "COMP_POINT": str(len(line)),
            "COMP_WORDS": line,
            "COMP_CWORD": "1",
        }
    )
    assert {"plain,send", "plain,serve"} <= set(printed.split())
    assert heavy_in(loaded) == []


@pytest.mark.parametrize("args", [("--help",), ("send", "--help"), ("kill", "--help")])
def test_help_loads_no_heavy_module(args: tuple[str, ...]) -> None:
    printed, loaded = modules_after(*args)
    assert "Usage: hermes-sup" in printed
    assert heavy_in(loaded) == []


def test_a_command_still_finds_what_it_defers() -> None:
    """The lazy table names real commands: every one loads and has help."""
    from hermes_sup.cli.main import COMMANDS, cli

    ctx = cli.make_context("hermes-sup", [], resilient_parsing=True)
    for name in COMMANDS:
        command = cli.get_command(ctx, name)
        assert command is not None, name
        assert command.get_short_help_str(), name


# click-man 0.6 calls click.utils.make_default_short_help, deprecated in click 8.3.
@pytest.mark.filterwarnings("ignore:'click.utils.make_default_short_help':DeprecationWarning")
def test_man_pages_are_made_from_the_commands_help(tmp_path) -> None:  # noqa: ANN001
    """`make man`: a page for every command, the lazy ones included, each
    saying what its --help says."""
    pytest.importorskip("click_man", reason="click-man is in the dev extra")
    from hermes_sup.cli.manpages import write

    pages = {p.name for p in write(tmp_path)}
    assert {"hermes-sup.1", "hermes-sup-send.1", "hermes-sup-keys-http-generate.1"} <= pages
    assert "hermes-sup-completion.1" in pages and "hermes-sup-ping.1" in pages
    send = (tmp_path / "hermes-sup-send.1").read_text()
    assert ".SH OPTIONS" in send and "turn\\-id" in send
