"""Hermes sessions sealed and preloaded against import-after-fork, in one run.

    python bench/sealed.py                   # both modes, numbers to bench/results/sealed.json
    python bench/sealed.py --record-modules  # rewrite worker/hermes_modules.txt

Measured from outside, as a front end sees it (the Hermes runtime logs no
timestamps of its own): *ready* is `open` of a new key until the session
is idle (its worker forked, sealed, hermes loaded and its runtime built);
*first reply* is a new key's first `send` until its reply, from a fake
model on 127.0.0.1 that answers at once; *CPU* is the worker's own CPU time
at each of those two points (from its fork: it moves little with the
machine's load, unlike wall times); *USS* is the idle worker's own memory
one second after that turn (psutil). Both modes run side by side,
the unsealed one being the floor this machine gives today.

`--record-modules` runs one real Hermes turn (a terminal tool call) in a
worker whose runtime, `recording_hermes` below, writes the worker's module
list after the turn: that list is what sealed mode preloads.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# bench/ holds modules named as the stdlib's (http.py): keep it off the path
# (`python bench/sealed.py` puts it first), and load bench/run.py by file.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
MODULES_FILE = REPO / "worker" / "hermes_modules.txt"
RECORD_ENV = "HSB_RECORD_MODULES"
START_TIMEOUT = 300.0
# Modules never to preload: ours (the zygote has what it needs), this file,
# and the interpreter's entry point.
NOT_PRELOADED = ("hermes_sup", "hsb_sealed", "__main__", "__mp_main__", "tests")


def recording_hermes(session: Any) -> Any:
    """A Hermes runtime (`--agent hsb_sealed:recording_hermes`, this file on
    PYTHONPATH as hsb_sealed.py) that writes the worker's loaded modules to $HSB_RECORD_MODULES
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

    sys.path[:0] = [str(REPO)]
    from tests.fake_model import FakeModel

    Sup = _sup_class()
    model = FakeModel()
    scratch = Path(tempfile.mkdtemp(prefix="hsb-rec-", dir="/var/tmp"))
    out = scratch / "modules.txt"
    # This file alone on the workers' path (not bench/, see above).
    (scratch / "hsb_sealed.py").symlink_to(Path(__file__).resolve())
    os.environ["PYTHONPATH"] = os.pathsep.join([str(scratch), os.environ.get("PYTHONPATH", "")])
    sup = Sup(
        "--agent",
        "hsb_sealed:recording_hermes",
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
    shutil.rmtree(scratch, ignore_errors=True)
    MODULES_FILE.write_text(
        "# Modules a Hermes worker had loaded after its first turn (a terminal tool call),\n"
        "# recorded by `python bench/sealed.py --record-modules`; sealed mode's zygote\n"
        "# imports them (worker/hermes_seal.py). One name a line.\n" + "\n".join(names) + "\n"
    )
    print(f"{len(names)} modules written to {MODULES_FILE}")
    return 0


def _bench_run() -> Any:
    """bench/run.py, loaded from its file."""
    import importlib.util

    if "hsb_run" not in sys.modules:
        spec = importlib.util.spec_from_file_location("hsb_run", HERE / "run.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["hsb_run"] = module
        spec.loader.exec_module(module)
    return sys.modules["hsb_run"]


def _sup_class() -> Any:
    """bench/run.py's supervisor, waiting longer for it to answer: a sealed
    zygote imports all of hermes first (seconds; more on a loaded machine
    or a Python that has not compiled hermes's bytecode yet)."""
    import signal
    import subprocess
    import time

    from hermes_sup.client import Client

    base: type = _bench_run().Sup

    class SlowStartSup(base):  # type: ignore[misc]
        def __init__(self, *args: str, python: str = sys.executable) -> None:
            import tempfile

            self.root = Path(tempfile.mkdtemp(prefix="hsb-", dir="/tmp"))
            self.state = self.root / "s"
            cmd = [python, "-m", "hermes_sup.cli", "--state-dir", str(self.state), "serve"]
            cmd += ["--data-dir", str(self.root / "d"), "--log-level", "warning", *args]
            self.proc = subprocess.Popen(cmd, stderr=open(self.root / "log", "wb"))  # noqa: SIM115
            deadline = time.monotonic() + START_TIMEOUT
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    with Client(self.state, timeout=1) as c:
                        c.ping()
                    return
                except Exception:
                    time.sleep(0.1)
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)
            log = (self.root / "log").read_text()
            shutil.rmtree(self.root, ignore_errors=True)
            raise RuntimeError(log)

    return SlowStartSup


def hermes_sessions(
    label: str, args: list[str], count: int, model_url: str, python: str
) -> dict[str, Any]:
    """`count` new Hermes sessions one after another on one supervisor:
    each one's ready time (open -> idle) and first reply (open -> the reply
    to its first message, from a model that answers at once), then its
    worker's USS once idle a second after the turn."""
    import tempfile
    import time

    import psutil

    Sup = _sup_class()
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
        sup = Sup("--agent", "hermes", "--agent-config", str(config), *args, python=python)
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
                        raise RuntimeError(f"{key} never became idle: {sup.root / 'log'}")
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
    Sup = _sup_class()
    sup = Sup(*args, python=python)
    try:
        return summary(_bench_run().spawn_hermes_sup(sup, count, "p"))
    finally:
        sup.close()


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered)) - 1))]


def summary(values: list[float]) -> dict[str, Any]:
    """p50/min/max of seconds, in milliseconds."""
    return {
        "n": len(values),
        "p50_ms": round(pct(values, 50) * 1000, 1),
        "min_ms": round(min(values) * 1000, 1),
        "max_ms": round(max(values) * 1000, 1),
    }


def bench(count: int, pythons: dict[str, str], spares: bool) -> dict[str, Any]:
    """Both modes (and with spares) on each Python, side by side."""
    import json
    import platform

    sys.path[:0] = [str(REPO)]
    from tests.fake_model import FakeModel

    model = FakeModel()
    out: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "load": os.getloadavg(), "kernel": platform.release()},
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
    import argparse
    import json

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
    results = HERE / "results"
    results.mkdir(exist_ok=True)
    (results / "sealed.json").write_text(json.dumps(out, indent=1) + "\n")
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
