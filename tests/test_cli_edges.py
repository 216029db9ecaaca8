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
