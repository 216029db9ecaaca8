"""The service unit an operator installs (issue 18 items 7-8): it reloads
(RELOADING=1 then READY=1 over systemd's notify socket for
Type=notify-reload, ExecReload= on an older systemd), reads a default
config file, is hardened to what `systemd-analyze security` rates OK, and
install-service warns about paths the unit cannot reach and writes to
standard output with `--output -`."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hermes_sup.cli.service import CONFIG_TEMPLATE, render

from .clirunner import hermes_sup

REPO = Path(__file__).parent.parent
# What `systemd-analyze security` rated the unit when it was hardened (2.2
# with systemd 252); the unhardened one was 7.7 EXPOSED.
MAX_EXPOSURE = 2.5


def install_service(*args: str, argv0: str | None = None, cwd: Path | None = None):
    command = [sys.executable, "-m", "hermes_sup.cli", "install-service", *args]
    if argv0 is not None:
        command = [argv0, "install-service", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=cwd)


def test_reload_says_reloading_then_ready_to_systemd(supervisor_factory, workdir) -> None:
    path = str(workdir / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(10)
    config = workdir / "config.toml"
    config.write_text(CONFIG_TEMPLATE + "idle_timeout = 600\n")
    try:
        sup = supervisor_factory("--config", str(config), env=dict(os.environ, NOTIFY_SOCKET=path))

        def next_with(field: str) -> list[str]:
            while True:
                fields = sock.recv(4096).decode().split("\n")
                if any(f.startswith(field) for f in fields):
                    return fields

        next_with("READY=1")  # started
        config.write_text(CONFIG_TEMPLATE + "idle_timeout = 900\n")
        result = subprocess.run(
            [sys.executable, "-m", "hermes_sup.cli", "reload", "--state-dir", str(sup.state_dir)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert result.returncode == 0 and "idle_timeout" in result.stdout, result.stderr
        reloading = next_with("RELOADING=1")
        usec = next(f for f in reloading if f.startswith("MONOTONIC_USEC="))
        assert abs(int(usec.split("=")[1]) / 1e6 - time.monotonic()) < 30
        assert "READY=1" in next_with("READY=1")
        # SIGHUP (what systemd sends) too, and a refused reload still ends READY.
        config.write_text("idle_timeout = 'soon'\n")
        sup.proc.send_signal(signal.SIGHUP)
        next_with("RELOADING=1")
        next_with("READY=1")
        assert "reload_refused" in sup.log()
    finally:
        sock.close()


def test_the_unit_reloads_and_reads_a_default_config() -> None:
    portable = render("/opt/x/bin/hermes-sup")
    assert "Type=notify\n" in portable and "ExecReload=/bin/kill -HUP $MAINPID" in portable
    newer = render("/opt/x/bin/hermes-sup", notify_reload=True)
    assert "Type=notify-reload" in newer and "ExecReload" not in newer
    for unit in (portable, newer):
        assert "Environment=HERMES_SUP_CONFIG=/etc/hermes-sup/config.toml" in unit
    # The shipped unit is the portable one for /opt/hermes-sup.
    shipped = (REPO / "contrib" / "hermes-sup.service").read_text()
    assert shipped == render("/opt/hermes-sup/.venv/bin/hermes-sup")


def test_the_default_config_is_valid(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(CONFIG_TEMPLATE)
    result = hermes_sup("config", "check", str(config))
    assert result.returncode == 0, result.stderr


def test_install_service_writes_the_config_once_and_dash_means_stdout(tmp_path: Path) -> None:
    unit, config = tmp_path / "unit.service", tmp_path / "etc" / "config.toml"
    first = install_service("--output", str(unit), "--config", str(config))
    assert first.returncode == 0, first.stderr
    assert f"Environment=HERMES_SUP_CONFIG={config}" in unit.read_text()
    assert config.read_text() == CONFIG_TEMPLATE and f"wrote {config}" in first.stdout
    config.write_text("spare_workers = 2\n")
    again = install_service("--output", str(unit), "--config", str(config))
    assert again.returncode == 0 and config.read_text() == "spare_workers = 2\n"

    shown = install_service("--output", "-", "--config", str(config), cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("# hermes-sup as a system service")
    assert "ExecStart=" in shown.stdout and "wrote" not in shown.stdout
    assert not (tmp_path / "-").exists()


def test_install_service_warns_about_paths_the_unit_cannot_reach(workdir: Path) -> None:
    # The case: an install in a clone under /tmp, which PrivateTmp=yes hides.
    clone = workdir / "bin"
    clone.mkdir()
    script = clone / "hermes-sup"
    script.write_text(f"#!{sys.executable}\nfrom hermes_sup.cli.main import main\nmain()\n")
    script.chmod(0o755)
    result = install_service("--output", "-", argv0=str(script))
    assert result.returncode == 0, result.stderr
    assert f"ExecStart={script} serve" in result.stdout
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert any(f"{script} is under /tmp, which PrivateTmp=yes hides" in w for w in warnings)
    assert all("python3 -m venv /opt/hermes-sup/.venv" in w for w in warnings)


def test_install_service_names_a_directory_the_service_user_cannot_enter(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hermes_sup.cli import service

    monkeypatch.setattr(service, "PRIVATE_TMP", ())  # workdir is in /tmp: look past that
    workdir.chmod(0o711)
    private = workdir / "private"
    (private / "bin").mkdir(parents=True)
    target = private / "bin" / "hermes-sup"
    target.write_text("")
    private.chmod(0o700)
    problems = service.unreachable([target], "no-such-user-hsup", "yes")
    assert problems == [
        f"{target}: user no-such-user-hsup may not enter {private} (mode 700, owner {os.getuid()})"
    ]
    private.chmod(0o755)
    target.chmod(0o600)
    assert service.unreachable([target], "no-such-user-hsup", "yes") == [
        f"{target}: user no-such-user-hsup may not read {target} (mode 600, owner {os.getuid()})"
    ]
    target.chmod(0o644)
    assert service.unreachable([target], "no-such-user-hsup", "yes") == []


def exposure(unit: Path) -> float:
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", "--no-pager", str(unit)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    found = re.search(r"Overall exposure level for \S+: ([\d.]+)", result.stdout)
    if result.returncode != 0 or found is None:
        pytest.skip(f"systemd-analyze security --offline does not work here: {result.stderr}")
    return float(found.group(1))


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="no systemd-analyze")
def test_systemd_analyze_rates_the_unit_ok(tmp_path: Path) -> None:
    unit = tmp_path / "hermes-sup.service"
    unit.write_text((REPO / "contrib" / "hermes-sup.service").read_text())
    assert exposure(unit) <= MAX_EXPOSURE
    # The same unit under a home directory (ProtectHome=read-only) stays OK.
    unit.write_text(render("/home/ops/hermes-sup/.venv/bin/hermes-sup", protect_home="read-only"))
    assert exposure(unit) <= MAX_EXPOSURE + 0.2


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="no systemd-analyze")
def test_hermes_behind_http_from_the_unit_file(tmp_path: Path) -> None:
    """install-service for Hermes behind HTTP: the unit runs serve with the
    agent, its config and the endpoint, loads the model key from a root-only
    file, the first front end's key works against the service's data dir, and
    systemd-analyze finds the unit clean and as hardened as the plain one."""
    from hermes_sup.httpapi.keys import KeyStore

    etc = tmp_path / "etc-src"
    etc.mkdir()
    agent = etc / "agent.toml"
    agent.write_text('model = "m"\nbase_url = "http://127.0.0.1:9/v1"\napi_key_env = "MODEL_KEY"\n')
    secrets = etc / "secrets.env"
    secrets.write_text("# the model key\nMODEL_KEY=sk-not-in-the-unit\n")
    secrets.chmod(0o600)
    root = tmp_path / "root"
    done = install_service(
        "--root", str(root), "--agent", "hermes", "--agent-config", str(agent),
        "--env-file", str(secrets), "--http", "127.0.0.1:8642", "--http-key", "webui",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    unit = root / "etc/systemd/system/hermes-sup.service"
    text = unit.read_text()
    serve = re.search(r"^ExecStart=(.*)$", text, re.MULTILINE)
    assert serve is not None and serve.group(1).endswith(" serve")  # settings in the file
    assert f"EnvironmentFile={secrets}" in text
    # The runtime, the endpoint and the agent's table are in the settings file,
    # which the service's own check accepts with the env file's variable set.
    config = root / "etc/hermes-sup/config.toml"
    assert (
        'runtime = "hermes"\nhttp = "127.0.0.1:8642"\n\n[agent]\nmodel = "m"' in config.read_text()
    )
    checked = hermes_sup("config", "check", str(config), env={"MODEL_KEY": "x"})
    assert checked.returncode == 0, checked.stderr
    # A second run never edits the operator's file: it says what to add.
    again = install_service("--root", str(root), "--http", "127.0.0.1:8642")
    assert again.returncode == 1 and "add these lines to it" in again.stderr
    assert 'http = "127.0.0.1:8642"' in again.stderr
    assert "sk-not-in-the-unit" not in text  # the key stays in the root-only file
    key_file = root / "etc/hermes-sup/http-key-webui"
    assert key_file.stat().st_mode & 0o777 == 0o600
    tenant = KeyStore(root / "var/lib/hermes-sup").check(key_file.read_text().strip())
    assert tenant is not None and tenant.name == "webui"
    verify = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=120
    )
    assert verify.returncode == 0 and str(unit.name) not in verify.stderr, verify.stderr
    assert exposure(unit) <= MAX_EXPOSURE


def test_install_service_checks_hermes_behind_http_before_writing(tmp_path: Path) -> None:
    agent = tmp_path / "agent.toml"
    agent.write_text('model = "m"\napi_key_env = "NOT_IN_THE_ENV_FILE"\n')
    secrets = tmp_path / "secrets.env"
    secrets.write_text("MODEL_KEY=x\n")
    root = tmp_path / "root"
    said = install_service(
        "--root", str(root), "--agent-config", str(agent), "--env-file", str(secrets),
    )  # fmt: skip
    assert said.returncode == 2 and "NOT_IN_THE_ENV_FILE, which is not set" in said.stderr
    said = install_service("--root", str(root), "--http", "*:80")
    assert said.returncode == 2 and "write 0.0.0.0" in said.stderr
    said = install_service("--root", str(root), "--http-key", "web")
    assert said.returncode == 2 and "give it too" in said.stderr
    said = install_service("--root", str(root), "--env-file", str(tmp_path / "missing.env"))
    assert said.returncode == 2 and "does not exist" in said.stderr
    assert not root.exists()  # nothing written on a refusal
