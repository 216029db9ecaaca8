"""The examples: the web page is static files the HTTP endpoint serves (no
server code of its own), and a wrong --web directory gets a sentence, not
a traceback."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from hermes_sup.httpapi.keys import KeyStore

WEB = Path(__file__).parent.parent / "examples" / "web"


def test_the_web_example_is_static_files_only() -> None:
    assert sorted(p.name for p in WEB.iterdir()) == ["app.js", "index.html"]
    page = (WEB / "index.html").read_text()
    # Its one script is a file of its own: the endpoint's Content-Security-Policy
    # (script-src 'self') would refuse an inline one.
    assert re.findall(r"<script\b[^>]*>", page) == ['<script src="app.js" defer>']
    assert "/v1/runs" in (WEB / "app.js").read_text()


def test_http_web_needs_a_directory_with_a_page(tmp_path: Path) -> None:
    KeyStore(tmp_path / "data").generate("web")
    empty = tmp_path / "empty"
    empty.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "hermes_sup.cli", "--state-dir", str(tmp_path / "state"), "http",
         "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "data"), "--web", str(empty)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert "index.html" in done.stderr and str(empty) in done.stderr
