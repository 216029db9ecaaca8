"""What the endpoint's clients do with it, done as they do it: the openai
SDK's strict `responses.stream()` helper, hermes-webui's Stop on its chat
backend, a health check asking which Hermes runs, and a person running a
command in a session over HTTP (the probe's `sh`, whose output lines are
the answer). A real supervisor (probe runtime) and endpoint over real HTTP
on 127.0.0.1."""

from __future__ import annotations

import json

import httpx
import pytest

from tests import test_http

endpoint = test_http.endpoint
endpoint_factory = test_http.endpoint_factory


def test_health_says_which_hermes_the_workers_run(endpoint) -> None:
    from hermes_sup.local.version import version

    pytest.importorskip("run_agent", reason="needs hermes-agent (the hermes extra)")
    from importlib.metadata import version as installed

    health = httpx.get(endpoint.url + "/health").json()
    assert health["status"] == "ok" and health["platform"] == "hermes-agent"
    assert health["hermes_agent"] == health["version"] == installed("hermes-agent")
    assert health["hermes_sup"] == version() and health["runtime"] == "probe"
    assert httpx.get(endpoint.url + "/v1/health").json() == health
    assert json.loads(json.dumps(health)) == health
