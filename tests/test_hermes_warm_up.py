"""What the sealed zygote runs before the fork (worker/hermes_seal.py): a
model turn's streaming, warmed from a canned reply, leaves nothing a
session can see; and a sealed worker does not try to download Hermes's
pre-exec scanner (tirith) through a network it does not have."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hermes_sup.worker import hermes_seal

pytest.importorskip("run_agent", reason="hermes-agent is not installed")

# Preload under base/{home,workspace,user} as the zygote does; report the
# warm-ups, the threads and the files the preload left.
PRELOAD = r"""
import json, os, sys, threading
from pathlib import Path
from types import SimpleNamespace
from hermes_sup.worker import hermes_seal

base = Path(sys.argv[1])
paths = SimpleNamespace(home=base / "home", workspace=base / "workspace", user=base / "user")
for p in (paths.home, paths.workspace, paths.user):
    p.mkdir(parents=True)
done = hermes_seal.preload(paths)
print(json.dumps({
    "warm_ups": done.warm_ups,
    "threads": threading.active_count(),
    "workspace": sorted(p.name for p in paths.workspace.iterdir()),
    "user": sorted(p.name for p in paths.user.iterdir()),
    "env": sorted(k for k in os.environ if "WARM" in k.upper()),
}))
"""


def test_the_preload_streams_a_canned_turn_and_leaves_no_thread_file_or_env(
    tmp_path: Path,
) -> None:
    out = subprocess.run(
        [sys.executable, "-c", PRELOAD, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env={k: v for k, v in os.environ.items() if not k.startswith("HERMES_")},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["warm_ups"]["model_client"] == "warmed", seen["warm_ups"]
    assert seen["threads"] == 1
    assert seen["workspace"] == [] and seen["user"] == []
    assert seen["env"] == []


# Each session's first turn: what its shell sees of its home, workspace and
# environment (the warm-up's words, if anything of it were left).
LOOK = "run: ls -a $HERMES_HOME $PWD; env"


def test_two_sessions_first_turns_see_nothing_of_the_warm_up(
    supervisor_factory: Any, workdir: Path
) -> None:
    from .fake_model import FakeModel
    from .test_sealed_hermes import _sealed_supervisor, _tool_output, _turns

    model = FakeModel()
    try:
        sup = _sealed_supervisor(supervisor_factory, model, workdir, [])
        results = _turns(sup, {"first-a": LOOK, "first-b": LOOK})
    finally:
        model.close()
    for reply, events in results.values():
        assert reply.kind.name == "REPLY", reply.body
        out = _tool_output(events)
        assert "state.db" in out, out  # the listing is there: its own home
        assert "warm-up" not in out, out
    # The model heard each session's own messages only: no history of the
    # warm-up's turn (its user message, tool call or answer).
    for body in model.requests:
        text = json.dumps(body["messages"])
        assert "warm-up" not in text, text[:2000]
    assert len(model.requests) >= 4  # two turns of two calls each


def test_a_sealed_worker_does_not_try_to_download_tirith(
    supervisor_factory: Any, workdir: Path
) -> None:
    from hermes_sup.protocol import session_dir_name

    from .fake_model import FakeModel
    from .test_sealed_hermes import _sealed_supervisor, _tool_output, _turns

    if any((Path(d) / "tirith").exists() for d in os.environ.get("PATH", "").split(":")):
        pytest.skip("tirith is installed here: Hermes finds it and downloads nothing")
    model = FakeModel()
    try:
        sup = _sealed_supervisor(supervisor_factory, model, workdir, [])
        reply, events = _turns(sup, {"scan": "run: echo scanned; env"})["scan"]
        with sup.client() as client:
            log = "\n".join(client.logs("scan", 2000))
    finally:
        model.close()
    assert reply.kind.name == "REPLY", reply.body
    # Hermes tried (and failed: no network) to download it, and left a
    # marker in the home saying so, for a day.
    assert "tirith download" not in log.lower() and "tirith not found" not in log.lower(), log
    home = sup.data_dir / "sessions" / session_dir_name("scan") / "home"
    assert not (home / ".tirith-install-failed").exists()
    assert not (home / "bin" / "tirith").exists()
    out = _tool_output(events)
    assert "scanned" in out and "TIRITH_ENABLED=0" in out, out


def test_a_session_that_names_its_scanner_keeps_it(tmp_path: Path, monkeypatch: Any) -> None:
    """The setting is only ever a default: a session's own TIRITH_* wins."""
    monkeypatch.setenv("HERMES_HOME", str(tmp_path))
    monkeypatch.setenv("TIRITH_BIN", "/opt/scanner/tirith")
    monkeypatch.delenv("TIRITH_ENABLED", raising=False)
    hermes_seal._no_tirith_download()
    assert "TIRITH_ENABLED" not in os.environ


# _no_tirith_download for homes whose config.yaml says something of tirith
# (each its own HERMES_HOME); prints what it set, by case.
TIRITH_CASES = r"""
import json, os, sys
from pathlib import Path
from hermes_sup.worker import hermes_seal

base = Path(sys.argv[1])
cases = {
    "silent": "",
    "fail closed": "security:\n  tirith_fail_open: false\n",
    "own path": "security:\n  tirith_path: /opt/scanner/tirith\n",
    "installed in home": "",
}
seen = {}
for name, config in cases.items():
    home = base / name.replace(" ", "-")
    (home / "bin").mkdir(parents=True)
    (home / "config.yaml").write_text(config)
    if name == "installed in home":
        (home / "bin" / "tirith").write_text("#!/bin/sh\n")
        (home / "bin" / "tirith").chmod(0o755)
    os.environ["HERMES_HOME"] = str(home)
    os.environ.pop("TIRITH_ENABLED", None)
    hermes_seal._no_tirith_download()
    seen[name] = os.environ.get("TIRITH_ENABLED")
print(json.dumps(seen))
"""


def test_the_scanner_is_switched_off_only_where_hermes_would_download_it(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HERMES_", "TIRITH_"))}
    env["PATH"] = "/usr/bin:/bin"  # no tirith on it
    out = subprocess.run(
        [sys.executable, "-c", TIRITH_CASES, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {
        "silent": "0",
        "fail closed": None,
        "own path": None,
        "installed in home": None,
    }
