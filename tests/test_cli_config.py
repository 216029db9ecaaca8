"""`hermes-sup config check` reports every error of a file at once, and what
cannot work though it parses: a runtime that cannot be imported, hermes
without hermes-agent, missing preload modules and workspace roots."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from hermes_sup.cli import configcheck
from hermes_sup.local.version import install_hint

from .clirunner import hermes_sup

BAD = """\
idle_timout = 5
memory_limit_mb = "lots"
preload = ["no_such_module_hsup"]
workspace_roots = ["/nonexistent/hsup-root"]
runtimes = ["no_such_package_hsup.agent:make"]

[agent]
modle = "x"
"""


def check(path: Path) -> subprocess.CompletedProcess[str]:
    return hermes_sup("config", "check", str(path))


def test_every_error_is_reported_at_once(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(BAD)
    result = check(config)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    for words in (
        "unknown key 'idle_timout'; did you mean 'idle_timeout'?",
        "memory_limit_mb must be a whole number",
        "[agent]: unknown key 'modle'",
        "runtime 'no_such_package_hsup.agent:make' cannot start: cannot import",
        "preload: no module named 'no_such_module_hsup'",
        "workspace_roots: /nonexistent/hsup-root is not a directory",
        "6 error(s); nothing was started",
    ):
        assert sum(words in e for e in errors) == 1, (words, errors)
    assert len(errors) == 7


def test_a_runtime_module_that_does_not_exist(tmp_path: Path) -> None:
    config = tmp_path / "runtime.toml"
    config.write_text('runtime = "no_such_package_hsup:make"\n')
    result = check(config)
    assert result.returncode == 1
    assert "runtime 'no_such_package_hsup:make' cannot start" in result.stderr
    config.write_text('runtime = "probe"\nspare_workers = 1\n')
    good = check(config)
    assert good.returncode == 0, good.stderr
    assert good.stdout.strip() == f"{config}: ok (2 setting(s))"


def test_hermes_without_hermes_agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "hermes.toml"
    config.write_text('runtime = "hermes"\n')
    # As if hermes-agent were not installed: what the runtime imports is missing.
    monkeypatch.setattr(configcheck, "HERMES_MODULES", ("no_such_hermes_module_hsup",))
    _, errors = configcheck.check_file(config)
    assert errors == [
        f"{config}: runtime 'hermes' cannot start: hermes-agent is not installed (no "
        "no_such_hermes_module_hsup); add the hermes extra: " + install_hint("hermes")
    ]
    # Said as it works here, from this checkout: not from a package index.
    assert "pip install -e '" in errors[0] and "[hermes]'" in errors[0]
    assert "'hermes-sup[" not in errors[0]
