"""Hermes sessions sealed and preloaded against import-after-fork, in one run.

    python bench/sealed.py                   # both modes, numbers to bench/results/sealed.json
    python bench/sealed.py --record-modules  # rewrite worker/hermes_modules.txt

Measured from outside, as a front end sees it (the Hermes runtime logs no
timestamps of its own): *ready* is `open` of a new key until the session
is idle (its worker forked, sealed, hermes loaded and its runtime built);
*first reply* is a new key's first `send` until its reply, from a fake
model on 127.0.0.1 that answers at once; *USS* is the idle worker's own
memory one second after that turn (psutil). Both modes run side by side,
the unsealed one being the floor this machine gives today.

`--record-modules` runs one real Hermes turn (a terminal tool call) in a
worker whose runtime, `recording_hermes` below, writes the worker's module
list after the turn: that list is what sealed mode preloads.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MODULES_FILE = REPO / "worker" / "hermes_modules.txt"
RECORD_ENV = "HSB_RECORD_MODULES"
# Modules never to preload: ours (the zygote has what it needs), this file,
# and the interpreter's entry point.
NOT_PRELOADED = ("hermes_sup", "sealed", "__main__", "__mp_main__", "tests", "run")


def recording_hermes(session: Any) -> Any:
    """A Hermes runtime (`--agent sealed:recording_hermes`, with bench/ on
    PYTHONPATH) that writes the worker's loaded modules to $HSB_RECORD_MODULES
    after each turn."""
    from hermes_sup.worker.hermes import HermesRuntime

    class Recording(HermesRuntime):  # type: ignore[misc]
        def run_turn(self, text: str, emit: Any, context: Any = None) -> Any:
            try:
                return super().run_turn(text, emit, context)
            finally:
                Path(os.environ[RECORD_ENV]).write_text("\n".join(sorted(sys.modules)) + "\n")

    return Recording(session)


def keep_module(name: str) -> bool:
    """Whether a recorded module is one to preload."""
    return name.split(".")[0] not in NOT_PRELOADED


def _agent_config(root: Path, model_url: str) -> Path:
    """An agent config for the fake model, with a template home whose
    config.yaml names the context length (no probing of the model)."""
    template = root / "template"
    template.mkdir(parents=True, exist_ok=True)
    (template / "config.yaml").write_text("model:\n  context_length: 131072\n")
    config = root / "agent.toml"
    config.write_text(
        f'model = "fake-model"\nbase_url = "{model_url}"\nprovider = "custom"\n'
        f'toolsets = ["terminal"]\ntemplate_home = "{template}"\n'
    )
    return config


def record_modules() -> int:
    """One real Hermes turn with a terminal tool call in a worker; its
    module list (less ours) becomes worker/hermes_modules.txt."""
    import tempfile

    sys.path[:0] = [str(REPO), str(HERE)]
    from run import Sup  # bench/run.py

    from tests.fake_model import FakeModel

    model = FakeModel()
    scratch = Path(tempfile.mkdtemp(prefix="hsb-rec-", dir="/var/tmp"))
    out = scratch / "modules.txt"
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    sup = Sup(
        "--agent",
        "sealed:recording_hermes",
        "--agent-config",
        str(_agent_config(scratch, model.url)),
        "--env",
        f"{RECORD_ENV}={out}",
    )
    try:
        with sup.client() as c:
            reply = c.run("rec", "run: echo sealed > f.txt; cat f.txt; ls")
            if not reply.ok or not out.exists():
                print(f"the recording turn failed: {reply}", file=sys.stderr)
                return 1
    finally:
        sup.close()
        model.close()
    names = [n for n in out.read_text().split() if keep_module(n)]
    MODULES_FILE.write_text(
        "# Modules a Hermes worker had loaded after its first turn (a terminal tool call),\n"
        "# recorded by `python bench/sealed.py --record-modules`; sealed mode's zygote\n"
        "# imports them (worker/hermes_seal.py). One name a line.\n" + "\n".join(names) + "\n"
    )
    print(f"{len(names)} modules written to {MODULES_FILE}")
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--record-modules", action="store_true")
    args = parser.parse_args(argv)
    if args.record_modules:
        return record_modules()
    return 0


if __name__ == "__main__":
    sys.exit(main())
