"""`make run` installs only when something changed, and says so when it does.

Checked with `make -n` (what make would run) in a copy of the Makefile
beside stand-ins for what it depends on, their times set by hand: no
install runs, nothing waits.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """The Makefile, pyproject.toml, the package folders and a venv's python."""
    shutil.copy(REPO / "Makefile", tmp_path / "Makefile")
    (tmp_path / "pyproject.toml").write_text("")
    dirs = re.search(r"^PACKAGE_DIRS := (.*)$", (REPO / "Makefile").read_text(), re.M)
    assert dirs is not None
    for name in dirs.group(1).split():
        (tmp_path / name).mkdir()
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").touch()
    for path in tmp_path.rglob("*"):
        os.utime(path, (1_000_000, 1_000_000))  # everything long ago
    return tmp_path


def would_run(tree: Path, target: str) -> str:
    # Under `make test` (as in CI) the outer make's variables would make this
    # one a sub-make, which prints "Entering directory" lines.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    done = subprocess.run(
        ["make", "--no-print-directory", "-n", target],
        cwd=tree, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_make_run_installs_once_then_only_after_a_change(tree: Path) -> None:
    first = would_run(tree, "run")
    assert "pip install" in first and "installing hermes-sup into .venv" in first
    stamp = tree / ".venv" / ".installed-run"
    stamp.touch()
    os.utime(stamp, (2_000_000, 2_000_000))  # installed after everything
    assert would_run(tree, "run").splitlines() == [".venv/bin/hermes-sup serve"]
    os.utime(tree / "pyproject.toml", (3_000_000, 3_000_000))  # changed since
    assert "pip install -q -e ." in would_run(tree, "run")
    os.utime(tree / "pyproject.toml", (1_000_000, 1_000_000))
    os.utime(tree / "cli", (3_000_000, 3_000_000))  # a module added or removed
    assert "pip install -q -e ." in would_run(tree, "run")


def test_make_test_says_what_each_install_step_does(tree: Path) -> None:
    said = would_run(tree, "test")
    for words in (
        "installing hermes-sup with its test tools and checkers",
        "checking the browser and Node.js test tools",
        "wheel_smoke.py",
    ):
        assert words in said, words
