"""The Node.js client in examples/node, written from PROTOCOL.md alone, against
a real supervisor: locally over ipc and remotely over CURVE TCP."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_clients import free_port

NODE_DIR = Path(__file__).resolve().parent.parent / "examples" / "node"

pytestmark = pytest.mark.skipif(
    shutil.which("node") is None and not os.environ.get("HSUP_REQUIRE_ALL"),
    reason="Node.js is not installed",
)


def chat(*args: str) -> subprocess.CompletedProcess[str]:
    assert (NODE_DIR / "node_modules" / "zeromq").is_dir(), (
        "run `npm ci --prefix examples/node` (make test does)"
    )
    return subprocess.run(
        ["node", str(NODE_DIR / "chat.js"), *args], capture_output=True, text=True, timeout=60
    )


def test_node_client_streams_a_turn_and_answers_an_approval(supervisor) -> None:
    state = str(supervisor.state_dir)
    streamed = chat("--state-dir", state, "node-1", "stream hello from node")
    assert streamed.returncode == 0, streamed.stderr
    lines = streamed.stdout.splitlines()
    assert lines[0].startswith("connected to hermes-sup ")
    assert '"state":"running"' in streamed.stdout
    assert "hello from node" in lines and lines[-1] == "reply: hello from node"

    asked = chat("--state-dir", state, "node-2", "ask echo allowed", "--approve", "once")
    assert asked.returncode == 0, asked.stderr
    assert "approval requested: echo allowed" in asked.stdout
    assert "output: allowed" in asked.stdout and asked.stdout.endswith("reply: exit 0\n")

    # Without --approve the example denies at once (no wait for the timeout).
    denied = chat("--state-dir", state, "node-2", "ask echo refused")
    assert denied.returncode == 0, denied.stderr
    assert "denied (no --approve given" in denied.stdout
    assert "output: refused" not in denied.stdout and "reply: denied" in denied.stdout

    env = chat("--state-dir", state, "node-3", "env HERMES_SESSION_CHAT_ID", "--env", "chat_id=77")
    assert env.stdout.endswith("reply: 77\n"), env.stdout

    bad = chat("--state-dir", state, "../etc", "pid")
    assert bad.returncode == 1 and "[bad_session_key]" in bad.stderr
    # What the Node client did, a Python client sees: one session each, isolated.
    with supervisor.client() as client:
        keys = {row["key"] for row in client.sessions()}
    assert keys == {"node-1", "node-2", "node-3"}


def test_node_client_over_curve_tcp(supervisor_factory, workdir) -> None:
    port = free_port()
    sup = supervisor_factory("--tcp", str(port))
    conn = workdir / "node.json"
    made = subprocess.run(
        [sys.executable, "-m", "hermes_sup.cli", "keys", "generate", "node",
         "--endpoint", f"127.0.0.1:{port}", "-o", str(conn)],
        capture_output=True, text=True, timeout=30,
        env={**os.environ, "HERMES_SUP_DATA_DIR": str(sup.data_dir)},
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    result = chat("--connection", str(conn), "remote-node", "sh echo over curve")
    assert result.returncode == 0, result.stderr
    assert "output: over curve" in result.stdout and result.stdout.endswith("reply: exit 0\n")
    conn.chmod(0o644)
    loose = chat("--connection", str(conn), "remote-node", "pid")
    assert loose.returncode == 1 and "readable by others" in loose.stderr
