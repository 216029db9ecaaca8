"""The client commands against a remote supervisor through a connection file
(`--connection FILE`, before or after the command's name): attach, list,
send; shutdown stays local (issue 18, "attach --connection FILE")."""

from __future__ import annotations

import os
import subprocess
import sys

import pexpect
import pytest

from .test_clients import free_port


def hs(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hermes_sup.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "NO_COLOR": "1", **(env or {})},
    )


@pytest.fixture
def remote(supervisor_factory, workdir):
    port = free_port()
    sup = supervisor_factory("--tcp", str(port))
    conn = workdir / "ops.json"
    made = hs("keys", "generate", "ops", "--endpoint", f"127.0.0.1:{port}", "-o", str(conn),
              "--data-dir", str(sup.data_dir))  # fmt: skip
    assert made.returncode == 0, made.stderr
    return sup, conn


def test_attach_list_and_send_through_a_connection_file(remote, workdir) -> None:
    sup, conn = remote
    # No local state directory at all: only the connection file.
    nowhere = {"HERMES_SUP_STATE_DIR": str(workdir / "no-such-state")}
    sent = hs("send", "far:1", "env HERMES_SESSION_KEY", "--connection", str(conn), env=nowhere)
    assert sent.returncode == 0, sent.stderr
    assert sent.stdout.strip() == "far:1"
    listed = hs("--connection", str(conn), "list", "-q", env=nowhere)
    assert listed.stdout.split() == ["far:1"]
    child = pexpect.spawn(
        sys.executable,
        ["-m", "hermes_sup.cli", "attach", "far:1", "--connection", str(conn)],
        encoding="utf-8",
        timeout=30,
        env={**os.environ, "NO_COLOR": "1", **nowhere},
    )
    try:
        child.expect("attached to far:1")
        child.sendline("stream over the network")
        child.expect("over the network")
        child.expect(r"◂ \(end of reply\)")
        child.sendeof()
        child.expect("detached")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    refused = hs("shutdown", "--connection", str(conn), env=nowhere)
    assert refused.returncode == 1
    assert "shutdown is not accepted from remote front ends" in refused.stderr
    assert sup.proc.poll() is None
    loose = workdir / "loose.json"
    loose.write_text(conn.read_text())
    loose.chmod(0o644)
    bad = hs("list", "--connection", str(loose), env=nowhere)
    assert bad.returncode == 1 and "chmod 600" in bad.stderr and "Traceback" not in bad.stderr
