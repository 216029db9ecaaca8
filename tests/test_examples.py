"""The examples tell a person what they need instead of a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

APP = Path(__file__).parent.parent / "examples" / "web" / "app.py"


def test_the_web_example_run_without_the_client_says_how_to_run_it() -> None:
    # -S: no site-packages, so no hermes_sup, as under a system Python.
    done = subprocess.run([sys.executable, "-S", str(APP)], capture_output=True, text=True)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert ".venv/bin/python examples/web/app.py" in done.stderr
