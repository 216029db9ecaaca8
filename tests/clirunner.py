"""The `hermes-sup` command run in the test's own process by click's
CliRunner, for tests of what only parses arguments and reads files: a
subprocess would cost each of them an interpreter's start and every import.
A test that needs the real process (a supervisor, signals, a terminal)
runs the real command instead."""

from __future__ import annotations

import subprocess
import traceback

from click.testing import CliRunner

from hermes_sup.cli.main import cli


def hermes_sup(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`hermes-sup ARGS` as the real command would end: its exit status,
    stdout and stderr, with the traceback on stderr if it raised."""
    result = CliRunner().invoke(
        cli, list(args), prog_name="hermes-sup", env={"NO_COLOR": "1", **(env or {})}
    )
    stderr = result.stderr
    if result.exc_info is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(*result.exc_info))
    return subprocess.CompletedProcess(
        ["hermes-sup", *args], result.exit_code, result.stdout, stderr
    )
