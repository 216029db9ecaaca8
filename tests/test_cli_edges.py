"""What an operator trips on in a first hour, each as it should be: usage
errors exit 2 before connecting, a command that cannot work with the
supervisor down says what can, and a command never changes what it only
looks at (a kill of stopped sessions leaves their idle time)."""

from __future__ import annotations

import time
from pathlib import Path

from click.testing import CliRunner

from hermes_sup.cli.main import cli

from .test_cli_turns import hs
from .test_faults import until


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.output


def test_signal_with_an_unknown_name_is_a_usage_error(tmp_path: Path) -> None:
    # No supervisor runs there: the name is refused before connecting.
    code, out = run("--state-dir", str(tmp_path), "signal", "BOGUS", "alice")
    assert code == 2
    assert "'BOGUS' is not a signal name or number" in out
    code, out = run("--state-dir", str(tmp_path), "signal", "hup", "alice")
    assert code == 3  # a real name: on to the (absent) supervisor


def test_logs_with_the_supervisor_down_points_at_data_dir(tmp_path: Path) -> None:
    code, out = run("--state-dir", str(tmp_path), "logs", "tg:42")
    assert code == 3
    assert "no hermes-sup supervisor is running" in out
    assert "logs tg:42 --data-dir DIR" in out


def test_kill_all_leaves_stopped_sessions_idle_time(supervisor_factory) -> None:
    """A session a previous run left on disk is listed exited, idle since
    its log last changed; killing it (kill --all) is no activity of its own."""
    first = supervisor_factory()
    with first.client() as client:
        client.open("old")
        client.kill("old")
    first.stop()
    second = supervisor_factory()
    with second.client() as client:
        (row,) = client.sessions()
        assert row["state"] == "exited"
        before = row["last_activity"]
        until(lambda: time.time() > before + 1)  # a reset would now show
        result = hs(second, "kill", "--all")
        assert result.returncode == 0, result.stderr
        (row,) = client.sessions()
    assert row["last_activity"] == before


def test_a_key_for_the_http_endpoint_is_made_without_starlette(tmp_path: Path) -> None:
    """Making a key needs no web framework: `keys http generate` works in an
    install without the http extra (starlette and uvicorn made unimportable
    here), and `http` itself says how to add the extra, as it is installed."""
    import json
    import subprocess
    import sys

    without = (
        "import sys; sys.modules.update(starlette=None, uvicorn=None); "
        "from hermes_sup.cli.main import main; sys.argv[0] = 'hermes-sup'; main()"
    )
    args = ["keys", "http", "generate", "web", "--data-dir", str(tmp_path)]
    made = subprocess.run(
        [sys.executable, "-c", without, *args], capture_output=True, text=True, timeout=60
    )
    assert made.returncode == 0, made.stderr
    assert made.stdout.startswith("hsk-")
    assert "web" in json.dumps(sorted(p.name for p in (tmp_path / "http" / "keys").iterdir()))
    serve = subprocess.run(
        [sys.executable, "-c", without, "http", "--listen", "0", "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert serve.returncode == 1
    assert "needs starlette and uvicorn (the http extra)" in serve.stderr
    assert "pip install" in serve.stderr and "'hermes-sup[http]'" not in serve.stderr
    assert "Traceback" not in serve.stderr


def test_status_during_a_long_start_says_how_far_it_is(tmp_path: Path) -> None:
    """Before the control socket is up (the sealed Hermes preload), status
    reads the starting supervisor's report; one left by a supervisor that
    died (no lock held) is not believed."""
    import fcntl
    import os

    from hermes_sup.local import statedir

    report = {"pid": 4242, "stage": "preloading Hermes: 640 of 1820 modules", "seconds": 35.2}
    statedir.write_starting(tmp_path, report)
    assert (tmp_path / statedir.STARTING_FILE).stat().st_mode & 0o777 == 0o600
    code, out = run("--state-dir", str(tmp_path), "status")
    assert code == 3 and "is starting" not in out  # nobody holds the lock
    fd = os.open(tmp_path / statedir.LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as the starting supervisor does
        code, out = run("--state-dir", str(tmp_path), "status")
    finally:
        os.close(fd)
    assert code == 6  # starting: exit code of its own
    assert (
        "the supervisor (pid 4242) is starting: preloading Hermes: 640 of 1820 modules, "
        "35s so far" in out
    )


def test_serve_hermes_without_the_hermes_extra_says_so_in_one_line(tmp_path: Path) -> None:
    """Not a traceback, then "ready", then every session failing: one line
    with the command that adds the extra, and nothing started."""
    import subprocess
    import sys

    without = (
        "import sys; sys.modules.update(run_agent=None, gateway=None, hermes_state=None, "
        "tools=None); from hermes_sup.cli.main import main; sys.argv[0] = 'hermes-sup'; main()"
    )
    serve = subprocess.run(
        [sys.executable, "-c", without, "--state-dir", str(tmp_path / "s"), "serve",
         "--data-dir", str(tmp_path / "d"), "--agent", "hermes"],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert serve.returncode == 1, serve.stderr
    assert "needs hermes-agent (the hermes extra; no run_agent" in serve.stderr
    assert "pip install" in serve.stderr and "Traceback" not in serve.stderr
    assert len(serve.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "s" / "control.sock").exists()
