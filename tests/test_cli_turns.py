"""`send`, `cancel`, `approve` and `attach` as an operator uses them: the real
`hermes-sup` command on a real pseudo-terminal (pexpect) or a pipe, against
a real supervisor (issue 18, items 1-3 and 9)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pexpect

from hermes_sup.protocol import Kind, session_dir_name

from .test_faults import RUNTIMES, until


def hs_cmd(sup, *args: str) -> list[str]:
    return [sys.executable, "-m", "hermes_sup.cli", "--state-dir", str(sup.state_dir), *args]


def hs(sup, *args: str, stdin=subprocess.DEVNULL, timeout: float = 60):
    """The real command, without a terminal."""
    return subprocess.run(
        hs_cmd(sup, *args),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=stdin,
        env=dict(os.environ, NO_COLOR="1"),
    )


def on_terminal(sup, *args: str) -> pexpect.spawn:
    """The real command on a pseudo-terminal."""
    return pexpect.spawn(
        sys.executable,
        ["-m", "hermes_sup.cli", "--state-dir", str(sup.state_dir), *args],
        encoding="utf-8",
        timeout=20,
        env=dict(os.environ, NO_COLOR="1"),
        dimensions=(40, 160),
    )


def finished(child: pexpect.spawn) -> int:
    child.expect(pexpect.EOF)
    child.close()
    return child.exitstatus


def running_turn(client, key: str) -> str | None:
    return next((r["state"] for r in client.sessions() if r["key"] == key), None)


# ---------------------------------------------------------------- approvals


def workspace_of(supervisor, key: str) -> Path:
    """A session's workspace, where the approved commands below write (the
    one place of the host a session's shell may write)."""
    return supervisor.data_dir / "sessions" / session_dir_name(key) / "workspace"


def test_send_on_a_terminal_asks_for_the_approval_and_answers_it(supervisor) -> None:
    target = workspace_of(supervisor, "alice") / "approved"
    child = on_terminal(supervisor, "send", "alice", "ask touch approved")
    try:
        child.expect(r"\? approval needed: touch .*approved")
        child.expect(r"allow it\? \[once/session/deny\]")
        child.sendline("maybe")  # not a choice: asked again
        child.expect("please type one of once, session, deny")
        child.sendline("o")  # a unique prefix is enough
        child.expect("answered: once")
        child.expect("exit 0")
        assert finished(child) == 0
    finally:
        child.close(force=True)
    assert target.exists()


def test_no_still_waiting_line_over_the_approval_prompt(supervisor) -> None:
    """While the prompt waits for a person, `send` does not print its
    "still waiting" notice over it (here due every 0.2 s of silence)."""
    patched = (
        "import sys, hermes_sup.cli.send as send; send.QUIET_NOTICE = 0.2; "
        "from hermes_sup.cli.main import main; sys.argv[0] = 'hermes-sup'; main()"
    )
    child = pexpect.spawn(
        sys.executable,
        ["-c", patched, "--state-dir", str(supervisor.state_dir), "send", "eve", "ask true"],
        encoding="utf-8",
        timeout=20,
        env=dict(os.environ, NO_COLOR="1"),
        dimensions=(40, 160),
    )
    try:
        child.expect(r"allow it\? \[once/session/deny\]")
        # Twenty notices' worth of silence under the prompt, then the answer.
        deadline = time.monotonic() + 20 * 0.2
        seen = ""
        while time.monotonic() < deadline:
            try:
                seen += child.read_nonblocking(4096, timeout=0.2)
            except pexpect.TIMEOUT:
                pass
        child.sendline("once")
        child.expect("exit 0")
        assert finished(child) == 0
    finally:
        child.close(force=True)
    assert "still waiting" not in seen


def test_send_without_a_terminal_says_how_to_answer(supervisor) -> None:
    target = workspace_of(supervisor, "bob") / "from-elsewhere"
    proc = subprocess.Popen(
        hs_cmd(supervisor, "send", "bob", "ask touch from-elsewhere"),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, NO_COLOR="1"),
    )
    try:
        hint = ""
        deadline = time.monotonic() + 20
        while "answer with:" not in hint and time.monotonic() < deadline:
            hint += proc.stderr.readline()
        assert "? approval needed: touch" in hint
        # The hint is a command that works as printed.
        command = hint.split("answer with: ", 1)[1].strip()
        assert command.startswith(f"hermes-sup --state-dir {supervisor.state_dir} approve bob ")
        assert command.endswith(" --id probe-1")
        answer = hs(supervisor, "approve", "bob", "once", "--id", "probe-1")
        assert answer.returncode == 0, answer.stderr
        assert "bob: answered once" in answer.stdout
        out, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, err
    assert out.strip() == "exit 0" and target.exists()
    # An answer naming a request that no longer waits is refused, one line.
    late = hs(supervisor, "approve", "bob", "once", "--id", "probe-1")
    assert late.returncode == 1 and "nothing_to_approve" in late.stderr
    assert "Traceback" not in late.stderr


def test_send_exits_1_when_nobody_answers_the_approval_in_time(supervisor_factory) -> None:
    env = dict(os.environ, PYTHONPATH=RUNTIMES)
    sup = supervisor_factory("--agent", "hs_quick_ask:make", env=env)
    result = hs(sup, "send", "carol", "ask touch never")
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert result.stdout.strip() == "denied: touch never"
    assert "nobody answered in time: touch never was deny" in result.stderr
    assert "nobody answered the approval for touch never in time" in result.stderr
    assert "approve carol CHOICE" in result.stderr
    # A turn that needs no approval exits 0 as before.
    assert hs(sup, "send", "carol", "pid").returncode == 0


def test_send_shows_the_status_of_a_waiting_turn_on_stderr(supervisor) -> None:
    with supervisor.client() as client:
        req = client.submit(Kind.SEND, {"text": "sleep 60"}, session="dan")
        until(lambda: running_turn(client, "dan") == "busy")
        proc = subprocess.Popen(
            hs_cmd(supervisor, "send", "dan", "stream one two"),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        until(lambda: client.sessions()[0]["queued"] == 1)
        client.cancel("dan", req)
        out, err = proc.communicate(timeout=30)
        while client.answer(req, timeout=20).kind is Kind.EVENT:
            pass
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert result.returncode == 0
    assert result.stdout == "one two\n"  # stdout: the session's words only
    assert "· queued (position 1)" in result.stderr
    assert "· running (worker pid" in result.stderr


def test_send_json_prints_every_event(supervisor) -> None:
    import json

    result = hs(supervisor, "send", "erin", "sh echo a; echo b", "--json")
    assert result.returncode == 0, result.stderr
    items = [json.loads(line) for line in result.stdout.splitlines()]
    types = [i["type"] for i in items]
    assert types[-3:] == ["output", "output", "reply"] and set(types[:-3]) == {"status"}
    assert items[-1]["text"] == "exit 0" and items[-1]["ok"] is True


# ---------------------------------------------------------------- Ctrl-C, cancel


def test_ctrl_c_on_send_cancels_the_turn_and_exits_130(supervisor) -> None:
    child = on_terminal(supervisor, "send", "frank", "sleep 60")
    try:
        with supervisor.client() as client:
            until(lambda: running_turn(client, "frank") == "busy")
            child.sendintr()
            child.expect("cancelling the turn")
            child.expect("turn ended: cancelled")
            assert finished(child) == 130
            assert "Aborted" not in (child.before or "")
            # The turn is over and the session kept its worker.
            assert until(lambda: running_turn(client, "frank") == "idle")
    finally:
        child.close(force=True)


def test_a_send_whose_turn_is_cancelled_fails(supervisor) -> None:
    """Cancelled from elsewhere (`hermes-sup cancel`), a turn has no answer:
    `send` prints none, says so on stderr and exits 1; --json's reply is
    `"ok": false, "cancelled": true`."""
    import json

    procs = {
        key: subprocess.Popen(
            hs_cmd(supervisor, "send", key, "sleep 60", *extra),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for key, extra in (("hal", ()), ("ida", ("--json",)))
    }
    try:
        with supervisor.client() as client:
            for key in procs:
                until(lambda key=key: running_turn(client, key) == "busy")
                client.cancel(key)
        done = {key: proc.communicate(timeout=30) for key, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
    out, err = done["hal"]
    assert procs["hal"].returncode == 1
    assert out == ""
    assert "the turn was cancelled before it finished" in err
    out, err = done["ida"]
    assert procs["ida"].returncode == 1
    last = json.loads(out.splitlines()[-1])
    assert last["type"] == "reply" and last["ok"] is False and last["cancelled"] is True


def test_cancel_command(supervisor) -> None:
    with supervisor.client() as client:
        req = client.submit(Kind.SEND, {"text": "sleep 60"}, session="gina")
        until(lambda: running_turn(client, "gina") == "busy")
        result = hs(supervisor, "cancel", "gina")
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == f"gina: cancelled turn {req}"
        while (msg := client.answer(req, timeout=20)).kind is Kind.EVENT:
            pass
        assert msg.body["text"] == "cancelled"
    nothing = hs(supervisor, "cancel", "gina")
    assert nothing.returncode == 1 and "no running turn to cancel" in nothing.stderr
    ghost = hs(supervisor, "cancel", "nobody")
    assert ghost.returncode == 1 and "no session 'nobody'" in ghost.stderr


# ---------------------------------------------------------------- attach


def test_a_read_only_attach_changes_nothing(supervisor) -> None:
    with supervisor.client() as client:
        client.run("room", "pid")
        watcher = on_terminal(supervisor, "attach", "room", "--read-only")
        try:
            watcher.expect("read-only: you can watch, not send, approve or cancel")
            req = client.submit(Kind.SEND, {"text": "sleep 1.5"}, session="room")
            watcher.expect(r"» \[turn\] sleep 1.5")
            watcher.sendline("/deny")
            watcher.expect("read-only: input ignored")
            # Ctrl-C detaches the watcher; the other client's turn runs on.
            watcher.sendintr()
            watcher.expect("detached; the session keeps running")
            assert finished(watcher) == 0
            while (msg := client.answer(req, timeout=20)).kind is Kind.EVENT:
                pass
            assert msg.body["text"] == "slept 1.5"
        finally:
            watcher.close(force=True)


def test_attach_refuses_an_unknown_key_unless_create(supervisor) -> None:
    with supervisor.client() as client:
        client.run("telegram:42", "pid")
    typo = hs(supervisor, "attach", "telegram:24")
    assert typo.returncode == 1
    assert "no session 'telegram:24'" in typo.stderr
    assert "attach --create telegram:24" in typo.stderr
    with supervisor.client() as client:
        assert [r["key"] for r in client.sessions()] == ["telegram:42"]  # nothing was made
    child = on_terminal(supervisor, "attach", "telegram:24", "--create")
    try:
        child.expect("attached to telegram:24")
        child.expect(r"worker ready \(pid \d+\)")
        child.sendline("env HERMES_SESSION_KEY")
        child.expect("◂ telegram:24")
        child.sendeof()
        assert finished(child) == 0
    finally:
        child.close(force=True)


def test_attach_approve_names_the_request_on_screen(supervisor) -> None:
    target = workspace_of(supervisor, "ops") / "via-attach"
    with supervisor.client() as client:
        client.run("ops", "pid")
        child = on_terminal(supervisor, "attach", "ops")
        try:
            child.expect("attached to ops")
            req = client.submit(Kind.SEND, {"text": "ask touch via-attach"}, session="ops")
            child.expect("approval requested")
            child.sendline("/approve once")
            child.expect("approval answered: once")
            while (msg := client.answer(req, timeout=20)).kind is Kind.EVENT:
                pass
            assert msg.body["text"] == "exit 0"
            child.sendeof()
            finished(child)
        finally:
            child.close(force=True)
    assert target.exists()
    log = supervisor.log()
    assert "bad_request" not in log


def test_send_to_a_supervisor_that_goes_away_exits_3(supervisor) -> None:
    child = on_terminal(supervisor, "send", "hank", "sleep 60")
    try:
        with supervisor.client() as client:
            until(lambda: running_turn(client, "hank") == "busy")
        os.kill(supervisor.pid, signal.SIGKILL)
        supervisor.proc.wait(10)
        assert finished(child) == 3
    finally:
        child.close(force=True)
