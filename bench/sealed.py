"""Hermes sessions sealed and preloaded against import-after-fork, in one run.

    python -m bench.sealed                   # every mode, numbers to bench/results/sealed.json
    python -m bench.sealed --record-modules  # rewrite worker/hermes_modules.txt

Measured from outside, as a front end sees it (the Hermes runtime logs no
timestamps of its own): *ready* is `open` of a new key until the session
is idle (its worker forked, sealed, hermes loaded and its runtime built);
*first reply* is a new key's first `send` until its reply, from a fake
model on 127.0.0.1 that answers at once; *CPU* is the worker's own CPU time
at each of those two points (from its fork: it moves little with the
machine's load, unlike wall times); *USS* is the idle worker's own memory
one second after that turn (psutil). Every mode runs in the same run, the
unsealed one being the floor this machine gives today.

`--record-modules` runs one real Hermes turn (a terminal tool call) in a
worker whose runtime (bench/sealed_recorder.py) writes the worker's module
list after the turn: that list is what sealed mode preloads.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from bench.common import REPO, RESULTS, Sup, machine, pct, summary
from bench.sealed_recorder import RECORD_ENV
from bench.spawn import spawn_hermes_sup
from tests.fake_model import FakeModel

MODULES_FILE = REPO / "worker" / "hermes_modules.txt"
# A sealed zygote imports all of hermes before its supervisor answers:
# seconds, more on a loaded machine or a Python that has not compiled
# hermes's bytecode yet.
START_TIMEOUT = 300.0
# Modules never to preload: ours (the zygote has what it needs), the
# recording runtime, and the interpreter's entry point.
NOT_PRELOADED = ("hermes_sup", "hsb_sealed", "__main__", "__mp_main__", "tests")


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
    model = FakeModel()
    scratch = Path(tempfile.mkdtemp(prefix="hsb-rec-", dir="/var/tmp"))
    out = scratch / "modules.txt"
    # The recording runtime alone on the workers' path, not bench/.
    (scratch / "hsb_sealed.py").symlink_to(Path(__file__).with_name("sealed_recorder.py"))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(scratch), os.environ.get("PYTHONPATH", "")])
    try:
        sup = Sup(
            "--agent",
            "hsb_sealed:recording_hermes",
            "--agent-config",
            str(_agent_config(scratch, model.url)),
            "--env",
            f"{RECORD_ENV}={out}",
            timeout=START_TIMEOUT,
        )
        try:
            with sup.client() as c:
                reply = c.run("rec", "run: echo sealed > f.txt; cat f.txt; ls")
        finally:
            sup.close()
        if not reply.ok or not out.exists():
            print(f"the recording turn failed: {reply}", file=sys.stderr)
            return 1
        names = [n for n in out.read_text().split() if keep_module(n)]
    finally:
        model.close()
        shutil.rmtree(scratch, ignore_errors=True)
    MODULES_FILE.write_text(
        "# Modules a Hermes worker had loaded after its first turn (a terminal tool call),\n"
        "# recorded by `python -m bench.sealed --record-modules`; sealed mode's zygote\n"
        "# imports them (worker/hermes_seal.py). One name a line.\n" + "\n".join(names) + "\n"
    )
    print(f"{len(names)} modules written to {MODULES_FILE}")
    return 0


def hermes_sessions(
    label: str, args: list[str], count: int, model_url: str, python: str
) -> dict[str, Any]:
    """`count` new Hermes sessions one after another on one supervisor:
    each one's ready time (open -> idle) and first reply (open -> the reply
    to its first message, from a model that answers at once), then its
    worker's USS once idle a second after the turn."""
    scratch = Path(tempfile.mkdtemp(prefix="hsb-sealed-", dir="/var/tmp"))
    config = _agent_config(scratch, model_url)
    ready: list[float] = []
    first: list[float] = []
    uss: list[float] = []
    # The worker's own CPU time (user + system) since its fork: barely
    # moved by the machine's load, unlike the wall times.
    cpu_ready: list[float] = []
    cpu_first: list[float] = []
    try:
        sup = Sup(
            "--agent",
            "hermes",
            "--agent-config",
            str(config),
            *args,
            python=python,
            timeout=START_TIMEOUT,
        )
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    try:
        with sup.client() as c:
            for i in range(count):
                key = f"{label}-{i}"
                started = time.perf_counter()
                c.open(key)
                deadline = time.monotonic() + 120
                while c.sessions(prefix=key)[0]["state"] != "idle":
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{key} never became idle: {sup.log}")
                    time.sleep(0.002)
                ready.append(time.perf_counter() - started)
                worker = psutil.Process(c.sessions(prefix=key)[0]["pid"])
                cpu_ready.append(sum(worker.cpu_times()[:2]))
                reply = c.run(key, "hello")
                first.append(time.perf_counter() - started)
                if not reply.ok:
                    raise RuntimeError(f"{key}: {reply}")
                cpu_first.append(sum(worker.cpu_times()[:2]))
                pid = worker.pid
                time.sleep(1.0)
                uss.append(psutil.Process(pid).memory_full_info().uss / 2**20)
        zygote = [
            p for p in psutil.Process(sup.proc.pid).children() if "zygote" in " ".join(p.cmdline())
        ]
        zygote_rss = zygote[0].memory_info().rss / 2**20 if zygote else None
    finally:
        sup.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        "ready": summary(ready),
        "first_reply": summary(first),
        "cpu_ready": summary(cpu_ready),
        "cpu_first_reply": summary(cpu_first),
        "uss_mib": {"p50": pct(uss, 50), "max": max(uss), "all": [round(u, 1) for u in uss]},
        "zygote_rss_mib": zygote_rss,
    }


def probe_spawn(args: list[str], count: int, python: str) -> dict[str, Any]:
    """The probe runtime's spawn (first message to a new key -> reply)."""
    sup = Sup(*args, python=python, timeout=START_TIMEOUT)
    try:
        return summary(spawn_hermes_sup(sup, count, "p"))
    finally:
        sup.close()


def bench(count: int, pythons: dict[str, str], spares: bool) -> dict[str, Any]:
    """Both modes (and the default) on each Python, side by side."""
    model = FakeModel()
    out: dict[str, Any] = {
        "machine": machine(),
        "count": count,
        "runs": {},
    }
    modes = [
        ("unsealed", ["--sealed", "off", "--spare-workers", "0"]),
        ("sealed", ["--sealed", "on", "--spare-workers", "0"]),
    ]
    if spares:
        # The default configuration: sealed (auto) with its spare workers.
        modes.append(("default", []))
    try:
        for py_label, python in pythons.items():
            for label, args in modes:
                name = f"{label} ({py_label})"
                print(f"{name} ...", file=sys.stderr, flush=True)
                try:
                    out["runs"][name] = hermes_sessions(label, args, count, model.url, python)
                except Exception as exc:
                    out["runs"][name] = {"error": f"{type(exc).__name__}: {exc}"}
                print(f"  {json.dumps(out['runs'][name])}", file=sys.stderr, flush=True)
            for label, args in modes[:2]:
                name = f"probe spawn {label} ({py_label})"
                try:
                    out["runs"][name] = probe_spawn(args, count * 2, python)
                except Exception as exc:
                    out["runs"][name] = {"error": f"{type(exc).__name__}: {exc}"}
                print(f"{name}: {json.dumps(out['runs'][name])}", file=sys.stderr, flush=True)
    finally:
        model.close()
    out["machine"]["load_after"] = os.getloadavg()
    return out


def main(argv: list[str] | None = None) -> int:
    """Every mode on each Python (or --record-modules); print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--record-modules", action="store_true")
    parser.add_argument("--count", type=int, default=8, help="sessions per mode (default 8)")
    parser.add_argument(
        "--python",
        action="append",
        default=[],
        metavar="LABEL=PATH",
        help="also run under this interpreter (a venv with hermes-agent and hermes-sup)",
    )
    parser.add_argument("--no-spares", action="store_true")
    args = parser.parse_args(argv)
    if args.record_modules:
        return record_modules()
    pythons = {f"python{sys.version_info[0]}.{sys.version_info[1]}": sys.executable}
    for entry in args.python:
        label, _, path = entry.partition("=")
        pythons[label] = path
    out = bench(args.count, pythons, not args.no_spares)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sealed.json").write_text(json.dumps(out, indent=1) + "\n")
    print(table(out))
    return 0


def table(out: dict[str, Any]) -> str:
    """The Hermes rows as a markdown table (BENCHMARKS.md)."""

    def span(s: dict[str, Any]) -> str:
        return f"{s['p50_ms']:,.0f} [{s['min_ms']:,.0f} - {s['max_ms']:,.0f}]"

    rows = [
        "| mode | ready ms | first reply ms | CPU to ready ms | CPU to reply ms "
        "| idle USS MiB | zygote RSS MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, run in out["runs"].items():
        if "ready" not in run:
            if "error" in run:
                rows.append(f"| {name} | failed: {run['error'][:80]} | | | | | |")
            continue
        rows.append(
            f"| {name} | {span(run['ready'])} | {span(run['first_reply'])} "
            f"| {run['cpu_ready']['p50_ms']:.0f} | {run['cpu_first_reply']['p50_ms']:.0f} "
            f"| {run['uss_mib']['p50']:.1f} | {run['zygote_rss_mib']:.0f} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
