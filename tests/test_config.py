"""The TOML configuration file: checked with messages that name the file and
the key, overridden by flags, and used by a real supervisor."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hermes_sup.supervisor import configfile
from hermes_sup.supervisor.config import SETTINGS, Settings

from .clirunner import hermes_sup


def check(path: Path) -> subprocess.CompletedProcess[str]:
    return hermes_sup("config", "check", str(path))


GOOD = """
log_level = "warning"
max_sessions = 100
idle_timeout = 0
memory_limit_mb = 512
pass_env = ["OPENAI_*"]
env = { TZ = "UTC" }
heartbeat_timeout = 20

[agent]
model = "m"
base_url = "http://127.0.0.1:1/v1"

[session_defaults]
session_env = { platform = "api" }
"""


def test_a_good_file_loads_with_every_kind_of_value(tmp_path: Path) -> None:
    path = tmp_path / "hermes-sup.toml"
    path.write_text(GOOD)
    values = configfile.load(path)
    assert values["max_sessions"] == 100 and values["idle_timeout"] is None
    assert values["memory_limit_mb"] == 512 and values["heartbeat_timeout"] == 20.0
    assert "PATH" in values["pass_env"] and "OPENAI_*" in values["pass_env"]
    assert values["runtime_config"] == {"model": "m", "base_url": "http://127.0.0.1:1/v1"}
    assert values["session_defaults"]["session_env"] == {"PLATFORM": "api"}
    result = check(path)
    assert result.returncode == 0 and "ok" in result.stdout


@pytest.mark.parametrize(
    "text, words",
    [
        ("max_sesions = 5", "unknown key 'max_sesions'; did you mean 'max_sessions'?"),
        ("max_sessions = 'many'", "max_sessions must be a whole number (0 = off)"),
        ("stop_timeout = -1", "stop_timeout must not be negative"),
        ("log_level = 'loud'", "log_level must be one of debug, info, warning, error"),
        ("pass_env = 'PATH'", "pass_env must be a list of strings"),
        ("env = { A = 1 }", "env must be a table of strings"),
        ("[agent]\nmodle = 'x'", "[agent]: unknown key 'modle'"),
        ("[agent]\napi_key_env = 'HSUP_TEST_UNSET_VAR'", "api_key_env names HSUP_TEST_UNSET_VAR"),
        ("[session_defaults]\nenv = { HERMES_HOME = '/x' }", "set by the supervisor"),
        ("max_sessions = ", "not valid TOML"),
        ("tcp = '*:7788'", "write 0.0.0.0 to listen on every interface"),
        ("tcp = 'host:port'", "the port must be a number"),
        ("workspace_roots = ['projects']", "workspace_roots: 'projects' is not an absolute path"),
    ],
)
def test_bad_files_name_the_file_the_key_and_the_problem(
    tmp_path: Path, text: str, words: str
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(configfile.ConfigError) as err:
        configfile.load(path, environ={})
    assert str(err.value).startswith(str(path)) and words in str(err.value)
    result = check(path)
    assert result.returncode == 1 and words in result.stderr and "Traceback" not in result.stderr


def test_flags_override_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("max_queue = 7\nstop_timeout = 9\n")
    base = Settings(state_dir=tmp_path / "s", data_dir=tmp_path / "d")
    settings = configfile.build(base, path, {"max_queue": 3})
    assert settings.max_queue == 3 and settings.stop_timeout == 9.0


@pytest.mark.e2e
def test_a_supervisor_runs_from_a_config_file(supervisor_factory, workdir) -> None:
    path = workdir / "hermes-sup.toml"
    path.write_text(
        'env = { FROM_FILE = "yes" }\npass_env = ["HSUP_ALLOWED"]\nmax_queue = 5\n'
        '[session_defaults]\nsession_env = { platform = "file-default" }\n'
    )
    env = dict(os.environ, HSUP_ALLOWED="passed", HSUP_HIDDEN="hidden")
    sup = supervisor_factory("--config", str(path), "--max-queue", "2", env=env)
    with sup.client() as client:
        assert client.run("a", "env FROM_FILE").text == "yes"
        assert client.run("a", "env HSUP_ALLOWED").text == "passed"
        assert client.run("a", "env HSUP_HIDDEN").text == ""
        assert client.run("a", "env HERMES_SESSION_PLATFORM").text == "file-default"
    # The flag's --max-queue 2 won over the file's 5.
    from hermes_sup.protocol import Kind

    with sup.client() as client:
        reqs = [client.submit(Kind.SEND, {"text": "sleep 0.5"}, session="q") for _ in range(5)]
        finals = []
        while len(finals) < 5:
            msg = client.next()
            if msg.kind is not Kind.EVENT:
                finals.append(msg)
        busy = [m for m in finals if m.kind is Kind.ERROR and m.body["code"] == "busy"]
        assert busy and "limit 2" in busy[0].body["message"]
        del reqs


@pytest.mark.e2e
def test_reload_changes_new_sessions_not_running_ones(supervisor_factory, workdir) -> None:
    import signal
    import time

    path = workdir / "hermes-sup.toml"
    path.write_text('env = { FLAVOUR = "old" }\n')
    sup = supervisor_factory("--config", str(path))
    hs = [sys.executable, "-m", "hermes_sup.cli", "--state-dir", str(sup.state_dir)]
    with sup.client() as client:
        assert client.run("running", "env FLAVOUR").text == "old"

        path.write_text('env = { FLAVOUR = "new" }\nmax_queue = 9\nmax_frame_size = 65536\n')
        result = subprocess.run([*hs, "reload"], capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, result.stderr
        assert "changed: env, max_queue" in result.stdout
        assert "needs a restart to change: max_frame_size" in result.stdout
        assert client.run("running", "env FLAVOUR").text == "old"  # keeps its own
        assert client.run("fresh", "env FLAVOUR").text == "new"

        # An invalid file is refused; the settings in force stay.
        path.write_text('env = { FLAVOUR = "broken" }\nmax_queue = "lots"\n')
        bad = subprocess.run([*hs, "reload"], capture_output=True, text=True, timeout=30)
        assert bad.returncode == 1 and "max_queue must be a whole number" in bad.stderr
        assert client.run("another", "env FLAVOUR").text == "new"
        assert "reload_refused" in sup.log()

        # SIGHUP does the same.
        path.write_text('env = { FLAVOUR = "hup" }\n')
        sup.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "FLAVOUR" not in sup.log().split("reloaded", 2)[-1] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.run("after-hup", "env FLAVOUR").text == "hup"
        # A running session picks the new settings up when it restarts.
        client.kill("running")
        assert client.run("running", "env FLAVOUR").text == "hup"

    # The asyncio client reloads as the blocking one does.
    import asyncio

    from hermes_sup.client import AsyncClient

    path.write_text('env = { FLAVOUR = "async" }\n')

    async def reload_async() -> dict:
        hs_async = AsyncClient(sup.state_dir)
        try:
            return await hs_async.reload()
        finally:
            await hs_async.close()

    assert asyncio.run(reload_async())["changed"] == ["env"]


def test_the_configuration_reference_documents_every_key() -> None:
    """The docs' table (made at build time from the declarations) has a row
    for every setting, and the configuration page asks for it."""
    import dataclasses

    from hermes_sup.supervisor.config import reference_table

    table = reference_table()
    for field in dataclasses.fields(Settings):
        if field.name in configfile.META_FIELDS or field.name in (
            "runtime_config",
            "session_defaults",
        ):
            continue
        assert f"| `{field.name}` |" in table, field.name
    page = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()
    assert "\n<!-- reference: settings -->\n" in page


# ---------------------------------------------------------------- flags


def serve_values(*args: str) -> dict:
    """What `serve ARGS` would set over the file, parsed only (nothing starts)."""
    from hermes_sup.cli.serve import serve

    ctx = serve.make_context("serve", list(args), obj={"state_dir_given": False})
    return {
        name: value
        for name, value in ctx.params.items()
        if name in SETTINGS and ctx.get_parameter_source(name).name == "COMMANDLINE"
    }


def test_every_setting_has_a_flag_of_serve() -> None:
    from hermes_sup.cli.serve import serve

    flags = {opt for param in serve.params for opt in param.opts}
    for setting in SETTINGS.values():
        if setting.name == "session_defaults":  # a table of options: the file only
            assert not setting.flag
            continue
        assert {setting.flag, *setting.aliases} <= flags, setting.name


def test_a_flag_reads_its_value_as_the_file_does(tmp_path: Path) -> None:
    assert serve_values("--runtime", "hermes") == serve_values("--agent", "hermes")
    assert serve_values("--agent", "hermes") == {"runtime": "hermes"}
    assert serve_values("--memory-limit", "0", "--turn-timeout", "none") == {
        "memory_limit_mb": None,
        "turn_timeout": None,
    }
    assert serve_values("--stream-coalesce-ms", "0", "--client-queue", "0") == {
        "stream_coalesce_ms": 0.0,
        "client_queue": 0,
    }
    assert serve_values("--pass-env", "OPENAI_*")["pass_env"][-1] == "OPENAI_*"
    assert "PATH" in serve_values("--pass-env", "OPENAI_*")["pass_env"]
    assert serve_values("--env", "A=1", "--env", "B=2") == {"env": {"A": "1", "B": "2"}}
    roots = serve_values("--workspace-root", "rel", "--repo-root", "/abs")
    assert roots["workspace_roots"] == (str(Path("rel").absolute()),)
    assert roots["repo_roots"] == ("/abs",)
    path = tmp_path / "c.toml"
    path.write_text("memory_limit_mb = 0\nturn_timeout = 0\nstream_coalesce_ms = 0\n")
    assert configfile.load(path) == {
        "memory_limit_mb": None,
        "turn_timeout": None,
        "stream_coalesce_ms": 0.0,
    }


def test_a_time_in_seconds_is_also_a_duration_in_the_file_and_on_the_line(
    tmp_path: Path,
) -> None:
    """idle_timeout = "30m" reads as `kill --idle-for 30m` does; a duration
    is only for settings in seconds (not the _ms one, not a count)."""
    path = tmp_path / "c.toml"
    path.write_text('idle_timeout = "30m"\nturn_timeout = "1h30m"\nstop_timeout = "90s"\n')
    assert configfile.load(path) == {
        "idle_timeout": 1800.0,
        "turn_timeout": 5400.0,
        "stop_timeout": 90.0,
    }
    assert serve_values("--idle-timeout", "30m", "--turn-timeout", "2h") == {
        "idle_timeout": 1800.0,
        "turn_timeout": 7200.0,
    }
    assert serve_values("--idle-timeout", "0") == {"idle_timeout": None}  # still: 0 is off
    for line in ('idle_timeout = "soon"', 'stream_coalesce_ms = "5s"', 'max_queue = "5m"'):
        path.write_text(line + "\n")
        with pytest.raises(configfile.ConfigError):
            configfile.load(path)


@pytest.mark.parametrize(
    "args, words, line",
    [
        (["--idle-timeout", "soon"], "'soon' is not a duration like 90s", 'idle_timeout = "soon"'),
        (["--max-frame-size", "1000"], "'1000' is less than 1024", "max_frame_size = 1000"),
        (["--max-queue", "0"], "'0' is less than 1", "max_queue = 0"),
        (["--log-backups", "-1"], "'-1' is negative", "log_backups = -1"),
        (["--tcp", "*:7788"], "write 0.0.0.0 to listen on every interface", 'tcp = "*:7788"'),
        (["--sealed", "sometimes"], "'sometimes' is not one of", 'sealed = "sometimes"'),
    ],
)
def test_a_flag_refuses_what_the_file_refuses(
    args: list[str], words: str, line: str, tmp_path: Path
) -> None:
    import click

    with pytest.raises(click.BadParameter) as err:
        serve_values(*args)
    assert words in err.value.format_message()
    path = tmp_path / "c.toml"
    path.write_text(line + "\n")
    with pytest.raises(configfile.ConfigError):
        configfile.load(path)
