"""The wheel as a user gets it: built from the tracked files, installed into
a fresh virtual environment outside the checkout, and used there.

    python .ci/wheel_smoke.py [--keep]

What the editable install in the checkout cannot show: that the wheel holds
every file the code reads at run time (the sealed preload's module list),
that the installed package runs with none of the checkout on its path, that
its man pages (written while the wheel was built) are where `man` finds
them, and that the base install (no extras) serves, sends and makes keys. Each step
says what it does and how long it took; any failure exits non-zero with
the output that shows why. `make wheel-smoke` runs it (and `make test`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# How long the supervisor may take to answer a ping after it starts (a
# loaded 2-core machine starts it in seconds; this is a deadline, not a wait).
READY_WITHIN = 120.0


class SmokeFailed(Exception):
    """A step did not do what it should; the message says what happened."""


def step(what: str) -> float:
    """Say what is being done now; the start time, for `done`."""
    print(f"wheel-smoke: {what}...", flush=True)
    return time.monotonic()


def done(started: float) -> None:
    print(f"wheel-smoke:   done in {time.monotonic() - started:.1f}s", flush=True)


def run(argv: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> str:
    """Run a command; its stdout, or SmokeFailed with all it printed."""
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SmokeFailed(
            f"{' '.join(argv)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        )
    return proc.stdout


def tracked_copy(dest: Path) -> None:
    """The files git tracks (as they are in the work tree): a build from
    them cannot pick up a stale build/ or an untracked file."""
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = REPO / name
        if source.is_file():
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def check_man_pages(venv: Path, env: dict[str, str]) -> None:
    """A page for every command under the venv's share/man/man1; where this
    host has man, `man hermes-sup` finds it with the venv active (man looks
    beside each PATH entry) and `man -l` shows the command's own help."""
    man1 = venv / "share" / "man" / "man1"
    pages = sorted(page.name for page in man1.glob("hermes-sup*.1"))
    for name in ("hermes-sup.1", "hermes-sup-serve.1", "hermes-sup-send.1"):
        if name not in pages:
            raise SmokeFailed(f"no {name} in {man1}: {pages}")
    if shutil.which("man") is None:
        print("wheel-smoke:   no man on this host: the pages' content is not read", flush=True)
        return
    active = {k: v for k, v in env.items() if k != "MANPATH"}
    active["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    found = run(["man", "-w", "hermes-sup"], cwd=venv, env=active).strip()
    if found != str(man1 / "hermes-sup.1"):
        raise SmokeFailed(f"man -w hermes-sup found {found!r}, not the venv's page")
    shown = run(
        ["man", "-l", str(man1 / "hermes-sup-send.1")],
        cwd=venv, env={**env, "LC_ALL": "C", "MANWIDTH": "100"},
    )  # fmt: skip
    if "hermes-sup send [OPTIONS] SESSION TEXT" not in shown or "--turn-id" not in shown:
        raise SmokeFailed(f"man -l hermes-sup-send.1 showed:\n{shown}")
    print(f"wheel-smoke:   {len(pages)} pages in {man1}", flush=True)


def check_completions(venv: Path, env: dict[str, str]) -> None:
    """The completion scripts the wheel installed, where each shell's loader
    looks, the same as `hermes-sup completion SHELL` prints."""
    share = venv / "share"
    for shell, path in {
        "bash": share / "bash-completion" / "completions" / "hermes-sup",
        "zsh": share / "zsh" / "site-functions" / "_hermes-sup",
        "fish": share / "fish" / "vendor_completions.d" / "hermes-sup.fish",
    }.items():
        printed = run([str(venv / "bin" / "hermes-sup"), "completion", shell], cwd=venv, env=env)
        if not path.is_file() or path.read_text() != printed:
            raise SmokeFailed(
                f"{path}: missing, or not what `hermes-sup completion {shell}` prints"
            )
    print(f"wheel-smoke:   completion scripts for bash, zsh and fish under {share}", flush=True)


def smoke(work: Path) -> None:
    """Build, install and use the wheel under `work` (outside the checkout)."""
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HERMES_SUP_"))}
    env["HOME"] = str(work / "home")
    (work / "home").mkdir()

    started = step("building the wheel from the tracked files")
    source = work / "src"
    tracked_copy(source)
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(work / "dist"), "."],
        cwd=source, env=env)  # fmt: skip
    (wheel,) = (work / "dist").glob("hermes_sup-*.whl")
    shutil.rmtree(source)  # nothing of the source is left to import from
    done(started)

    started = step(f"installing {wheel.name} into a fresh venv (base dependencies only)")
    venv = work / "venv"
    run([sys.executable, "-m", "venv", str(venv)], cwd=work, env=env)
    python, cli = str(venv / "bin" / "python"), str(venv / "bin" / "hermes-sup")
    run([python, "-m", "pip", "install", "-q", str(wheel)], cwd=work, env=env)
    done(started)

    started = step("checking what the installed package finds")
    shown = run([cli, "--version"], cwd=work, env=env).strip()
    if shown != f"hermes-sup, version {version}":
        raise SmokeFailed(f"--version said {shown!r}, not version {version}")
    found = run(
        [python, "-c",
         "import hermes_sup.cli as c, hermes_sup.worker.hermes_seal as s; "
         "print(c.__file__); print(s.MODULES_FILE); print(len(s.recorded_modules()))"],
        cwd=work, env=env,
    ).split()  # fmt: skip
    package, modules_file, count = found[0], found[1], int(found[2])
    if not package.startswith(str(venv)):
        raise SmokeFailed(f"hermes_sup was imported from {package}, not the fresh venv")
    # The sealed Hermes preload reads this list; without it, it silently
    # preloads only the base modules.
    if not modules_file.startswith(str(venv)) or count < 100:
        raise SmokeFailed(f"the sealed preload's module list: {modules_file}, {count} names")
    data = work / "data"
    key = run([cli, "keys", "http", "generate", "web", "--data-dir", str(data)], cwd=work, env=env)
    if not key.startswith("hsk-"):  # no starlette here: a key needs none
        raise SmokeFailed(f"keys http generate printed {key!r}")
    done(started)

    started = step("reading the man pages the wheel installed")
    check_man_pages(venv, env)
    check_completions(venv, env)
    done(started)

    started = step("serving, and sending turns to the probe runtime")
    state = work / "state"
    client = [cli, "--state-dir", str(state)]
    log = (work / "serve.log").open("w")
    server = subprocess.Popen(
        [*client, "serve", "--data-dir", str(data), "--spare-workers", "0"],
        cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + READY_WITHIN
        while subprocess.run([*client, "ping"], cwd=work, env=env, capture_output=True).returncode:
            if server.poll() is not None or time.monotonic() > deadline:
                raise SmokeFailed(
                    "serve did not answer a ping:\n" + (work / "serve.log").read_text()
                )
            time.sleep(0.2)
        said = run([*client, "send", "smoke", "sh echo from-the-wheel"], cwd=work, env=env)
        if "from-the-wheel" not in said:
            raise SmokeFailed(f"send printed {said!r}")
        status = run([*client, "status"], cwd=work, env=env)
        run([*client, "shutdown"], cwd=work, env=env)
        if server.wait(timeout=60) != 0:
            raise SmokeFailed("serve exited non-zero:\n" + (work / "serve.log").read_text())
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()
    for line in status.splitlines():
        if line.startswith(("hermes-sup ", "sealing:", "WARNING:")):
            print("wheel-smoke:   " + line, flush=True)
    done(started)


def main() -> None:
    """Run the smoke test in a temporary directory (kept with --keep)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", action="store_true", help="keep the directory it worked in")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hermes-sup-wheel-")).resolve()
    if work.is_relative_to(REPO):
        sys.exit(f"wheel-smoke: {work} is inside the checkout; set TMPDIR elsewhere")
    started = time.monotonic()
    try:
        smoke(work)
    except (SmokeFailed, subprocess.TimeoutExpired) as exc:
        sys.exit(f"wheel-smoke: FAILED: {exc}\n(kept {work})")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    print(f"wheel-smoke: ok in {time.monotonic() - started:.0f}s", flush=True)


if __name__ == "__main__":
    main()
