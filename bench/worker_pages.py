"""Where a live Hermes worker's own memory goes, page by page.

    sudo .venv/bin/python -m bench.worker_pages [--sessions 3] [--python LABEL=PATH ...]

Starts a real supervisor (`--agent hermes`, sealed, default toolsets, its
spare workers) on a fake model on 127.0.0.1, and for each of `--sessions`
new conversations runs one tool-call turn (the model asks for `terminal`,
then answers), lets the conversation hibernate, and wakes it with a second
tool-call turn. One second after each turn it reads the worker's and the
zygote's `/proc/<pid>/smaps` and `/proc/<pid>/pagemap` and classes every
page the worker holds:

- by *origin*, the mapping it is in: the malloc heap (`[heap]`), pymalloc's
  1 MiB arenas (anonymous mappings of exactly that size), other anonymous
  mappings (malloc's large blocks and thread arenas, thread stacks), the
  interpreter's own data (the python binary or libpython), extension
  modules (`.so` under site-packages), other shared libraries, other files;
- by *history*, comparing the page frame with the zygote's at the same
  address: `shared` (the same frame: not the worker's own), `copied` (the
  zygote has a page there, the worker has its own copy: a copy-on-write
  fault) and `new` (the zygote has none there).

USS is what the worker alone holds (`copied` + `new`, give or take pages
that another process forked from the worker also maps); PSS shares each
page among the processes that map it. Both are independent of the machine's
load, unlike every time. Reading page frames needs root (CAP_SYS_ADMIN);
without it only the smaps columns are filled.

`--python LABEL=PATH` runs the same with another interpreter's venv (one
with hermes-sup and hermes-agent installed), so that Python versions are
compared in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import struct
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from bench.common import RESULTS, Sup, machine
from tests.fake_model import FakeModel

PAGE = os.sysconf("SC_PAGE_SIZE")
KIB = 1024
MIB = 2**20
# pymalloc allocates its arenas as anonymous mappings of exactly this size
# (Python 3.11 to 3.13 on 64-bit Linux).
ARENA = 1 * MIB
# pagemap: bit 63 present, bits 0-54 the page frame (zero without CAP_SYS_ADMIN).
PRESENT = 1 << 63
PFN_MASK = (1 << 55) - 1
START_TIMEOUT = 300.0
# A sealed zygote imports Hermes before it answers; the conversation
# hibernates this many seconds after its turn (then a turn wakes it).
IDLE_TIMEOUT = 4.0
# The turn: a terminal tool call, then the model's answer (tests/fake_model.py).
TOOL_TURN = "run: echo pages > pages.txt; cat pages.txt"

_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)$")


@dataclass
class Mapping:
    """One mapping of /proc/<pid>/smaps and its page counts (KiB)."""

    start: int
    end: int
    path: str
    kib: dict[str, int] = field(default_factory=dict)

    @property
    def origin(self) -> str:
        """Which of the classes in the module docstring the mapping is."""
        path = self.path
        if path == "[heap]":
            return "malloc heap"
        if path == "[stack]":
            return "main stack"
        if path.startswith("[anon:"):
            return f"named {path}"
        if path.startswith("["):
            return "kernel (vdso, vvar)"
        if not path:
            return "pymalloc arenas" if self.end - self.start == ARENA else "other anonymous"
        name = Path(path.split(" (deleted)")[0]).name
        if name.startswith("libpython") or re.fullmatch(r"python3(\.\d+)?", name):
            return "interpreter (binary, libpython)"
        if ".so" in name and "site-packages" in path:
            return "extension modules (.so)"
        if ".so" in name:
            return "shared libraries"
        return "other files"


def read_smaps(pid: int) -> list[Mapping]:
    """The mappings of a process, each with its smaps counters in KiB."""
    maps: list[Mapping] = []
    with open(f"/proc/{pid}/smaps") as fh:
        for line in fh:
            head = _HEADER.match(line)
            if head:
                maps.append(Mapping(int(head[1], 16), int(head[2], 16), head[3].strip()))
                continue
            name, _, rest = line.partition(":")
            value = rest.split()
            if maps and len(value) == 2 and value[1] == "kB":
                maps[-1].kib[name] = int(value[0])
    return maps


def _frames(pid: int, start: int, end: int) -> list[int]:
    """The page frame of every page of [start, end) in `pid` (0: none)."""
    with open(f"/proc/{pid}/pagemap", "rb") as fh:
        fh.seek(start // PAGE * 8)
        data = fh.read((end - start) // PAGE * 8)
    entries = struct.unpack(f"{len(data) // 8}Q", data)
    return [e & PFN_MASK if e & PRESENT else 0 for e in entries]


def classify(worker: int, zygote: int | None) -> dict[str, Any]:
    """The worker's pages by origin and history (see the module docstring),
    its USS and PSS, in KiB."""
    maps = read_smaps(worker)
    zmaps = read_smaps(zygote) if zygote else []
    by_origin: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    frames_readable = True
    for m in maps:
        own = m.kib.get("Private_Clean", 0) + m.kib.get("Private_Dirty", 0)
        row = by_origin[m.origin]
        row["uss"] += own
        row["pss"] += m.kib.get("Pss", 0)
        if not own or not frames_readable:
            continue
        mine = _frames(worker, m.start, m.end)
        if not any(mine):
            frames_readable = False  # no CAP_SYS_ADMIN: frames read as 0
            continue
        theirs = [0] * len(mine)
        for z in zmaps:  # the zygote's pages at the same addresses
            lo, hi = max(z.start, m.start), min(z.end, m.end)
            if lo < hi:
                got = _frames(zygote or 0, lo, hi)
                first = (lo - m.start) // PAGE
                theirs[first : first + len(got)] = got
        for frame, zframe in zip(mine, theirs, strict=True):
            if not frame:
                continue
            if frame == zframe:
                row["shared"] += PAGE // KIB
            elif zframe:
                row["copied"] += PAGE // KIB
            else:
                row["new"] += PAGE // KIB
    totals: dict[str, int] = defaultdict(int)
    for row in by_origin.values():
        for k, v in row.items():
            totals[k] += v
    return {
        "uss_kib": totals["uss"],
        "pss_kib": totals["pss"],
        "copied_kib": totals["copied"] if frames_readable else None,
        "new_kib": totals["new"] if frames_readable else None,
        "by_origin": {
            k: dict(v) for k, v in sorted(by_origin.items(), key=lambda kv: -kv[1]["uss"])
        },
    }


def _agent_config(root: Path, model_url: str) -> Path:
    """The fake model, default toolsets (none named: those of Hermes's API
    server), a template home whose config.yaml names the context length."""
    template = root / "template"
    template.mkdir(parents=True, exist_ok=True)
    (template / "config.yaml").write_text("model:\n  context_length: 131072\n")
    config = root / "agent.toml"
    config.write_text(
        f'model = "fake-model"\nbase_url = "{model_url}"\nprovider = "custom"\n'
        f'template_home = "{template}"\n'
    )
    return config


def _zygote(sup: Sup) -> int | None:
    for p in psutil.Process(sup.proc.pid).children():
        if "zygote" in " ".join(p.cmdline()):
            return p.pid
    return None


def _wait_state(sup: Sup, key: str, state: str, timeout: float = 120.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    with sup.client() as c:
        while True:
            rows = c.sessions(prefix=key)
            if rows and rows[0]["state"] == state:
                return dict(rows[0])
            if time.monotonic() > deadline:
                raise RuntimeError(f"{key} never became {state}: {rows}")
            time.sleep(0.05)


def measure(python: str, sessions: int, model_url: str, extra: list[str]) -> dict[str, Any]:
    """New and woken workers of one supervisor on `python`."""
    scratch = Path(tempfile.mkdtemp(prefix="hsb-pages-", dir="/var/tmp"))
    config = _agent_config(scratch, model_url)
    sup = Sup(
        "--agent",
        "hermes",
        "--agent-config",
        str(config),
        "--idle-timeout",
        str(IDLE_TIMEOUT),
        *extra,
        python=python,
        timeout=START_TIMEOUT,
    )
    out: dict[str, Any] = {"new": [], "woken": []}
    try:
        zygote = _zygote(sup)
        out["zygote_rss_mib"] = psutil.Process(zygote).memory_info().rss / MIB if zygote else None
        for i in range(sessions):
            key = f"pages-{i}"
            for phase in ("new", "woken"):
                with sup.client() as c:
                    reply = c.run(key, TOOL_TURN)
                if not reply.ok or "done:" not in str(reply.text):
                    raise RuntimeError(f"{key} ({phase}): {reply}")
                pid = _wait_state(sup, key, "idle")["pid"]
                time.sleep(1.0)
                out[phase].append(classify(pid, zygote))
                if phase == "new":
                    _wait_state(sup, key, "hibernated")
    finally:
        sup.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return out


def report(label: str, run: dict[str, Any]) -> str:
    """One run as text: USS/PSS per worker, and the first new and woken
    worker's pages by origin."""
    lines = [f"## {label} (zygote RSS {run.get('zygote_rss_mib') or 0:.0f} MiB)"]
    for phase in ("new", "woken"):
        for w in run[phase]:
            copied = w["copied_kib"]
            lines.append(
                f"{phase:6} USS {w['uss_kib'] / KIB:5.1f} MiB  PSS {w['pss_kib'] / KIB:5.1f} MiB"
                + (
                    f"  copied {copied / KIB:5.1f}  new {w['new_kib'] / KIB:5.1f}"
                    if copied is not None
                    else ""
                )
            )
        if run[phase]:
            lines.append(f"  {phase} worker's own pages by origin (MiB: uss / copied / new):")
            for origin, row in run[phase][0]["by_origin"].items():
                if row.get("uss", 0) >= 64:
                    lines.append(
                        f"    {origin:34} {row.get('uss', 0) / KIB:5.1f} / "
                        f"{row.get('copied', 0) / KIB:5.1f} / {row.get('new', 0) / KIB:5.1f}"
                    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Measure on this interpreter (and each --python); print and save."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=3)
    parser.add_argument("--python", action="append", default=[], metavar="LABEL=PATH")
    parser.add_argument("--serve-arg", action="append", default=[], help="passed to serve")
    parser.add_argument("--out", default=str(RESULTS / "worker_pages.json"))
    args = parser.parse_args(argv)
    pythons = {f"python{sys.version_info[0]}.{sys.version_info[1]}": sys.executable}
    for entry in args.python:
        label, _, path = entry.partition("=")
        pythons[label] = path
    model = FakeModel()
    results: dict[str, Any] = {"machine": machine(), "runs": {}}
    try:
        for label, python in pythons.items():
            print(f"{label} ...", file=sys.stderr, flush=True)
            run = measure(python, args.sessions, model.url, args.serve_arg)
            results["runs"][label] = run
            print(report(label, run), flush=True)
    finally:
        model.close()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
