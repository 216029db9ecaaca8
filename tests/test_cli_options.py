"""Options an operator types: --state-dir and --timeout on either side of the
command's name (serve too), refused values as one line with the documented
exit code, another user's state directory, and `list` sized to its keys
with -q, --format and --no-trunc."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pexpect
import pytest

from .clirunner import hermes_sup
from .test_faults import until

SHARED = "telegram:-1001234567890:thread-55"
SIBLING = "telegram:-1001234567890:thread-56"


def run(*args: str, prefix: tuple[str, ...] = (), timeout: float = 60):
    """The real command, with exactly these arguments."""
    return subprocess.run(
        [*prefix, sys.executable, "-m", "hermes_sup.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        env=dict(os.environ, NO_COLOR="1"),
    )


def one_line_error(result: subprocess.CompletedProcess[str], code: int, words: str) -> None:
    assert result.returncode == code, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and words in errors[0], result.stderr


# ---------------------------------------------------------------- --state-dir, --timeout


def test_state_dir_and_timeout_are_accepted_after_the_command(supervisor) -> None:
    with supervisor.client() as client:
        client.run("alice", "pid")
    where = str(supervisor.state_dir)
    for args in (
        ["--state-dir", where, "--timeout", "5", "list", "-q"],
        ["list", "-q", "--state-dir", where, "--timeout", "5"],
        ["list", "--state-dir", where, "-q"],
        ["--timeout", "5", "list", "--state-dir", where, "-q"],
    ):
        result = run(*args)
        assert result.returncode == 0, (args, result.stderr)
        assert result.stdout == "alice\n", args
    # The one after the command wins over the one before it.
    wrong = run("--state-dir", "/nonexistent/hs", "ping", "--state-dir", where)
    assert wrong.returncode == 0, wrong.stderr
    missing = run("--state-dir", where, "ping", "--state-dir", "/nonexistent/hs")
    one_line_error(missing, 3, "no hermes-sup supervisor is running on /nonexistent/hs")
    assert "hermes-sup --state-dir /nonexistent/hs serve" in missing.stderr


@pytest.mark.e2e
def test_serve_takes_state_dir_after_its_name_and_shutdown_stops_it(workdir) -> None:
    state, data = workdir / "own-s", workdir / "own-d"
    log = open(workdir / "serve.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "hermes_sup.cli", "serve", "--state-dir", str(state)]
        + ["--data-dir", str(data)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        assert until(lambda: run("ping", "--state-dir", str(state)).returncode == 0, timeout=30)
        assert run("send", "a", "pid", "--state-dir", str(state)).returncode == 0
        stopped = run("shutdown", "--state-dir", str(state))
        assert stopped.returncode == 0, stopped.stderr
        assert "shutting down pid" in stopped.stdout and stopped.stdout.endswith("stopped\n")
        assert proc.wait(30) == 0
        assert "shutdown_requested" in (workdir / "serve.log").read_text()
        gone = run("ping", "--state-dir", str(state))
        assert gone.returncode == 3
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
        log.close()


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_bad_timeouts_are_one_line_usage_errors(value: str, tmp_path) -> None:
    for args in (
        ["--timeout", value, "ping", "--state-dir", str(tmp_path)],
        ["ping", "--state-dir", str(tmp_path), "--timeout", value],
        ["send", "a", "pid", "--state-dir", str(tmp_path), "--turn-timeout", value],
    ):
        one_line_error(hermes_sup(*args), 2, "seconds")


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv"),
    reason="needs root and setpriv to run the CLI as another user",
)
def test_another_users_state_directory_is_one_line_with_exit_1(supervisor) -> None:
    nobody = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
    for command in (["ping"], ["list"], ["send", "a", "pid"], ["attach", "a"]):
        result = run("--state-dir", str(supervisor.state_dir), *command, prefix=nobody)
        one_line_error(result, 1, "permission denied on")


# ---------------------------------------------------------------- list


def test_list_sizes_the_key_column_to_the_keys(supervisor) -> None:
    with supervisor.client() as client:
        for key in (SHARED, SIBLING, "web:1"):
            client.run(key, "pid")
    table = run("list", "--state-dir", str(supervisor.state_dir))
    lines = table.stdout.splitlines()
    assert lines[0].startswith("SESSION" + " " * (len(SHARED) - len("SESSION")) + " STATE")
    keys = [line.split()[0] for line in lines[1:-1]]
    assert keys == [SHARED, SIBLING, "web:1"]
    assert len({len(line) for line in lines[:-1]}) == 1  # the columns line up

    assert run("list", "-q", "--state-dir", str(supervisor.state_dir)).stdout.split() == keys
    formatted = run(
        "list", "--format", r"{key}\t{state}\t{turns}", "--state-dir", str(supervisor.state_dir)
    )
    assert formatted.stdout.splitlines() == [f"{k}\tidle\t1" for k in keys]
    as_json = run("list", "--format", "json", "--state-dir", str(supervisor.state_dir))
    assert [json.loads(line)["key"] for line in as_json.stdout.splitlines()] == keys
    unknown = run("list", "--format", "{colour}", "--state-dir", str(supervisor.state_dir))
    one_line_error(unknown, 2, "no field 'colour'")
    assert "key" in unknown.stderr and "rss" in unknown.stderr
    both = run("list", "-q", "--json", "--state-dir", str(supervisor.state_dir))
    one_line_error(both, 2, "choose one of")


def test_list_on_a_narrow_terminal_cuts_keys_in_the_middle(supervisor) -> None:
    with supervisor.client() as client:
        for key in (SHARED, SIBLING):
            client.run(key, "pid")

    def screen(*extra: str) -> list[str]:
        child = pexpect.spawn(
            sys.executable,
            ["-m", "hermes_sup.cli", "list", "--state-dir", str(supervisor.state_dir), *extra],
            encoding="utf-8",
            env=dict(os.environ, NO_COLOR="1"),
            dimensions=(24, 70),
            timeout=30,
        )
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == 0
        return [line for line in child.before.splitlines() if line.strip()]

    narrow = screen()
    assert all(len(line) <= 70 for line in narrow), narrow
    rows = [line.split()[0] for line in narrow[1:-1]]
    assert len(set(rows)) == 2 and all("…" in r for r in rows)
    assert rows[0].startswith("telegram:") and rows[0].endswith("-55")
    assert rows[1].endswith("-56")
    full = screen("--no-trunc")
    assert [line.split()[0] for line in full[1:-1]] == [SHARED, SIBLING]


def test_list_watch_redraws_until_interrupted(supervisor) -> None:
    with supervisor.client() as client:
        client.run("w1", "pid")
    proc = subprocess.Popen(
        [sys.executable, "-m", "hermes_sup.cli", "list", "-q", "--watch", "--interval", "0.2"]
        + ["--state-dir", str(supervisor.state_dir)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        seen = [proc.stdout.readline() for _ in range(3)]  # w1, blank, w1
        assert seen == ["w1\n", "\n", "w1\n"]
        with supervisor.client() as client:
            client.run("w2", "pid")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if proc.stdout.readline() == "w2\n":
                break
        else:
            raise AssertionError("the new session never showed")
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 0
