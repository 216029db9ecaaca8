"""Which variables decide the agent's approvals is the operator's policy, not
a front end's; and hermes-agent's own modules are never preloaded."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hermes_sup.client import SupervisorError
from hermes_sup.protocol import RemoteProtocolError
from hermes_sup.supervisor import configfile
from hermes_sup.supervisor.config import Settings
from hermes_sup.supervisor.environment import check_policy, parse_options


@pytest.mark.parametrize(
    "env",
    [{"HERMES_YOLO_MODE": "1"}, {"HERMES_EXEC_ASK": "0", "HERMES_GATEWAY_SESSION": "0"}],
)
def test_a_front_end_cannot_switch_approvals_off(env) -> None:
    options = parse_options({"env": env})
    with pytest.raises(RemoteProtocolError) as err:
        check_policy(options, (), ("probe",))
    assert err.value.code.value == "bad_field"
    assert all(name in err.value.message for name in env)
    check_policy(options, (), ("probe",), allow_env=tuple(env))  # the operator allows it
    check_policy(parse_options({"env": {"COLOR": "blue"}}), (), ("probe",))


def test_the_supervisor_refuses_them_and_serves_on(supervisor_factory) -> None:
    sup = supervisor_factory("--allow-env", "HERMES_EXEC_ASK")
    with sup.client() as client:
        with pytest.raises(SupervisorError) as err:
            client.open("yolo", options={"env": {"HERMES_YOLO_MODE": "1"}})
        assert err.value.code == "bad_field" and "HERMES_YOLO_MODE" in err.value.message
        client.open("asks", options={"env": {"HERMES_EXEC_ASK": "1"}})
        assert client.run("asks", "env HERMES_EXEC_ASK").text == "1"
        assert client.run("yolo", "env HERMES_YOLO_MODE").text == ""


@pytest.mark.slow  # imports Hermes here, and starts serve
def test_hermes_agents_own_modules_are_not_preloaded(tmp_path: Path) -> None:
    pytest.importorskip("run_agent", reason="hermes-agent is not installed")
    base = Settings(state_dir=tmp_path / "s", data_dir=tmp_path / "d")
    for module in ("run_agent", "tools.approval", "hermes_state"):
        with pytest.raises(configfile.ConfigError, match="belong to hermes-agent"):
            configfile.build(base, None, {"preload": (module,), "sealed": "off"})
        # Sealed (auto, the default), each session finds its own paths there.
        assert configfile.build(base, None, {"preload": (module,)}).preload == (module,)
    assert configfile.build(base, None, {"preload": ("json", "yaml")}).preload == ("json", "yaml")
    cli = [sys.executable, "-m", "hermes_sup.cli", "--state-dir", str(tmp_path / "s")]
    refused = subprocess.run(
        [*cli, "serve", "--data-dir", str(tmp_path / "d"), "--preload", "run_agent"]
        + ["--sealed", "off"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode != 0 and "belong to hermes-agent" in refused.stderr
    assert "Traceback" not in refused.stderr
