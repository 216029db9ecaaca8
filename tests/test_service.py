"""Running as a system service: systemd's notify protocol over a real unix
datagram socket, the unit file, and socket/data permissions for a real
non-root service user."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from hermes_sup.client import Client

pytestmark = pytest.mark.e2e


def test_sd_notify_ready_status_watchdog_stopping(supervisor_factory, workdir) -> None:
    path = str(workdir / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(10)
    try:
        env = dict(os.environ, NOTIFY_SOCKET=path, WATCHDOG_USEC="600000")
        sup = supervisor_factory(env=env, start=False)
        sup.start(wait=False)

        def receive() -> list[str]:
            return sock.recv(4096).decode().split("\n")

        first = receive()
        assert "READY=1" in first and f"MAINPID={sup.pid}" in first
        # READY means ready: the control socket answers at once.
        with Client(sup.state_dir, timeout=5) as client:
            client.run("alice", "pid")
        seen: list[str] = []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not (
            seen.count("WATCHDOG=1") >= 3 and any("1 idle" in f for f in seen)
        ):
            seen += receive()
        assert seen.count("WATCHDOG=1") >= 3  # every 0.3 s from the main loop
        assert "STATUS=1 sessions: 1 idle" in seen
        # Workers never see the notify socket.
        with Client(sup.state_dir, timeout=5) as client:
            assert client.run("alice", "env NOTIFY_SOCKET").text == ""
        sup.proc.send_signal(signal.SIGTERM)
        while True:
            fields = receive()
            if "STOPPING=1" in fields:
                break
        assert sup.proc.wait(20) == 0
    finally:
        sock.close()


def test_install_service_writes_a_hardened_notify_unit(tmp_path: Path) -> None:
    out = tmp_path / "hermes-sup.service"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "hermes_sup.cli",
            "install-service",
            "--output",
            str(out),
            "--user",
            "hermes-sup",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    unit = out.read_text()
    for line in (
        "Type=notify",
        "User=hermes-sup",
        "KillMode=control-group",
        "RuntimeDirectory=hermes-sup",
        "StateDirectory=hermes-sup",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "WatchdogSec=",
        "Environment=HERMES_SUP_STATE_DIR=/run/hermes-sup",
        "Environment=HERMES_SUP_DATA_DIR=/var/lib/hermes-sup",
        # A cgroup per session: the subtree is the supervisor's, and one
        # session's OOM kill is not the service's end.
        "Delegate=yes",
        "OOMPolicy=continue",
        "OOMScoreAdjust=-900",
        "ProtectControlGroups=no",
    ):
        assert line in unit, line
    # DelegateSubgroup= where the host's systemd knows it (254+; an older one
    # warns about the line and the supervisor moves itself into its leaf).
    from hermes_sup.cli.service import DELEGATE_SUBGROUP_SINCE, systemd_version

    version = systemd_version()
    knows = version is None or version >= DELEGATE_SUBGROUP_SINCE
    assert ("DelegateSubgroup=supervisor" in unit) == knows
    exec_line = next(x for x in unit.splitlines() if x.startswith("ExecStart="))
    exe = exec_line.split("=", 1)[1].split()[0]
    assert os.access(exe, os.X_OK) and exec_line.endswith(" serve")
    assert "systemctl daemon-reload" in result.stdout
    # The shipped unit is the same template, rendered for /opt/hermes-sup.
    from hermes_sup.cli.service import render

    shipped = Path(__file__).parent.parent / "contrib" / "hermes-sup.service"
    assert shipped.read_text() == render("/opt/hermes-sup/.venv/bin/hermes-sup")


def _ensure_user(name: str) -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
            check=True,
            capture_output=True,
        )
        return pwd.getpwnam(name)


SYSTEM_PYTHON = "/usr/bin/python3.11"


@pytest.fixture(scope="module")
def service_python():
    """An interpreter any user may run, with hermes-sup installed: the test
    interpreter may live where a service user cannot reach (e.g. /root)."""
    if not os.path.exists(SYSTEM_PYTHON):
        pytest.skip(f"{SYSTEM_PYTHON} (an interpreter other users can run) is not installed")
    venv = Path(tempfile.mkdtemp(prefix="hsvenv-", dir="/tmp"))
    try:
        venv.chmod(0o755)
        subprocess.run([SYSTEM_PYTHON, "-m", "venv", str(venv)], check=True)
        repo = Path(__file__).parent.parent
        subprocess.run(
            [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(repo)],
            check=True,
            capture_output=True,
        )
        subprocess.run(["chmod", "-R", "a+rX", str(venv)], check=True)
        yield str(venv / "bin" / "python")
    finally:
        shutil.rmtree(venv, ignore_errors=True)


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("useradd"),
    reason="needs root and useradd to create service users",
)
def test_a_non_root_service_keeps_its_sockets_and_data_private(workdir, service_python) -> None:
    owner = _ensure_user("hsup-test-svc")
    other = _ensure_user("hsup-test-other")
    root = workdir / "svc"
    root.mkdir()
    os.chown(root, owner.pw_uid, owner.pw_gid)
    workdir.chmod(0o711)  # let the service user reach its directory
    state, data = root / "s", root / "d"

    def as_user(user: pwd.struct_passwd):
        def drop() -> None:
            os.setgid(user.pw_gid)
            os.setgroups([])
            os.setuid(user.pw_uid)

        return drop

    env = {"PATH": os.environ["PATH"], "HOME": str(root), "LANG": "C.UTF-8"}
    python = service_python
    cmd = [
        python,
        "-m",
        "hermes_sup.cli",
        "--state-dir",
        str(state),
        "serve",
        "--data-dir",
        str(data),
    ]
    proc = subprocess.Popen(
        cmd, preexec_fn=as_user(owner), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 20
        while not (state / "control.sock").exists():
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        ping = [python, "-m", "hermes_sup.cli", "--state-dir", str(state), "send", "alice", "pid"]
        ok = subprocess.run(
            ping, preexec_fn=as_user(owner), env=env, capture_output=True, text=True, timeout=30
        )
        assert ok.returncode == 0, ok.stderr
        session = next((data / "sessions").iterdir())
        for d in (state, data, session, session / "workspace", session / "home"):
            st = d.stat()
            assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == owner.pw_uid, d
        for f in (
            state / "hmac.key",
            state / "control.sock",
            state / "workers.sock",
            session / "worker.log",
            session / "session.json",
            session / "turns",
        ):
            st = f.stat()
            assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == owner.pw_uid, f
        # Another non-root user can neither read the key nor reach the socket.
        denied = subprocess.run(
            ping, preexec_fn=as_user(other), env=env, capture_output=True, text=True, timeout=30
        )
        assert denied.returncode == 1 and "permission denied" in denied.stderr
        probe = (
            "import socket, sys\n"
            "s = socket.socket(socket.AF_UNIX)\n"
            "try:\n s.connect(sys.argv[1])\nexcept PermissionError:\n sys.exit(13)\n"
        )
        reach = subprocess.run(
            [python, "-c", probe, str(state / "control.sock")],
            preexec_fn=as_user(other),
            env=env,
            timeout=30,
        )
        assert reach.returncode == 13
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_metrics_endpoint_is_scraped(supervisor_factory) -> None:
    import urllib.request

    from hermes_sup.protocol import Kind

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    sup = supervisor_factory("--metrics", str(port), "--spare-workers", "1")
    with sup.client() as client:
        deadline = time.monotonic() + 10
        while client.status()["spare_workers"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        client.run("m1", "pid")
        client.run("m2", "sleep 0.1")
        client.kill("m2")
        req = client.submit(Kind.SEND, {"text": "x"}, session="../bad")
        while client.next().re != req:
            pass
        deadline = time.monotonic() + 10  # the pool refills behind new sessions
        while client.status()["spare_workers"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    lines = set(text.splitlines())
    assert 'hermes_sup_sessions{state="idle"} 1.0' in lines
    assert 'hermes_sup_sessions{state="exited"} 1.0' in lines
    assert "hermes_sup_spawns_total 2.0" in lines
    assert 'hermes_sup_exits_total{reason="stopped"} 1.0' in lines
    assert 'hermes_sup_turns_total{outcome="reply"} 2.0' in lines
    assert "hermes_sup_turn_seconds_count 2.0" in lines
    assert "hermes_sup_routing_seconds_count 2.0" in lines
    assert any(x.startswith("hermes_sup_supervisor_open_fds ") for x in lines)
    assert any(x.startswith("hermes_sup_supervisor_rss_bytes ") for x in lines)
    assert "hermes_sup_spare_workers 1.0" in lines  # refilled after each new session
    # Bound to loopback only.
    assert f"metrics url=http://127.0.0.1:{port}/metrics" in sup.log()
