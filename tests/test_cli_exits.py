"""Exit codes every command keeps, and one readable line per tool call.

The table of exit codes is the CLI's contract with scripts: docs/cli.md shows
it and cli/common.py's `Exit` holds it; a test holds the two alike, and real
commands against a real supervisor exit as the table says."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from hermes_sup.cli import tool_lines
from hermes_sup.cli.common import Exit

from .test_cli_turns import hs, hs_cmd
from .test_faults import RUNTIMES, until

DOCS = Path(__file__).resolve().parent.parent / "docs" / "cli.md"


def documented_codes() -> dict[int, str]:
    """The exit-code table of docs/cli.md: code -> meaning."""
    rows = re.findall(r"^\| (\d+) \| (.+?) \|$", DOCS.read_text(), re.MULTILINE)
    return {int(code): meaning for code, meaning in rows}


def test_the_documented_exit_codes_are_the_ones_the_commands_use() -> None:
    assert documented_codes().keys() == {int(code) for code in Exit}


def test_send_exits_with_the_turns_own_status(supervisor) -> None:
    assert hs(supervisor, "send", "bob", "sh exit 7").returncode == 7
    assert hs(supervisor, "send", "bob", "sh true").returncode == 0
    # A turn with no status of its own: 0 for a reply.
    assert hs(supervisor, "send", "bob", "echo hi").returncode == 0


def test_turn_status_tells_pending_from_not_running_and_unknown(supervisor, tmp_path) -> None:
    assert hs(supervisor, "turn", "status", "carol", "t-1").returncode == Exit.UNKNOWN
    sender = subprocess.Popen(
        hs_cmd(supervisor, "send", "carol", "--turn-id", "t-1", "sleep 60"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        pending = lambda: hs(supervisor, "turn", "status", "carol", "t-1").returncode  # noqa: E731
        assert until(lambda: pending() == Exit.PENDING, timeout=300)
        assert hs(supervisor, "cancel", "carol").returncode == 0
        sender.wait(timeout=120)
    finally:
        if sender.poll() is None:
            sender.kill()
            sender.wait()
    nowhere = [sys.executable, "-m", "hermes_sup.cli", "--state-dir", str(tmp_path)]
    done = subprocess.run([*nowhere, "turn", "status", "carol", "t-1"], capture_output=True)
    assert done.returncode == Exit.NOT_RUNNING


def test_a_tool_call_is_one_line() -> None:
    hermes_start = {"name": "terminal", "args": {"command": "ls -la"}, "preview": "ls -la"}
    assert (
        tool_lines.started("terminal", hermes_start["args"], hermes_start) == "· terminal: ls -la"
    )
    # Without a preview, the argument that says most; a lone argument itself.
    assert tool_lines.started("read_file", {"path": "/a", "limit": 3}, {}) == "· read_file: /a"
    assert tool_lines.started("x", {"only": [1, 2]}, None) == "· x: [1, 2]"
    assert tool_lines.started("noop", {}, {}) == "· noop"
    # Hermes's own progress events repeat the start and end: not shown.
    for event in ("tool.started", "tool.completed", "reasoning.available", "_thinking"):
        assert tool_lines.progress({"event": event, "tool": "terminal"}) is None
    assert tool_lines.progress({"event": "subagent_progress", "preview": "step 2"}) == (
        "· subagent_progress: step 2"
    )
    assert tool_lines.completed("terminal", {"result": "ok", "is_error": False}) is None
    assert tool_lines.completed("terminal", {"result": "no such file", "is_error": True}) == (
        "· terminal failed: no such file"
    )
    long = tool_lines.started("terminal", {"command": "x" * 500}, {})
    assert len(long) < 140 and long.endswith("…")


def test_every_client_says_starting_and_send_waits_for_the_start(supervisor_factory, tmp_path):
    release = tmp_path / "release"
    env = dict(os.environ, PYTHONPATH=RUNTIMES, HS_RELEASE=str(release))
    sup = supervisor_factory(
        "--preload", "hs_slow_preload", "--pass-env", "HS_RELEASE", env=env, start=False
    )
    sup.start(wait=False)
    sender = None
    try:
        status = lambda: hs(sup, "status")  # noqa: E731
        assert until(lambda: status().returncode == Exit.STARTING, timeout=300)
        for command in (
            ["list"],
            ["ping"],
            ["kill", "a"],
            ["logs", "a"],
            ["turn", "status", "a", "t"],
        ):
            said = hs(sup, *command)
            assert said.returncode == Exit.STARTING, (command, said)
            assert "is starting: starting the zygote" in said.stderr, (command, said.stderr)
            assert "Start it with" not in said.stderr
        said = tmp_path / "send.err"
        with open(said, "w") as err_file:
            sender = subprocess.Popen(
                hs_cmd(sup, "send", "alice", "echo sent during the start"),
                stdout=subprocess.PIPE,
                stderr=err_file,
                text=True,
            )
        # It waits, saying so, rather than failing; only then does the start end.
        assert until(lambda: "waiting for it" in said.read_text() or sender.poll(), 300)
        assert sender.poll() is None, said.read_text()
        release.touch()
        out, _ = sender.communicate(timeout=300)
        err = said.read_text()
        assert sender.returncode == 0, err
        assert "sent during the start" in out
        assert "is starting: starting the zygote" in err and "waiting for it" in err
        assert hs(sup, "status").returncode == Exit.OK
    finally:
        release.touch()
        if sender is not None and sender.poll() is None:
            sender.kill()
            sender.wait()


def test_the_top_level_help_names_every_exit_code() -> None:
    from .clirunner import hermes_sup

    said = hermes_sup("--help").stdout
    paragraph = " ".join(said.split("Exit codes:")[1].split("Completion:")[0].split())
    named = {int(n) for n in re.findall(r"(?:^|, )(\d+) ", paragraph)}
    assert named == {int(code) for code in Exit}, paragraph


def test_the_http_endpoint_says_starting_and_answers_a_turn_sent_then(
    supervisor_factory, tmp_path
) -> None:
    """Sent while the supervisor starts, a chat completion waits and is
    answered once the start ends; /health meanwhile says `starting`."""
    import threading

    import httpx

    from hermes_sup.httpapi.keys import KeyStore

    from .test_http import wait_ready

    release = tmp_path / "release"
    env = dict(os.environ, PYTHONPATH=RUNTIMES, HS_RELEASE=str(release))
    sup = supervisor_factory(
        "--preload", "hs_slow_preload", "--pass-env", "HS_RELEASE", "--http", "127.0.0.1:0",
        env=env, start=False,
    )  # fmt: skip
    key = KeyStore(sup.data_dir).generate("test")
    sup.start(wait=False)
    answers: list[httpx.Response] = []
    try:
        url = wait_ready(sup.log_path, None)
        health = httpx.get(url + "/health", timeout=30)
        assert health.status_code == 503 and health.headers.get("Retry-After")
        said = health.json()
        assert said["status"] == "starting" and "is starting: starting the zygote" in said["error"]
        asked = threading.Thread(
            target=lambda: answers.append(
                httpx.post(
                    url + "/v1/chat/completions",
                    json={"model": "m", "messages": [{"role": "user", "content": "during"}]},
                    headers={"Authorization": f"Bearer {key}", "X-Hermes-Session-Id": "s"},
                    timeout=300,
                )
            )
        )
        asked.start()
        # The request has reached the endpoint and waits; only then does the start end.
        assert until(lambda: "http_waiting_for_start" in sup.log() or answers, 300)
        assert not answers and hs(sup, "status").returncode == Exit.STARTING
    finally:
        release.touch()
    asked.join(timeout=300)
    assert answers and answers[0].status_code == 200, answers and answers[0].text
    assert answers[0].json()["choices"][0]["message"]["content"] == "during"
