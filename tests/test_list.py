"""`list` with a real supervisor: each session is shown with the runtime it
runs (or would run) with, its own where it chose one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

RUNTIMES = str(Path(__file__).parent / "runtimes")
PRINTER = "hs_printer:make"


def test_a_session_opened_with_its_own_runtime_is_listed_with_it(supervisor_factory) -> None:
    env = dict(os.environ, PYTHONPATH=RUNTIMES)
    sup = supervisor_factory("--allow-runtime", PRINTER, env=env)
    with sup.client() as client:
        client.open("mine", runtime=PRINTER)
        assert client.run("mine", "print 2").text == "printed 2"  # it really runs there
        client.run("plain", "pid")
        rows = {r["key"]: r for r in client.sessions()}
        assert rows["mine"]["runtime"] == PRINTER
        assert rows["plain"]["runtime"] == "probe"
        client.kill("mine")
        stopped = next(r for r in client.sessions() if r["key"] == "mine")
        assert stopped["state"] == "exited" and stopped["runtime"] == PRINTER
    listed = subprocess.run(
        [sys.executable, "-m", "hermes_sup.cli", "--state-dir", str(sup.state_dir)]
        + ["list", "--json"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert listed.returncode == 0, listed.stderr
    by_key = {r["key"]: r["runtime"] for r in json.loads(listed.stdout)}
    assert by_key == {"mine": PRINTER, "plain": "probe"}
