"""Where an HTTP server's CPU goes: py-spy samples, charged by package.

`profile_server` samples one server (the endpoint, the bridge floor, or an
A/B's other endpoint) while it serves turns one at a time, apart from the
measured rounds (sampling slows what it samples); `summarize_profile`
charges each busy sample to the deepest frame of a known package. py-spy
is not a dependency: `--profile PATH` names it.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections import Counter
from typing import Any

import httpx

from bench.http_stack import COMPLETIONS, KEY_HEADER, Stack, chat_body

# Where a sample's time is charged: the deepest frame from one of these
# (by the path py-spy prints), else the event loop itself.
CATEGORIES = (
    ("uvicorn", "uvicorn/"),
    ("starlette", "starlette/"),
    ("anyio (starlette's streaming)", "anyio/"),
    ("our handler (httpapi)", "httpapi/"),
    ("AsyncClient (hermes_sup client)", "client/"),
    ("protocol (msgpack, signing)", "protocol/"),
    ("pyzmq", "zmq/"),
    ("bridge app (bench/http_floor.py)", "http_floor.py"),
)
# The process's own entry frames, on every stack: not charged.
ROOTS = ("httpapi/__main__.py", "httpapi/serve.py", "<frozen runpy>")
# The floor apps' entry frames, their module and `main` (by function name:
# their app's own frames in the same file are charged).
FLOOR_ROOTS = ("<module> (", "main (")
IDLE = "select (selectors.py"


def profile_server(
    stack: Stack, py_spy: str, pid: int, url: str, headers: dict[str, str], turns: int
) -> dict[str, Any]:
    """Sample one HTTP server with py-spy while it serves `turns`
    non-streaming and `turns` streaming chat completions one at a time
    (apart from the measured rounds: sampling slows what it samples).
    Returns where its busy samples are charged (CATEGORIES) and the
    functions where samples end most often."""
    out_path = stack.root / f"profile-{pid}.txt"
    spy = subprocess.Popen(
        [py_spy, "record", "--pid", str(pid), "--rate", "1000", "--format", "raw"]
        + ["--output", str(out_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        time.sleep(1.0)  # attached
        with httpx.Client(base_url=url, headers=headers, timeout=120) as client:
            for _ in range(turns):
                client.post(COMPLETIONS, json=chat_body("x"), headers={KEY_HEADER: "rt-prof"})
                with client.stream(
                    "POST", COMPLETIONS, json=chat_body("x", True), headers={KEY_HEADER: "rt-prof"}
                ) as r:
                    for _line in r.iter_lines():
                        pass
    finally:
        spy.send_signal(signal.SIGINT)  # py-spy writes its output on Ctrl-C
        try:
            _, err = spy.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            spy.kill()
            spy.wait()
            err = b""
    if not out_path.exists():
        return {"error": err.decode(errors="replace")[-500:]}
    return summarize_profile(out_path.read_text(), 2 * turns)


def charge(frames: list[str]) -> str:
    """The category a sample is charged to: its deepest frame that has one."""
    for frame in reversed(frames):
        if any(root in frame for root in ROOTS):
            break
        if frame.startswith(FLOOR_ROOTS) and "http_floor.py" in frame:
            break
        for name, needle in CATEGORIES:
            if needle in frame:
                return name
    return "event loop (asyncio)"


def summarize_profile(raw: str, turns: int) -> dict[str, Any]:
    """Collapsed stacks ('frame;frame;... count') -> shares by category and
    the leaf functions with the most samples, idle samples left out."""
    total = idle = 0
    charged: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    for line in raw.splitlines():
        stack, _, count_s = line.rpartition(" ")
        if not stack or not count_s.isdigit():
            continue
        count = int(count_s)
        frames = stack.split(";")
        if IDLE in frames[-1]:
            idle += count  # the loop waiting in epoll: not work
            continue
        total += count
        charged[charge(frames)] += count
        leaves[frames[-1]] += count
    if not total:
        return {"samples": 0, "idle_samples": idle}
    return {
        "samples": total,
        "idle_samples": idle,
        "samples_per_turn": total / turns,
        "share_pct": {name: 100 * n / total for name, n in charged.most_common()},
        "top_leaves_pct": {f: 100 * n / total for f, n in leaves.most_common(15)},
        "raw": raw,
    }
