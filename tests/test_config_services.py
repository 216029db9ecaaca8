"""Every service's settings come from its one table: each flag is on its
command's --help, each key is accepted by `config check` (and a misspelt one
named), each environment variable is its option's, and what one process
passes another as flags reads back as the same values."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from hermes_sup.cli.configcheck import check_file, section_tables
from hermes_sup.cli.main import cli
from hermes_sup.httpapi.settings import API_SETTINGS, ApiSettings
from hermes_sup.local.settings import SECTIONS, Setting, from_file, to_argv
from hermes_sup.supervisor.config import SETTINGS

# Each table, the command whose flags it makes, and its table in the file
# ("" for serve's top-level keys).
SERVICES = [
    ("serve", ["serve"], ""),
    ("http_api", ["http"], "http_api"),
    ("route", ["route"], "route"),
    ("ray", ["ray", "up"], "ray"),
]


def table_of(name: str) -> Mapping[str, Setting]:
    return SETTINGS if name == "serve" else section_tables()[name]


def test_the_file_s_tables_are_the_services_tables() -> None:
    assert set(section_tables()) == set(SECTIONS)


@pytest.mark.parametrize("name, command, section", SERVICES)
def test_each_flag_of_the_table_is_on_its_command_s_help(
    name: str, command: list[str], section: str
) -> None:
    shown = CliRunner().invoke(cli, [*command, "--help"], terminal_width=200)
    assert shown.exit_code == 0, shown.output
    words = shown.output.split()
    for s in table_of(name).values():
        if not s.flag:  # a table of the file only ([session_defaults])
            continue
        for flag in (s.flag, *s.aliases):
            assert flag in words or f"{flag}," in words, (name, flag)


def _command(path: list[str]) -> Any:
    group: Any = cli
    ctx = group.make_context("hermes-sup", [*path, "--help"], resilient_parsing=True)
    for part in path:
        group = group.get_command(ctx, part)
    return group


@pytest.mark.parametrize("name, command, section", SERVICES)
def test_each_option_reads_the_table_s_environment_variable(
    name: str, command: list[str], section: str
) -> None:
    options = {p.name: p for p in _command(command).params}
    for s in table_of(name).values():
        if s.flag and s.name != "state_dir":  # state_dir: the group reads it for all
            assert options[s.name].envvar == s.envvar, (name, s.name)


def toml_value(s: Setting, tmp_path: Path) -> Any:
    """A value the file may hold for `s`: its default, written as TOML."""
    value = s.default
    if value is None:
        return str(tmp_path) if s.base is Path else 0
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    return value


def toml_text(values: Mapping[str, Any]) -> str:
    """Top-level keys and tables as TOML (JSON's strings, numbers and
    arrays are TOML's; a table is inline)."""
    lines = []
    for key, value in values.items():
        if isinstance(value, dict):
            inner = ", ".join(f"{k} = {json.dumps(v)}" for k, v in value.items())
            lines.append(f"{key} = {{ {inner} }}")
        else:
            lines.append(f"{key} = {json.dumps(value)}")
    return "\n".join(lines) + "\n"


def test_config_check_accepts_every_key_of_every_table(tmp_path: Path) -> None:
    """A file that sets every key of serve and of each service's table is
    good: no key of any table is unknown to `config check`."""
    text = toml_text({s.file_key: toml_value(s, tmp_path) for s in SETTINGS.values()})
    for section, table in section_tables().items():
        values = {s.file_key: toml_value(s, tmp_path) for s in table.values()}
        text += f"\n[{section}]\n" + toml_text(values)
    path = tmp_path / "every.toml"
    path.write_text(text)
    values, errors = check_file(path)
    assert errors == []
    assert set(values) == {s.name for s in SETTINGS.values()} | set(SECTIONS)
    for section, table in section_tables().items():
        assert set(values[section]) == set(table), section
    done = CliRunner().invoke(cli, ["config", "check", str(path)])
    assert done.exit_code == 0, done.output


@pytest.mark.parametrize(
    "text, words",
    [
        ('htp = "8642"', "unknown key 'htp'; did you mean 'http'?"),
        ('log_fromat = "json"', "unknown key 'log_fromat'; did you mean 'log_format'?"),
        ('log_format = "xml"', "log_format must be one of text, json"),
        ('http = "*:8642"', "write 0.0.0.0 to listen on every interface"),
        ("[http_api]\nmodle = 'm'", "[http_api]: unknown key 'modle'; did you mean 'model'?"),
        ("[http_api]\nretry_grace = 7200", "[http_api]: retry_grace must be at most 3600"),
        ("[http_api]\nmax_body = 'big'", "[http_api]: max_body must be a whole number"),
        ("[route]\npoll = 0.01", "[route]: poll must be at least 0.05"),
        ("[route]\nlog_level = 'loud'", "[route]: log_level must be one of"),
        ("[ray]\ncapacity = 0", "[ray]: capacity must be more than 0"),
        ("[ray]\nhost = 'node-a'", "'node-a' is not an IP address"),
        ("[rout]\npoll = 2", "unknown key 'rout'; did you mean 'route'?"),
        ("route = 2", "[route] must be a table"),
    ],
)
def test_config_check_names_a_bad_key_of_any_table(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text + "\n")
    _, errors = check_file(path)
    assert len(errors) == 1 and words in errors[0] and str(path) in errors[0], errors


def test_serve_skips_the_other_services_tables(tmp_path: Path) -> None:
    from hermes_sup.supervisor import configfile

    path = tmp_path / "c.toml"
    path.write_text('http = "8080"\n[http_api]\nmodel = "m"\n[route]\npoll = 2\n[ray]\n')
    assert configfile.load(path) == {"http": "8080"}


def test_the_endpoint_reads_back_the_flags_a_command_passes_it() -> None:
    """What `serve` (its file's [http_api]) and `hermes-sup http` pass the
    endpoint's process as flags (`to_argv`) is what the endpoint holds."""
    from hermes_sup.httpapi.serve import api_settings, parse_args

    chosen = {
        "model": "m",
        "max_body": 4096,
        "body_timeout": 5.0,
        "max_connections": 7,
        "run_ttl": 90.0,
        "retry_grace": 3.5,
        "cors_origins": ("https://a.example", "https://b.example"),
    }
    argv = ["--data-dir", "/nonexistent", *to_argv(API_SETTINGS, chosen)]
    held = api_settings(parse_args(argv), {}, None)
    assert held == ApiSettings(**chosen)
    # Nothing given: the defaults, and the environment's where it names one.
    environ = {"HERMES_SUP_HTTP_RETRY_GRACE": "2m", "API_SERVER_CORS_ORIGINS": "https://h.example"}
    held = api_settings(parse_args(["--data-dir", "/nonexistent"]), environ, None)
    assert held == ApiSettings(retry_grace=120.0, cors_origins=("https://h.example",))


def test_defaults_kept_beside_their_code_are_the_tables() -> None:
    """Two defaults are typed in the table and in code the table's
    importers must not load (starlette, zmq): held equal here."""
    from hermes_sup.cli.route import ROUTER_SETTINGS
    from hermes_sup.cluster.router import CLIENT_QUEUE
    from hermes_sup.httpapi.guard import HEADER_TIMEOUT

    assert ROUTER_SETTINGS["client_queue"].default == CLIENT_QUEUE
    assert API_SETTINGS["header_timeout"].default == HEADER_TIMEOUT


def test_serve_s_new_keys_read_as_their_flags_do(tmp_path: Path) -> None:
    from hermes_sup.cli.serve import serve

    args = ["--http", "8080", "--http-web", "web", "--log-format", "json"]
    ctx = serve.make_context("serve", args, obj={"state_dir_given": False})
    assert ctx.params["http"] == "8080"
    assert ctx.params["http_web"] == str(Path("web").absolute())
    assert ctx.params["log_format"] == "json"
    assert from_file(SETTINGS["log_format"], "json") == "json"


def test_the_router_takes_its_table_from_the_file(tmp_path: Path, monkeypatch) -> None:
    """`route --config FILE` reads [route]; its flags win over it."""
    from hermes_sup.cluster import router

    seen: dict[str, Any] = {}
    monkeypatch.setattr(
        router, "serve_router", lambda state_dir, source, **kw: seen.update(kw, state=state_dir)
    )
    nodes = tmp_path / "nodes.toml"
    nodes.write_text("")
    path = tmp_path / "c.toml"
    path.write_text(f'[route]\nnodes = "{nodes}"\npoll = "2s"\nclient_queue = 5\n')
    args = ["route", "--config", str(path), "--state-dir", str(tmp_path / "s"), "--poll", "3"]
    done = CliRunner().invoke(cli, args)
    assert done.exit_code == 0, done.output
    assert seen["poll_interval"] == 3.0 and seen["client_queue"] == 5
    assert seen["state"] == tmp_path / "s"


def test_ray_up_takes_its_table_from_the_file(tmp_path: Path, monkeypatch) -> None:
    """`ray up --config FILE` reads [ray]; `address` and `base_dir` must be
    given, by a flag or the file."""
    from types import SimpleNamespace

    from hermes_sup.cli import ray

    calls: list[tuple[Any, ...]] = []
    agents = SimpleNamespace(
        connect=lambda address: calls.append(("connect", address)),
        up=lambda *a, **kw: calls.append(("up", a, kw)) or [],
        wait_registered=lambda n: [],
        skipped=lambda: [],
    )
    monkeypatch.setattr(ray, "_agents", lambda: agents)
    path = tmp_path / "c.toml"
    path.write_text(f'[ray]\naddress = "10.0.0.1:6379"\nbase_dir = "{tmp_path}"\nping_misses = 5\n')
    done = CliRunner().invoke(cli, ["ray", "up", "--config", str(path), "--capacity", "2"])
    assert done.exit_code == 0, done.output
    assert calls[0] == ("connect", "10.0.0.1:6379")
    _, args, kw = calls[1]
    assert args[:2] == (tmp_path, 2.0) and kw["watchdog"].misses == 5 and kw["host"] is None
    missing = CliRunner().invoke(cli, ["ray", "up", "--address", "auto"])
    assert missing.exit_code == 2 and "--base-dir" in missing.output


def test_the_tables_load_no_service_and_no_http_stack() -> None:
    """The table machinery is local/'s (standard library only) and the
    endpoint's table needs no http extra: `config check`, the docs and the
    router read them without the supervisor, starlette or zmq."""
    from tests.test_layout import modules_loaded_by, package

    loaded = modules_loaded_by("hermes_sup.local.settings", "hermes_sup.httpapi.settings")
    assert "hermes_sup.httpapi.settings" in loaded
    server = {"hermes_sup.supervisor", "hermes_sup.worker", "hermes_sup.cli", "hermes_sup.cluster"}
    assert [m for m in loaded if package(m) in server] == []
    assert [m for m in loaded if m.split(".")[0] in ("starlette", "uvicorn", "zmq")] == []
