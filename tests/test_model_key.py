"""The model key never enters a sealed worker (supervisor/model_gate.py):
real supervisors with the real Hermes runtime, `--sealed on`, as root; the
worker's environment and every readable byte of its memory are searched
for the operator's key from outside, as root."""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path
from typing import Any

import pytest

from .conftest import needs_hermes
from .test_sealed_hermes import _memory_mentions, _sealed_supervisor

pytestmark = needs_hermes

KEY_ENV = "HERMES_SUP_TEST_MODEL_KEY"


def _keyed_supervisor(
    supervisor_factory: Any,
    model: Any,
    workdir: Path,
    monkeypatch: pytest.MonkeyPatch,
    as_user: bool = False,
) -> tuple[Any, str]:
    """A sealed Hermes supervisor whose agent config names a key (by env
    variable, as an operator does): the key, made for this test."""
    if os.geteuid() != 0:
        pytest.skip("reading another uid's worker memory needs root")
    key = f"sk-test-{os.getpid()}-{workdir.name}-operator"
    monkeypatch.setenv(KEY_ENV, key)
    config = workdir / "keyed.toml"
    config.write_text(
        f'model = "fake-model"\nbase_url = "{model.url}"\nprovider = "custom"\n'
        f'toolsets = ["terminal"]\napi_key_env = "{KEY_ENV}"\n'
    )
    sup = _sealed_supervisor(
        supervisor_factory,
        model,
        workdir,
        # The later --agent-config wins: this one names the key.
        ["--spare-workers", "0", "--agent-config", str(config)],
        as_user=as_user,
    )
    return sup, key


def _worker_pid(sup: Any, session: str) -> int:
    """The session's worker once it has said hello (its config is in)."""
    deadline = time.monotonic() + 120
    with sup.client(timeout=60) as client:
        while time.monotonic() < deadline:
            rows = client.sessions(prefix=session)
            if rows and rows[0]["pid"] and rows[0]["state"] == "idle":
                return int(rows[0]["pid"])
            time.sleep(0.1)
    raise AssertionError(f"session {session} never had an idle worker")


@pytest.mark.e2e
@pytest.mark.parametrize("as_user", [False, True], ids=["root", "unprivileged"])
def test_a_sealed_workers_environment_and_memory_hold_no_model_key(
    supervisor_factory: Any, workdir: Path, monkeypatch: pytest.MonkeyPatch, as_user: bool
) -> None:
    from .fake_model import FakeModel

    model = FakeModel()
    try:
        sup, key = _keyed_supervisor(supervisor_factory, model, workdir, monkeypatch, as_user)
        session = f"mk-{workdir.name}"
        with sup.client(timeout=120) as client:
            client.open(session)
        pid = _worker_pid(sup, session)
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        assert key.encode() not in environ
        assert KEY_ENV.encode() not in environ
        # The scan sees what the worker holds (its own session key), and
        # nothing of the operator's key, whole or as its distinctive tail.
        found = _memory_mentions(pid, [session.encode(), key.encode(), key[3:].encode()])
        assert found == {session.encode()}
    finally:
        model.close()


@pytest.mark.e2e
@pytest.mark.skipif(
    importlib.util.find_spec("hermes_sup.supervisor.egress") is None,
    reason="the session proxy (supervisor/egress.py) is not in this build",
)
def test_a_real_hermes_turn_reaches_the_model_through_the_supervisor_with_its_key(
    supervisor_factory: Any, workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from .fake_model import FakeModel

    model = FakeModel()
    try:
        sup, key = _keyed_supervisor(supervisor_factory, model, workdir, monkeypatch)
        session = f"mt-{workdir.name}"
        with sup.client(timeout=180) as client:
            reply = client.run(session, "hello through the gate")
            assert "echo: hello through the gate" in reply.text
            info = client.inspect(session)
        # The model saw the operator's key, sent by the supervisor; the
        # worker never had it.
        assert model.auth and set(model.auth) == {f"Bearer {key}"}
        assert info["model"]["requests"] >= 1
        assert info["model"]["input_tokens"] >= 0
        pid = _worker_pid(sup, session)
        assert _memory_mentions(pid, [key.encode()]) == set()
    finally:
        model.close()
