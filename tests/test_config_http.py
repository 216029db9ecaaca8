"""Hermes behind HTTP from the configuration file: `serve --config FILE`
with `http` set runs the endpoint as `serve --http` does, with the file's
[http_api] settings (test_http.py's `endpoint_factory` is the same with
the flag)."""

from __future__ import annotations

from pathlib import Path

import httpx

from hermes_sup.httpapi.keys import KeyStore
from tests.test_http import wait_ready


def test_serve_with_http_in_the_file_serves_the_api(supervisor_factory, workdir: Path) -> None:
    config = workdir / "config.toml"
    config.write_text(
        'http = "127.0.0.1:0"\n'
        "\n"
        "[http_api]\n"
        'model = "from-the-file"\n'
        'cors_origins = ["https://chat.example.com"]\n'
    )
    sup = supervisor_factory("--config", str(config), start=False)
    key = KeyStore(sup.data_dir).generate("test")
    sup.start()
    url = wait_ready(sup.log_path, None)
    headers = {"Authorization": f"Bearer {key}"}
    models = httpx.get(url + "/v1/models", headers=headers, timeout=30)
    assert models.status_code == 200
    assert [m["id"] for m in models.json()["data"]] == ["from-the-file"]
    # The allowed origin is the file's, not the environment's.
    allowed = httpx.get(
        url + "/v1/models",
        headers={**headers, "Origin": "https://chat.example.com"},
        timeout=30,
    )
    refused = httpx.get(
        url + "/v1/models", headers={**headers, "Origin": "https://evil.example"}, timeout=30
    )
    assert allowed.status_code == 200 and refused.status_code == 403
    answer = httpx.post(
        url + "/v1/chat/completions",
        json={"model": "from-the-file", "messages": [{"role": "user", "content": "hello"}]},
        headers={**headers, "X-Hermes-Session-Id": "from-file"},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == "hello"
