"""Terminal control sequences a session prints (a window title, OSC 52 writing
the operator's clipboard, a screen clear, a C1 CSI) never reach the
operator's terminal raw through send, logs, attach or events: on a terminal
they are shown escaped; to a pipe, or with --raw, they stay byte-exact
(issue 15 item 11)."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pexpect
import pytest

from .test_faults import RUNTIMES

HOSTILE = "A\x1b]0;pwned\x07B\x1b]52;c;ZXZpbA==\x07C\x1b[2JD\x9b31mE"  # as hs_controls prints
SHOWN = "A\\x1b]0;pwned\\x07B\\x1b]52;c;ZXZpbA==\\x07C\\x1b[2JD\\x9b31mE"


@pytest.fixture
def hostile(supervisor_factory):
    """A supervisor whose sessions print control sequences everywhere."""
    env = dict(os.environ, PYTHONPATH=RUNTIMES)
    sup = supervisor_factory("--agent", "hs_controls:make", env=env)
    with sup.client() as client:
        client.run("evil", "go")  # its log, history and reply hold them now
    return sup


def on_terminal(sup, *args: str) -> str:
    """Everything the command wrote to a real terminal, until it ended."""
    child = pexpect.spawn(
        sys.executable,
        ["-m", "hermes_sup.cli", "--state-dir", str(sup.state_dir), *args],
        encoding="utf-8",
        timeout=30,
        env=dict(os.environ, NO_COLOR="1"),
    )
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, child.before
    return child.before


def to_pipe(sup, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "hermes_sup.cli", "--state-dir", str(sup.state_dir), *args],
        capture_output=True,
        text=True,
        timeout=30,
        env=dict(os.environ, NO_COLOR="1"),
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def no_raw_controls(screen: str) -> None:
    """Nothing but line ends (the terminal's own \\r\\n) controls the screen."""
    assert "\x1b" not in screen and "\x07" not in screen and "\x9b" not in screen, repr(screen)


@pytest.mark.parametrize(
    "command", [("send", "evil", "go"), ("logs", "evil"), ("events", "evil", "--replay", "20")]
)
def test_control_sequences_are_shown_escaped_on_a_terminal(hostile, command) -> None:
    if command[0] == "events":
        # events runs until Ctrl-C: a terminal that ends it after the replay.
        child = pexpect.spawn(
            sys.executable,
            ["-m", "hermes_sup.cli", "--state-dir", str(hostile.state_dir), *command],
            encoding="utf-8",
            timeout=30,
            env=dict(os.environ, NO_COLOR="1"),
        )
        child.logfile_read = io.StringIO()
        child.expect(" evil reply ")
        child.sendintr()
        child.expect(pexpect.EOF)
        child.close()
        screen = child.logfile_read.getvalue()
    else:
        screen = on_terminal(hostile, *command)
    no_raw_controls(screen)
    assert SHOWN in screen


def test_attach_shows_them_escaped(hostile) -> None:
    child = pexpect.spawn(
        sys.executable,
        ["-m", "hermes_sup.cli", "--state-dir", str(hostile.state_dir), "attach", "evil"],
        encoding="utf-8",
        timeout=30,
        env=dict(os.environ, NO_COLOR="1"),
    )
    child.logfile_read = io.StringIO()
    try:
        child.expect("attached to evil")
        child.expect("◂")  # the replayed reply, after the replayed output and tokens
        child.sendline("again")
        child.expect(r"» \[you\] again")
        child.expect("◂")
        child.sendeof()
        child.expect(pexpect.EOF)
        screen = child.logfile_read.getvalue()
    finally:
        child.close(force=True)
    no_raw_controls(screen)
    assert SHOWN in screen


def test_a_pipe_and_raw_get_them_byte_exact(hostile) -> None:
    # The reply came as tokens: it is on screen once, then its line ends.
    assert to_pipe(hostile, "send", "evil", "go") == f"out {HOSTILE}\ntok {HOSTILE}\n"
    assert f"log {HOSTILE}" in to_pipe(hostile, "logs", "evil")
    raw = on_terminal(hostile, "send", "evil", "go", "--raw")
    assert f"out {HOSTILE}" in raw
