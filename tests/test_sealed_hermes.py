"""Hermes in sealed mode (worker/hermes_seal.py): preloaded in the zygote
under fixed paths, replayed in each worker for its own session's files.

The replay tests need no namespaces: a subprocess preloads hermes under
P, then P's contents are swapped for a session's (as the worker's bind
mount swaps them) and the replay must find the session's files, not what
the import saw."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hermes_sup.worker import hermes_seal

pytest.importorskip("run_agent", reason="hermes-agent is not installed")

# Preload under base/{home,workspace,user}; swap home for the session's
# (a .env, a config.yaml); set the worker's own environment; replay (unless
# told not to); report what hermes now sees.
SWAP_AND_REPLAY = r"""
import json, os, sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from hermes_sup.worker import hermes_seal

base, do_replay = Path(sys.argv[1]), sys.argv[2] == "replay"
paths = SimpleNamespace(home=base / "home", workspace=base / "workspace", user=base / "user")
for p in (paths.home, paths.workspace, paths.user):
    p.mkdir(parents=True)
os.environ.update(HERMES_HOME=str(paths.home), TERMINAL_CWD=str(paths.workspace),
                  HOME=str(paths.user), HERMES_YOLO_MODE="1", HERMES_REDACT_SECRETS="false")
os.chdir(paths.workspace)
done = hermes_seal.preload(paths)
from hermes_cli import config
config.load_config()  # the zygote's (empty) config, memoized under P's path

# The "bind mount": the session's own home now at P.
paths.home.rename(base / "zygote-home")
paths.home.mkdir()
(paths.home / ".env").write_text("SEALED_MARK=session-value\n")
(paths.home / "config.yaml").write_text("terminal:\n  timeout: 77\nmodel:\n  context_length: 4242\n")
session_env = {"PATH": os.environ["PATH"], "HERMES_HOME": str(paths.home),
               "TERMINAL_CWD": str(paths.workspace), "HOME": str(paths.user),
               "HERMES_SESSION_KEY": "k1"}
os.environ.clear()
os.environ.update(session_env)
if do_replay:
    hermes_seal.replay(paths)
from tools import approval, file_operations
from agent import redact
print(json.dumps({
    "env": {k: os.environ.get(k) for k in ("SEALED_MARK", "TERMINAL_TIMEOUT", "HERMES_QUIET",
                                           "HERMES_EXEC_ASK", "_HERMES_GATEWAY",
                                           "HERMES_SKIP_SSL_GUARD")},
    "home": sorted(p.name for p in paths.home.iterdir()),
    "zygote_home": sorted(p.name for p in (base / "zygote-home").iterdir()),
    "context_length": config.load_config().get("model", {}).get("context_length"),
    "denied": sorted(file_operations.WRITE_DENIED_PATHS),
    "missing": sorted(done.missing),
    "threads": __import__("threading").active_count(),
    "yolo": approval._YOLO_MODE_FROZEN,
    "redact": redact._REDACT_ENABLED,
}))
"""


def swap_and_replay(base: Path, mode: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", SWAP_AND_REPLAY, str(base), mode],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if not k.startswith(("HERMES_", "TERMINAL_"))},
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def replayed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return swap_and_replay(tmp_path_factory.mktemp("sealed") / "b", "replay")


def test_replay_loads_the_sessions_env_and_config_not_the_zygotes(replayed: dict[str, Any]) -> None:
    env = replayed["env"]
    assert env["SEALED_MARK"] == "session-value"  # the session's .env
    assert env["TERMINAL_TIMEOUT"] == "77"  # its config.yaml, bridged as gateway.run does
    assert replayed["context_length"] == 4242  # load_config reads the session's file
    # What the import set in the zygote's environment is set again.
    assert env["HERMES_QUIET"] == env["HERMES_EXEC_ASK"] == env["_HERMES_GATEWAY"] == "1"
    # The CA bundle was checked in the zygote for a session that names none.
    assert env["HERMES_SKIP_SSL_GUARD"] == "1"
    assert replayed["threads"] == 1


def test_replay_recomputes_what_the_import_froze_from_the_zygotes_env(
    replayed: dict[str, Any],
) -> None:
    """The zygote ran with HERMES_YOLO_MODE=1 and redaction off; the session
    has neither, so its approvals are on and its secrets redacted."""
    assert replayed["yolo"] is False
    assert replayed["redact"] is True


def test_replay_makes_the_sessions_home_skeleton(replayed: dict[str, Any]) -> None:
    for name in ("SOUL.md", "memories", "skills", "cron", "logs", "sessions"):
        assert name in replayed["home"], name
    # The zygote's own home holds only what its import made.
    assert ".env" not in replayed["zygote_home"]


def test_replay_leaves_the_write_deny_list_whole(replayed: dict[str, Any], tmp_path: Path) -> None:
    """A generic 'clear what is keyed by P' would empty it."""
    denied = replayed["denied"]
    assert any(p.endswith("/home/.env") for p in denied), denied


def test_without_replay_the_session_would_get_the_zygotes_view(tmp_path: Path) -> None:
    """The control: the same swap with no replay leaves the session's files
    unread, so the tests above do test the replay."""
    seen = swap_and_replay(tmp_path / "b", "none")
    assert seen["env"]["SEALED_MARK"] is None
    assert seen["env"]["HERMES_QUIET"] is None
    assert "SOUL.md" not in seen["home"]  # _HERMES_HOME_ENSURED said P was done
    assert seen["yolo"] is True and seen["redact"] is False


def test_preload_refuses_a_home_with_files_and_hermes_imported_before(tmp_path: Path) -> None:
    paths = SimpleNamespace(home=tmp_path / "h", workspace=tmp_path / "w", user=tmp_path / "u")
    for p in (paths.home, paths.workspace, paths.user):
        p.mkdir()
    (paths.home / ".env").write_text("OPENAI_API_KEY=zygote\n")
    with pytest.raises(hermes_seal.SealError, match="every session"):
        hermes_seal.preload(paths)
    (paths.home / ".env").unlink()
    # This test process imported hermes (importorskip above), not under P.
    with pytest.raises(hermes_seal.SealError, match="imported before the sealed preload"):
        hermes_seal.preload(paths)


def test_the_recorded_module_list_is_there_and_names_hermes() -> None:
    names = hermes_seal.recorded_modules()
    assert len(names) > 500
    assert {"run_agent", "model_tools", "tools.terminal_tool"} <= set(names)
    assert not [n for n in names if n.split(".")[0] in ("hermes_sup", "tests", "__main__")]
