"""Logic tier: session keys, the state table and the worker environment policy."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hermes_sup.protocol import ErrorCode, RemoteProtocolError, check_session_key, session_dir_name
from hermes_sup.supervisor.environment import (
    SessionOptions,
    allowlisted,
    parse_options,
    worker_env,
)
from hermes_sup.supervisor.states import (
    TRANSITIONS,
    Event,
    InvalidTransition,
    State,
    next_state,
)


@pytest.mark.parametrize(
    "key",
    [
        "alice",
        "telegram:-100123456",
        "slack:T01:C02",
        "550e8400-e29b-41d4-a716-446655440000",
        "user@example.com",
        "a" * 128,
        "7",
    ],
)
def test_valid_keys(key: str) -> None:
    assert check_session_key(key) == key


@pytest.mark.parametrize(
    "key",
    [
        "",
        "../../etc",
        "..",
        ".hidden",
        "-rf",
        "a/b",
        "a\0b",
        "a b",
        "a\nb",
        "é",
        "a" * 129,
        "/etc/passwd",
        "a\\b",
        42,
        None,
        b"bytes",
    ],
)
def test_invalid_keys_are_refused_with_the_rule(key: object) -> None:
    with pytest.raises(RemoteProtocolError) as err:
        check_session_key(key)
    assert err.value.code is ErrorCode.BAD_SESSION_KEY
    assert "session key" in err.value.message


def test_session_dir_is_a_digest_not_the_key() -> None:
    name = session_dir_name("alice")
    assert "alice" not in name and len(name) == 32
    assert name != session_dir_name("alice2")
    assert Path(name).name == name


def test_every_state_can_be_left() -> None:
    """No state is a dead end: each has a transition out (or is EXITED, the rest state)."""
    sources = {s for s, _ in TRANSITIONS}
    assert sources == set(State)


def test_normal_life_of_a_session() -> None:
    s = State.EXITED
    for ev, want in [
        (Event.SPAWN, State.STARTING),
        (Event.HELLO, State.IDLE),
        (Event.TURN, State.BUSY),
        (Event.DONE, State.IDLE),
        (Event.KILL, State.STOPPING),
        (Event.EXIT, State.EXITED),
    ]:
        s = next_state(s, ev)
        assert s is want


@pytest.mark.parametrize(
    "state, event",
    [
        (State.EXITED, Event.TURN),
        (State.IDLE, Event.HELLO),
        (State.EXITED, Event.KILL),
        (State.STOPPING, Event.TURN),
        (State.BUSY, Event.TURN),
    ],
)
def test_transitions_not_in_the_table_raise(state: State, event: Event) -> None:
    with pytest.raises(InvalidTransition):
        next_state(state, event)


def test_allowlist_keeps_only_named_variables() -> None:
    env = {"PATH": "/bin", "LC_ALL": "C", "OPENAI_API_KEY": "sk-secret", "AWS_SECRET": "x"}
    assert allowlisted(env, ("PATH", "LC_*")) == {"PATH": "/bin", "LC_ALL": "C"}


def test_worker_env_layers_and_session_values_win() -> None:
    opts = parse_options(
        {"session_env": {"platform": "telegram", "chat_id": "42"}, "env": {"FOO": "from-options"}}
    )
    env = worker_env(
        {"PATH": "/bin", "FOO": "base"},
        {"FOO": "fixed", "BAR": "1"},
        opts,
        "alice",
        Path("/d/home"),
        Path("/d/ws"),
    )
    assert env == {
        "PATH": "/bin",
        "FOO": "from-options",
        "BAR": "1",
        "HERMES_SESSION_PLATFORM": "telegram",
        "HERMES_SESSION_CHAT_ID": "42",
        "HERMES_SESSION_KEY": "alice",
        "HERMES_HOME": "/d/home",
        "TERMINAL_CWD": "/d/ws",
    }


@pytest.mark.parametrize(
    "raw, words",
    [
        ("nope", "'options' must be a map"),
        ({"colour": {}}, "unknown option 'colour'"),
        ({"env": {"HERMES_HOME": "/tmp/x"}}, "set by the supervisor"),
        ({"env": {"1BAD": "x"}}, "invalid variable name"),
        ({"env": {"A": 1}}, "must be a string"),
        ({"env": {"A": "x\0y"}}, "NUL"),
        ({"session_env": {"chat-id": "1"}}, "invalid variable name"),
        ({"session_env": {f"k{i}": "v" for i in range(65)}}, "at most 64"),
    ],
)
def test_bad_options_name_what_is_wrong(raw: object, words: str) -> None:
    with pytest.raises(RemoteProtocolError) as err:
        parse_options(raw)
    assert err.value.code is ErrorCode.BAD_FIELD
    assert words in err.value.message


def test_options_compare_by_value() -> None:
    assert parse_options({"env": {"A": "1"}}) == SessionOptions(env={"A": "1"})
    assert not parse_options(None)


def test_log_lines_mask_secrets() -> None:
    from hermes_sup.supervisor.logfmt import kv

    line = kv(
        "spawned",
        session="alice",
        api_key="sk-abcdef1234567890",
        note="uses sk-live1234567890xyz",
        token="t0ps3cret",
        pid=42,
    )
    assert "abcdef1234567890" not in line and "live1234567890xyz" not in line
    assert "t0ps3cret" not in line
    assert "session=alice" in line and "pid=42" in line and "api_key=[redacted]" in line


def test_fork_to_parent_makes_a_child_of_the_callers_parent(tmp_path) -> None:
    from hermes_sup.local.prctl import can_fork_to_parent

    if not can_fork_to_parent():
        pytest.skip("no clone(CLONE_PARENT) syscall number for this machine")
    code = (
        "import os, sys\n"
        "from hermes_sup.local.prctl import fork_to_parent\n"
        "pid = fork_to_parent()\n"
        "if pid == 0:\n"
        "    os.write(1, b'%d\\n' % os.getppid()); os._exit(7)\n"
        "os.write(1, b'%d\\n' % pid)\n"  # one write each: stdout may be unbuffered
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    numbers = {int(x) for x in out.stdout.split()}
    assert os.getpid() in numbers  # the grandchild saw us as its parent
    grandchild = (numbers - {os.getpid()}).pop()
    # Only a parent can reap: the grandchild is our child, with its own status.
    _, status = os.waitpid(grandchild, 0)
    assert os.waitstatus_to_exitcode(status) == 7


def test_spare_session_dirs_move_into_place_and_never_over_a_real_one(tmp_path: Path) -> None:
    from hermes_sup.supervisor.spare_dirs import SpareDirs

    sessions = tmp_path / "sessions"
    (tmp_path / ".spare-sessions" / "old").mkdir(parents=True)  # left by an earlier run
    spares = SpareDirs(tmp_path, target=2)
    spares.reset()
    assert not (tmp_path / ".spare-sessions" / "old").exists() and len(spares.free) == 2
    assert (tmp_path / ".spare-sessions").stat().st_mode & 0o077 == 0
    assert list(sessions.iterdir()) == []  # only sessions live there

    a = sessions / "aaaa"
    assert spares.take(a)
    assert sorted(p.name for p in a.iterdir()) == ["home", "workspace"]
    assert a.stat().st_mode & 0o777 == 0o700

    b = sessions / "bbbb"
    (b / "workspace").mkdir(parents=True)  # the worker got there first
    assert not spares.take(b)
    assert sorted(p.name for p in b.iterdir()) == ["workspace"] and len(spares.free) == 1

    c = sessions / "cccc"
    assert spares.take(c, with_workspace=False)  # its workspace is elsewhere
    assert [p.name for p in c.iterdir()] == ["home"]
    assert not spares.take(sessions / "dddd")  # none left
    spares.refill(5)
    assert len(spares.free) == 2  # up to the target, no further


def test_a_worker_making_its_dirs_survives_a_spare_renamed_over_them(tmp_path, monkeypatch):
    """The supervisor may rename a spare session directory over the empty
    parent a starting worker has just made; the worker's next mkdir inside
    the replaced directory then fails with ENOENT (what the kernel answers
    for a mkdir in a deleted directory). The worker tries again and finds
    the spare's directories."""
    from hermes_sup.worker import main as worker_main

    spare, session = tmp_path / "spare", tmp_path / "sessions" / "s1"
    (spare / "workspace").mkdir(parents=True)
    session.parent.mkdir()
    real_mkdir, raced = os.mkdir, []

    def mkdir_losing_the_race(path, mode=0o777, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        if Path(path) == session / "workspace" and session.exists() and not raced:
            raced.append(path)
            os.rename(spare, session)  # the supervisor's rename, over the empty parent
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real_mkdir(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir_losing_the_race)
    worker_main._make_dir(session / "workspace")
    assert raced and (session / "workspace").is_dir() and not spare.exists()


def test_a_session_names_its_worker_from_its_hello_until_the_zygote_has(tmp_path) -> None:
    """A worker's hello can be read before the zygote's answer that names its
    pid; the `running` event sent then must still carry the pid."""
    from types import SimpleNamespace

    from hermes_sup.supervisor.environment import parse_options
    from hermes_sup.supervisor.session import Session

    session = Session(key="k", dir=tmp_path, options=parse_options(None))
    assert session.pid is None
    session.hello_pid = 4242
    assert session.pid == 4242
    session.proc = SimpleNamespace(pid=4242, returncode=None)  # type: ignore[assignment]
    assert session.pid == 4242
    session.proc.returncode = 0
    assert session.pid is None  # exited: no pid, whatever its hello said


def test_process_tree_usage_read_from_proc_matches_psutil() -> None:
    """scan_trees reads /proc/<pid>/stat itself (psutil held the supervisor's
    GIL 3 times longer); it must still count what psutil counts."""
    import signal
    import time

    import psutil

    from hermes_sup.supervisor.limits import scan_trees

    shell = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30 & wait"])
    try:
        deadline = time.monotonic() + 5
        while len(psutil.Process(shell.pid).children()) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        tree = [psutil.Process(shell.pid), *psutil.Process(shell.pid).children(recursive=True)]
        usage = scan_trees([shell.pid], cpu=True)[shell.pid]
        assert usage.procs == 2
        expected = sum(p.memory_info().rss for p in tree)
        # Read at different moments from the kernel's approximate RSS
        # counters (stat here, statm in psutil): close, not equal.
        assert abs(usage.rss - expected) <= 2 * 1024 * 1024, (usage.rss, expected)
        assert usage.cpu >= 0.0
        assert scan_trees([2**22 + 7]) == {2**22 + 7: scan_trees([2**22 + 7])[2**22 + 7]}
        assert scan_trees([2**22 + 7])[2**22 + 7].procs == 0  # no such process: nothing
    finally:
        for p in psutil.Process(shell.pid).children(recursive=True):
            p.send_signal(signal.SIGKILL)
        shell.kill()
        shell.wait()
