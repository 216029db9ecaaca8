"""A cron job made in a gateway chat runs on the agent config's model.

Hermes's cron scheduler builds its agent from the session's config.yaml
(`model.default`), not from the agent config the session's turns use: a
template home that names no model made every chat's cron job fail although
agent.toml named one. The Hermes runtime now writes the agent config's
model into the session's config.yaml when it starts (worker/hermes.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from hermes_sup.worker.hermes import GATE_URL, name_the_model_endpoint


def test_the_agent_configs_model_is_the_one_cron_reads(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("tts:\n  provider: openai\nmodel:\n  provider: custom\n")
    name_the_model_endpoint(config, {"model": "fake-model", "base_url": "http://127.0.0.1:9/v1"})
    data = yaml.safe_load(config.read_text())
    assert data["model"] == {"provider": "custom", "default": "fake-model"}
    assert data["tts"] == {"provider": "openai"}  # the rest of the template stays


def test_a_session_without_config_yaml_gets_one_naming_the_model(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    name_the_model_endpoint(config, {"model": "fake-model"})
    assert yaml.safe_load(config.read_text()) == {"model": {"default": "fake-model"}}


def test_behind_the_model_endpoint_cron_gets_the_endpoint_and_the_model(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("model:\n  default: template-model\n  api_key: sk-template\n")
    cfg = {"model": "fake-model", "base_url": GATE_URL + "/v1", "api_key": "placeholder"}
    name_the_model_endpoint(config, cfg)
    assert yaml.safe_load(config.read_text())["model"] == {
        "default": "fake-model",
        "api_key": "placeholder",
        "provider": "custom",
        "base_url": GATE_URL + "/v1",
    }


@pytest.mark.parametrize("cfg", [{}, {"model": ""}])
def test_an_agent_config_without_a_model_leaves_the_template_as_it_is(
    tmp_path: Path, cfg: dict
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("model:\n  default: template-model\n")
    name_the_model_endpoint(config, cfg)
    assert config.read_text() == "model:\n  default: template-model\n"
