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

`--objects` says which Python objects sit on the copied pages, in a
bench-only stand-in for the zygote: a process that preloads as the sealed
zygote does (hermes under fixed paths, the base modules, the warm-ups,
gc.freeze) and forks a child that runs the same tool-call turn through the
Hermes runtime (unsealed: the stand-in is not a supervisor). The parent
finds the child's copied pages; the child then unfreezes its gc and lists
every object (and the untracked ones they refer to: code, strings) by the
pages it lies on. A page counts once for each type found on it, so the
counts overlap; `code by file` names the modules whose code objects are on
copied pages.
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


def copied_pages(child: int, parent: int) -> set[int]:
    """The page numbers the child holds copies of (the parent has a
    different frame there)."""
    copied: set[int] = set()
    pmaps = read_smaps(parent)
    for m in read_smaps(child):
        if not (m.kib.get("Private_Clean", 0) + m.kib.get("Private_Dirty", 0)):
            continue
        mine = _frames(child, m.start, m.end)
        for z in pmaps:
            lo, hi = max(z.start, m.start), min(z.end, m.end)
            if lo >= hi:
                continue
            theirs = _frames(parent, lo, hi)
            first = (lo - m.start) // PAGE
            for i, zframe in enumerate(theirs):
                frame = mine[first + i]
                if frame and zframe and frame != zframe:
                    copied.add(lo // PAGE + i)
    return copied


def objects_on(pages: set[int]) -> dict[str, Any]:
    """Which objects of this process lie on `pages` (see --objects)."""
    import gc

    gc.unfreeze()
    tracked = gc.get_objects()
    found: dict[int, object] = {id(o): o for o in tracked}
    for o in tracked:
        for r in gc.get_referents(o):
            if id(r) not in found and not gc.is_tracked(r):
                found[id(r)] = r
    by_type: dict[str, set[int]] = defaultdict(set)
    code_files: dict[str, set[int]] = defaultdict(set)
    covered: set[int] = set()
    for address, obj in found.items():
        try:
            size = sys.getsizeof(obj)
        except TypeError:
            continue
        hit = {p for p in range(address // PAGE, (address + size - 1) // PAGE + 1) if p in pages}
        if not hit:
            continue
        covered |= hit
        kind = type(obj).__name__
        by_type[kind] |= hit
        if kind == "code":
            parts = Path(getattr(obj, "co_filename", "?")).parts
            top = (
                parts[parts.index("site-packages") + 1]
                if "site-packages" in parts
                else "/".join(parts[-2:])
            )
            code_files[top.removesuffix(".py")] |= hit
    return {
        "copied_pages": len(pages),
        "pages_with_objects": len(covered),
        "by_type": dict(
            sorted(((k, len(v)) for k, v in by_type.items()), key=lambda kv: -kv[1])[:25]
        ),
        "code_by_file": dict(
            sorted(((k, len(v)) for k, v in code_files.items()), key=lambda kv: -kv[1])[:15]
        ),
    }


def objects_child(model_url: str, scratch: Path) -> int:
    """The stand-in zygote of --objects (a process of its own)."""
    import gc
    from types import SimpleNamespace

    from hermes_sup.worker import hermes_seal, zygote
    from hermes_sup.worker.main import prepare

    paths = SimpleNamespace(home=scratch / "home", workspace=scratch / "ws", user=scratch / "user")
    for p in (paths.home, paths.workspace, paths.user):
        p.mkdir(parents=True, exist_ok=True)
    zygote.one_malloc_arena()
    hermes_seal.preload(paths)
    zygote._preload(list(zygote.BASE_PRELOAD))
    prepare()
    gc.collect()
    gc.freeze()
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            from hermes_sup.worker.hermes import HermesRuntime
            from hermes_sup.worker.runtime import SessionInfo

            config = {"model": "fake-model", "base_url": model_url, "provider": "custom"}
            info = SessionInfo("objects", Path(paths.workspace), Path(paths.home), config=config)
            HermesRuntime(info).run_turn(TOOL_TURN, lambda kind, data: None)
            os.write(ready_w, b"x")
            os.read(go_r, 1)
            pages = {int(x) for x in (scratch / "pages").read_text().split()}
            (scratch / "objects.json").write_text(json.dumps(objects_on(pages)))
        finally:
            os._exit(0)
    os.read(ready_r, 1)
    time.sleep(1.0)
    (scratch / "pages").write_text("\n".join(map(str, copied_pages(pid, os.getpid()))))
    os.write(go_w, b"x")
    os.waitpid(pid, 0)
    return 0


def objects(model_url: str, python: str) -> dict[str, Any]:
    """--objects on one interpreter."""
    import subprocess

    scratch = Path(tempfile.mkdtemp(prefix="hsb-objects-", dir="/var/tmp"))
    try:
        subprocess.run(
            [python, "-m", "bench.worker_pages", "--objects-child", model_url, str(scratch)],
            check=True,
            timeout=START_TIMEOUT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        return dict(json.loads((scratch / "objects.json").read_text()))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


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
    parser.add_argument("--objects", action="store_true", help="the objects on copied pages")
    parser.add_argument("--objects-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.objects_child:
        return objects_child(args.objects_child[0], Path(args.objects_child[1]))
    pythons = {f"python{sys.version_info[0]}.{sys.version_info[1]}": sys.executable}
    for entry in args.python:
        label, _, path = entry.partition("=")
        pythons[label] = path
    model = FakeModel()
    results: dict[str, Any] = {"machine": machine(), "runs": {}}
    try:
        for label, python in pythons.items():
            print(f"{label} ...", file=sys.stderr, flush=True)
            if args.objects:
                found = objects(model.url, python)
                results["runs"][label] = found
                print(f"## {label}\n{json.dumps(found, indent=1)}", flush=True)
                continue
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
