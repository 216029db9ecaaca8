"""The HTTP endpoint's figures (issue 17), each beside a floor in the same run.

    python -m bench.http              # everything (a few minutes)
    python -m bench.http --quick      # smaller counts
    python bench/http.py --profile    # also sample the endpoint with py-spy

Prints its figures and writes bench/results/http.json. What it measures,
all with the probe runtime:

- round trip: one turn ("x", echoed) with one request in flight, through
  the Python client over ZeroMQ, through the endpoint (non-streaming and
  streaming `POST /v1/chat/completions`, keep-alive httpx), and through the
  two floors of bench/http_floor.py (an echo app, and a bridge app that
  only calls `AsyncClient.run`), interleaved in a random order each round,
  so that every variant sees the same load;
- streams: N streaming chat completions held at once (one session each),
  each a probe `stream` of W words, checked in order; beside the same N
  turns read through one `AsyncClient`; with the endpoint's and the
  supervisor's memory;
- turns/s: non-streaming chat completions at concurrency 1 and 16, against
  the echo app (the floor), the bridge app and the Python client;
- with `--ab DIR`, another version's endpoint (DIR/hermes_sup) served beside
  this one against the same supervisor, its round trips interleaved with
  the others: the paired difference of each request's time and this side's
  share of wins, so that two versions are compared under the same load.

Servers: a supervisor (`serve`), the endpoint as `python -m hermes_sup.httpapi`
(what `serve --http` runs, minus its keeper), and the floors, all children
of this process, stopped (by pid) when it ends. The machine is shared:
judge by the ratios to the floors, never by absolute times.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # a script's directory first on sys.path would shadow `http`
    _here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import aiohttp  # noqa: E402
import httpx  # noqa: E402
import psutil  # noqa: E402

from hermes_sup.client import AsyncClient, Client, Reply, Token  # noqa: E402
from hermes_sup.httpapi.keys import KeyStore  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
COMPLETIONS = "/v1/chat/completions"
KEY_HEADER = "X-Hermes-Session-Key"


def pct(values: list[float], p: float) -> float:
    """The p-th percentile (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered)) - 1))]


def summary(seconds: list[float]) -> dict[str, float]:
    """p50/p90/p99/mean of a list of seconds, in ms."""
    return {
        "n": len(seconds),
        "p50_ms": pct(seconds, 50) * 1000,
        "p90_ms": pct(seconds, 90) * 1000,
        "p99_ms": pct(seconds, 99) * 1000,
        "mean_ms": statistics.fmean(seconds) * 1000,
    }


def load_now() -> dict[str, Any]:
    """The machine's load when a figure was taken (shared: other work runs)."""
    one, five, fifteen = os.getloadavg()
    return {"loadavg": [one, five, fifteen], "cpus": os.cpu_count()}


def cpu_seconds(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def chat_body(text: str, stream: bool = False) -> dict[str, Any]:
    return {
        "model": "hermes-agent",
        "messages": [{"role": "user", "content": text}],
        "stream": stream,
    }


# ---------------------------------------------------------------- the servers


class Stack:
    """A supervisor (probe runtime), the endpoint, and the two floor apps,
    all on a private temp dir; `close` stops each by its pid."""

    def __init__(self, max_sessions: int | None = None, ab_source: Path | None = None) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="hsh-", dir=os.environ.get("HSB_DIR", "/tmp")))
        self.b_url: str | None = None
        self.b_endpoint: subprocess.Popen[bytes] | None = None
        self.state, self.data = self.root / "s", self.root / "d"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.key = KeyStore(self.data).generate("bench")
        self.auth = {"Authorization": f"Bearer {self.key}"}
        try:
            extra = [] if max_sessions is None else ["--max-sessions", str(max_sessions)]
            self.sup = self._start(
                "supervisor",
                "hermes_sup.cli",
                "--state-dir",
                str(self.state),
                "serve",
                "--data-dir",
                str(self.data),
                "--log-level",
                "warning",
                *extra,
            )
            self._wait(lambda: self._pings(), "the supervisor", self.sup)
            self.url, self.endpoint = self._serve(
                "endpoint",
                "hermes_sup.httpapi",
                "--state-dir",
                str(self.state),
                "--data-dir",
                str(self.data),
                "--log-level",
                "warning",
            )
            self.echo_url, self.echo = self._serve("echo", "bench.http_floor")
            self.bridge_url, self.bridge = self._serve(
                "bridge", "bench.http_floor", "--state-dir", str(self.state)
            )
            # The same three on uvloop's event loop (see bench/http_floor.py).
            self.uv_url, self.uv_endpoint = self._serve(
                "endpoint-uvloop",
                "bench.http_floor",
                "--endpoint-on-uvloop",
                "--state-dir",
                str(self.state),
                "--data-dir",
                str(self.data),
                "--log-level",
                "warning",
            )
            self.uv_echo_url, self.uv_echo = self._serve(
                "echo-uvloop", "bench.http_floor", "--uvloop"
            )
            self.uv_bridge_url, self.uv_bridge = self._serve(
                "bridge-uvloop", "bench.http_floor", "--uvloop", "--state-dir", str(self.state)
            )
            if ab_source is not None:
                # Another version's endpoint (B), against the same supervisor.
                self.b_url, self.b_endpoint = self._serve(
                    "endpoint-b",
                    "hermes_sup.httpapi",
                    "--state-dir",
                    str(self.state),
                    "--data-dir",
                    str(self.data),
                    "--log-level",
                    "warning",
                    source=ab_source,
                )
        except BaseException:
            self.close()
            raise

    def _start(
        self, name: str, module: str, *args: str, source: Path | None = None
    ) -> subprocess.Popen[bytes]:
        """Start `python -m module args`; with `source` (a directory holding
        another version's `hermes_sup`), that version's."""
        log = open(self.root / f"{name}.log", "wb")  # noqa: SIM115
        first = [str(source)] if source is not None else []
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([*first, str(REPO), os.environ.get("PYTHONPATH", "")]),
        }
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args], stderr=log, stdout=log, cwd=REPO, env=env
        )
        log.close()
        self.procs.append(proc)
        return proc

    def _serve(
        self, name: str, module: str, *args: str, source: Path | None = None
    ) -> tuple[str, subprocess.Popen[bytes]]:
        port = free_port()
        proc = self._start(name, module, *args, "--listen", f"127.0.0.1:{port}", source=source)
        url = f"http://127.0.0.1:{port}"

        def answers() -> bool:
            try:
                return httpx.get(url + "/health", timeout=2).status_code in (200, 404)
            except httpx.HTTPError:
                return False

        self._wait(answers, name, proc)
        return url, proc

    def _pings(self) -> bool:
        try:
            with Client(self.state, timeout=1) as c:
                c.ping()
            return True
        except Exception:
            return False

    def _wait(self, ready: Callable[[], bool], what: str, proc: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + 60
        while not ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                logs = "\n".join(p.read_text(errors="replace") for p in self.root.glob("*.log"))
                raise RuntimeError(f"{what} did not start:\n{logs}")
            time.sleep(0.05)

    def client(self) -> Client:
        return Client(self.state, timeout=120)

    def close(self) -> None:
        """Stop the HTTP servers, then the supervisor (its workers go with it)."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)


# ---------------------------------------------------------------- round trips


class RawHttp:
    """A keep-alive HTTP/1.1 client in a few lines over one socket, for
    non-streaming requests: what is left of the round trip once the HTTP
    client's own cost (httpx's) is taken out."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.head = f"Host: {host}:{port}\r\nContent-Type: application/json\r\n"
        self.head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.buffer = b""

    def post(self, path: str, body: bytes, headers: dict[str, str]) -> bytes:
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        request = f"POST {path} HTTP/1.1\r\n{self.head}{extra}Content-Length: {len(body)}\r\n\r\n"
        self.sock.sendall(request.encode() + body)
        while b"\r\n\r\n" not in self.buffer:
            self._read()
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        while len(self.buffer) < length:
            self._read()
        answer, self.buffer = self.buffer[:length], self.buffer[length:]
        if status != 200:
            raise RuntimeError(f"{status}: {answer[:200]!r}")
        return answer

    def _read(self) -> None:
        piece = self.sock.recv(65536)
        if not piece:
            raise ConnectionError("the server closed the connection")
        self.buffer += piece

    def close(self) -> None:
        self.sock.close()


def round_trips(stack: Stack, rounds: int, warmup: int = 30) -> dict[str, Any]:
    """One turn at a time through each path, interleaved: each round runs
    every variant once, in a fresh random order."""
    zmq_client = stack.client()
    endpoint = httpx.Client(base_url=stack.url, headers=stack.auth, timeout=120)
    echo = httpx.Client(base_url=stack.echo_url, timeout=120)
    bridge = httpx.Client(base_url=stack.bridge_url, timeout=120)
    uv_endpoint = httpx.Client(base_url=stack.uv_url, headers=stack.auth, timeout=120)
    uv_echo = httpx.Client(base_url=stack.uv_echo_url, timeout=120)
    uv_bridge = httpx.Client(base_url=stack.uv_bridge_url, timeout=120)

    def post(client: httpx.Client, key: str) -> Callable[[], None]:
        def call() -> None:
            r = client.post(COMPLETIONS, json=chat_body("x"), headers={KEY_HEADER: key})
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "x"

        return call

    def stream(client: httpx.Client, key: str) -> Callable[[], None]:
        def call() -> None:
            with client.stream(
                "POST", COMPLETIONS, json=chat_body("x", True), headers={KEY_HEADER: key}
            ) as r:
                assert r.status_code == 200
                lines = [line for line in r.iter_lines() if line]
            assert lines[-1] == "data: [DONE]", lines

        return call

    raw_endpoint = RawHttp(stack.url, stack.auth)
    raw_echo = RawHttp(stack.echo_url, {})
    raw_uv_endpoint = RawHttp(stack.uv_url, stack.auth)
    body = json.dumps(chat_body("x")).encode()

    def raw(client: RawHttp, key: str) -> Callable[[], None]:
        def call() -> None:
            answer = json.loads(client.post(COMPLETIONS, body, {KEY_HEADER: key}))
            assert answer["choices"][0]["message"]["content"] == "x"

        return call

    def zmq_turn() -> None:
        assert zmq_client.run("rt-zmq", "x").text == "x"

    b_endpoint = None
    if stack.b_url is not None:
        b_endpoint = httpx.Client(base_url=stack.b_url, headers=stack.auth, timeout=120)
    variants: dict[str, Callable[[], None]] = {
        "zmq": zmq_turn,
        "http": post(endpoint, "rt-http"),
        "http_stream": stream(endpoint, "rt-stream"),
        "echo_floor": post(echo, "rt-echo"),
        "echo_floor_stream": stream(echo, "rt-echo"),
        "bridge_floor": post(bridge, "rt-bridge"),
        "http_raw_client": raw(raw_endpoint, "rt-raw"),
        "echo_floor_raw_client": raw(raw_echo, "rt-echo"),
        "http_uvloop": post(uv_endpoint, "rt-uv-http"),
        "http_uvloop_stream": stream(uv_endpoint, "rt-uv-stream"),
        "http_uvloop_raw_client": raw(raw_uv_endpoint, "rt-uv-raw"),
        "echo_floor_uvloop": post(uv_echo, "rt-echo"),
        "bridge_floor_uvloop": post(uv_bridge, "rt-uv-bridge"),
    }
    raw_b = RawHttp(stack.b_url, stack.auth) if stack.b_url is not None else None
    if b_endpoint is not None and raw_b is not None:
        # The same three kinds of request as this endpoint's, for a CPU
        # figure to set beside its own.
        variants["http_b"] = post(b_endpoint, "rt-http-b")
        variants["http_b_stream"] = stream(b_endpoint, "rt-stream-b")
        variants["http_b_raw_client"] = raw(raw_b, "rt-raw-b")
    times: dict[str, list[float]] = {name: [] for name in variants}
    servers = {"endpoint": stack.endpoint.pid, "supervisor": stack.sup.pid}
    servers |= {"echo": stack.echo.pid, "bridge": stack.bridge.pid}
    servers |= {"uv_endpoint": stack.uv_endpoint.pid, "uv_echo": stack.uv_echo.pid}
    servers |= {"uv_bridge": stack.uv_bridge.pid}
    if stack.b_endpoint is not None:
        servers["endpoint_b"] = stack.b_endpoint.pid
    rng = random.Random(17)
    order = list(variants)
    try:
        for i in range(warmup + rounds):
            if i == warmup:
                cpu_before = {name: cpu_seconds(pid) for name, pid in servers.items()}
                load = load_now()
            rng.shuffle(order)
            for name in order:
                started = time.perf_counter()
                variants[name]()
                if i >= warmup:
                    times[name].append(time.perf_counter() - started)
        cpu = {name: cpu_seconds(pid) - cpu_before[name] for name, pid in servers.items()}
    finally:
        for c in (endpoint, echo, bridge, uv_endpoint, uv_echo, uv_bridge, b_endpoint):
            if c is not None:
                c.close()
        for r in (raw_endpoint, raw_echo, raw_uv_endpoint, raw_b):
            if r is not None:
                r.close()
        zmq_client.close()
    out: dict[str, Any] = {"load": load, **{name: summary(t) for name, t in times.items()}}
    zmq_p50 = out["zmq"]["p50_ms"]
    # Per round, the same turn's time through HTTP minus through zmq.
    added = [name for name in variants if name.startswith(("http", "bridge"))]
    for name in added:
        out[name]["added_p50_ms"] = out[name]["p50_ms"] - zmq_p50
        paired = [a - b for a, b in zip(times[name], times["zmq"], strict=True)]
        out[name]["paired_added_p50_ms"] = statistics.median(paired) * 1000
    # CPU each server spent per request it served in the measured rounds.
    out["cpu_us_per_request"] = {
        "endpoint (http, http_stream, http_raw_client)": cpu["endpoint"] / (3 * rounds) * 1e6,
        "echo floor (echo, echo stream, echo raw)": cpu["echo"] / (3 * rounds) * 1e6,
        "bridge floor": cpu["bridge"] / rounds * 1e6,
        "endpoint on uvloop (3 requests a round)": cpu["uv_endpoint"] / (3 * rounds) * 1e6,
        "echo floor on uvloop": cpu["uv_echo"] / rounds * 1e6,
        "bridge floor on uvloop": cpu["uv_bridge"] / rounds * 1e6,
        "supervisor (the 9 turns of a round)": cpu["supervisor"] / (9 * rounds) * 1e6,
    }
    if "http_b" in times:
        # This endpoint against B's, request by request in the same round.
        out["ab"] = {}
        pairs = (("http", "http_b"), ("http_stream", "http_b_stream"))
        for mine, theirs in (*pairs, ("http_raw_client", "http_b_raw_client")):
            diffs = [a - b for a, b in zip(times[mine], times[theirs], strict=True)]
            out["ab"][mine] = {
                "this_p50_ms": out[mine]["p50_ms"],
                "b_p50_ms": out[theirs]["p50_ms"],
                "paired_diff_p50_ms": statistics.median(diffs) * 1000,
                "this_faster_share": sum(d < 0 for d in diffs) / len(diffs),
            }
        out["cpu_us_per_request"]["endpoint B (http_b, http_b_stream, http_b_raw_client)"] = (
            cpu["endpoint_b"] / (3 * rounds) * 1e6
        )
    return out


# ---------------------------------------------------------------- profile


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
ROOTS = ("httpapi/__main__.py", "httpapi/serve.py", "<frozen runpy>", "http_floor.py:1")
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


# ---------------------------------------------------------------- streams


class MemorySampler:
    """The peak RSS (and fds) of some processes, sampled in a thread."""

    def __init__(self, pids: dict[str, int], every: float = 0.1) -> None:
        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.before = self._sample()
        self.peak = dict(self.before)
        self.peak_fds = {name: p.num_fds() for name, p in self.procs.items()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every,), daemon=True)
        self._thread.start()

    def _sample(self) -> dict[str, int]:
        return {name: p.memory_info().rss for name, p in self.procs.items()}

    def _run(self, every: float) -> None:
        while not self._stop.wait(every):
            for name, rss in self._sample().items():
                self.peak[name] = max(self.peak[name], rss)
            for name, p in self.procs.items():
                self.peak_fds[name] = max(self.peak_fds[name], p.num_fds())

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        after = self._sample()
        mib = 1 / (1024 * 1024)
        return {
            name: {
                "rss_before_mib": self.before[name] * mib,
                "rss_peak_mib": self.peak[name] * mib,
                "rss_after_mib": after[name] * mib,
                "fds_peak": self.peak_fds[name],
            }
            for name in self.procs
        }


def words_of(words: int) -> tuple[str, list[str]]:
    """The probe command that streams `words` words, and the deltas expected."""
    ws = [f"w{i}" for i in range(words)]
    return "stream " + " ".join(ws), [w if i == 0 else " " + w for i, w in enumerate(ws)]


async def _warm(url: str, headers: dict[str, str], keys: list[str], concurrency: int) -> None:
    """One turn to each session (spawning its worker), `concurrency` at a time."""
    queue = list(keys)
    async with aiohttp.ClientSession(url, headers=headers) as http:

        async def worker() -> None:
            while queue:
                key = queue.pop()
                async with http.post(
                    COMPLETIONS, json=chat_body("x"), headers={KEY_HEADER: key}
                ) as r:
                    if r.status != 200:
                        raise RuntimeError(f"warming {key}: {r.status} {await r.text()}")
                    await r.read()

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def in_order(deltas: list[str], expected: list[str]) -> bool:
    """Whether `deltas` are some of `expected`, none out of order: what a
    stream that lost events (but never reordered them) shows."""
    it = iter(expected)
    return all(any(d == e for e in it) for d in deltas)


def verdict(deltas: list[str], expected: list[str], ended: bool) -> str:
    """complete: every delta, in order, then the end; gaps: in order but
    some missing; out_of_order; unfinished: no end before the deadline.
    Deltas a replay merged (a late runs subscriber) count whole if they
    join to the same text."""
    if not ended:
        return "unfinished"
    if deltas == expected or "".join(deltas) == "".join(expected):
        return "complete"
    return "gaps" if in_order(deltas, expected) else "out_of_order"


class Tally:
    """Streams open at once (the peak), and each stream's outcome."""

    def __init__(self) -> None:
        self.open = self.peak = 0
        self.results: list[dict[str, Any]] = []

    def opened(self) -> None:
        self.open += 1
        self.peak = max(self.peak, self.open)

    def closed(self) -> None:
        self.open -= 1

    def summary(self, wall: float) -> dict[str, Any]:
        outcomes = Counter(r["outcome"] for r in self.results)
        errors = Counter(r["error"] for r in self.results if r["error"])
        firsts = [r["first_token_s"] for r in self.results if r["first_token_s"] is not None]
        return {
            "streams": len(self.results),
            "outcomes": dict(outcomes),
            "in_order": outcomes["complete"],
            "failed": len(self.results) - outcomes["complete"],
            "errors": dict(errors.most_common(5)),
            "dropped_notices": sum(r.get("dropped", 0) for r in self.results),
            "peak_open_at_once": self.peak,
            "wall_s": wall,
            "first_token": summary(firsts) if firsts else None,
            "stream_total": summary([r["total_s"] for r in self.results]),
        }


async def _read_stream(
    tally: Tally,
    expected: list[str],
    deadline: float,
    open_response: Callable[[], Any],
    deltas_of: Callable[[dict[str, Any]], str | None],
    is_end: Callable[[str], bool],
) -> None:
    """Read one SSE response to its end (or the deadline), keeping its deltas."""
    started = time.perf_counter()
    deltas: list[str] = []
    state: dict[str, Any] = {"ended": False, "first": None, "error": None}

    async def read() -> None:
        async with open_response() as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
            tally.opened()
            try:
                async for raw in r.content:
                    line = raw.decode().strip()
                    if is_end(line):
                        state["ended"] = True
                    elif line.startswith("data: "):
                        delta = deltas_of(json.loads(line[6:]))
                        if delta:
                            if state["first"] is None:
                                state["first"] = time.perf_counter() - started
                            deltas.append(delta)
            finally:
                tally.closed()

    try:
        await asyncio.wait_for(read(), max(0.1, deadline - time.monotonic()))
    except TimeoutError:
        pass  # unfinished: counted below
    except Exception as exc:  # a failed stream is counted, not fatal
        state["error"] = f"{type(exc).__name__}: {exc}"[:200]
    tally.results.append(
        {
            "outcome": verdict(deltas, expected, state["ended"]),
            "error": state["error"],
            "first_token_s": state["first"],
            "total_s": time.perf_counter() - started,
        }
    )


def _chat_delta(obj: dict[str, Any]) -> str | None:
    choices = obj.get("choices") or [{}]
    return choices[0].get("delta", {}).get("content")


async def _streams_chat(
    url: str, headers: dict[str, str], keys: list[str], words: int, timeout: float
) -> dict[str, Any]:
    """One streaming chat completion per session, all at once."""
    text, expected = words_of(words)
    tally = Tally()
    connector = aiohttp.TCPConnector(limit=len(keys) + 10)
    async with aiohttp.ClientSession(url, headers=headers, connector=connector) as http:
        deadline = time.monotonic() + timeout
        started = time.perf_counter()

        def opener(key: str) -> Callable[[], Any]:
            body = chat_body(text, True)
            return lambda: http.post(COMPLETIONS, json=body, headers={KEY_HEADER: key})

        await asyncio.gather(
            *(
                _read_stream(
                    tally, expected, deadline, opener(k), _chat_delta, lambda x: x == "data: [DONE]"
                )
                for k in keys
            )
        )
        return tally.summary(time.perf_counter() - started)


async def _streams_runs(
    url: str,
    headers: dict[str, str],
    keys: list[str],
    watchers: int,
    words: int,
    timeout: float,
    gate: float,
) -> dict[str, Any]:
    """One run per session, each watched by `watchers` event streams at once.
    Each session first runs `sleep <gate>`, so that its streaming run waits
    queued behind it while every watcher connects: the streams are all
    open before the first token (a late watcher would get a replay)."""
    text, expected = words_of(words)
    tally = Tally()
    connector = aiohttp.TCPConnector(limit=len(keys) * watchers + 10)
    async with aiohttp.ClientSession(url, headers=headers, connector=connector) as http:
        deadline = time.monotonic() + timeout
        started = time.perf_counter()

        async def start(key: str, text: str) -> str:
            async with http.post("/v1/runs", json={"input": text}, headers={KEY_HEADER: key}) as r:
                if r.status != 202:
                    raise RuntimeError(f"POST /v1/runs: {r.status} {await r.text()}")
                return str((await r.json())["run_id"])

        def opener(run_id: str) -> Callable[[], Any]:
            return lambda: http.get(f"/v1/runs/{run_id}/events")

        def delta(obj: dict[str, Any]) -> str | None:
            return obj.get("delta") if obj.get("event") == "message.delta" else None

        def end(line: str) -> bool:
            return line.startswith("data: ") and '"event": "run.completed"' in line

        if gate:
            await asyncio.gather(*(start(k, f"sleep {gate:g}") for k in keys))
        run_ids = await asyncio.gather(*(start(k, text) for k in keys))
        await asyncio.gather(
            *(
                _read_stream(tally, expected, deadline, opener(run_id), delta, end)
                for run_id in run_ids
                for _ in range(watchers)
            )
        )
        return tally.summary(time.perf_counter() - started)


async def _streams_zmq(
    state_dir: Path, keys: list[str], words: int, timeout: float
) -> dict[str, Any]:
    """The same turns as `_streams_chat` through one AsyncClient, the floor."""
    text, expected = words_of(words)
    tally = Tally()
    async with AsyncClient(state_dir, timeout=timeout) as client:
        deadline = time.monotonic() + timeout

        async def one(key: str) -> None:
            started = time.perf_counter()
            deltas: list[str] = []
            state: dict[str, Any] = {"ended": False, "first": None, "error": None, "dropped": 0}

            async def read() -> None:
                turn = await client.send(key, text)
                tally.opened()
                try:
                    async for event in turn:
                        if isinstance(event, Token):
                            if state["first"] is None:
                                state["first"] = time.perf_counter() - started
                            deltas.append(event.text)
                        elif isinstance(event, Reply):
                            state["ended"] = event.ok
                        elif event.type == "dropped":
                            state["dropped"] += 1
                finally:
                    tally.closed()

            try:
                await asyncio.wait_for(read(), max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                pass
            except Exception as exc:
                state["error"] = f"{type(exc).__name__}: {exc}"[:200]
            tally.results.append(
                {
                    "outcome": verdict(deltas, expected, state["ended"]),
                    "error": state["error"],
                    "dropped": state["dropped"],
                    "first_token_s": state["first"],
                    "total_s": time.perf_counter() - started,
                }
            )

        started = time.perf_counter()
        await asyncio.gather(*(one(k) for k in keys))
        return tally.summary(time.perf_counter() - started)


def _measured(pids: dict[str, int], run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`run`'s figures, with the load before and the memory of `pids` during it."""
    load = load_now()
    sampler = MemorySampler(pids)
    try:
        out = run()
    finally:
        memory = sampler.stop()
    return {**out, "load": load, "memory": memory}


def streams(
    stack: Stack,
    counts: tuple[int, ...],
    words: int,
    runs: int = 50,
    timeout: float = 120.0,
    gate: float = 5.0,
) -> dict[str, Any]:
    """SSE streams held at once, each checked in order:

    - runs: max(counts) streams of `GET /v1/runs/{id}/events`, watching
      `runs` runs (so max(counts)/runs watchers each, `runs` workers),
      all connected while a `sleep <gate>` turn holds the runs queued;
    - chat, for each of `counts`: that many streaming chat completions,
      one session (one worker) each, beside the same turns through one
      AsyncClient (zmq).

    A stream that has not ended `timeout` seconds after the start is
    counted unfinished."""
    both = {"endpoint": stack.endpoint.pid, "supervisor": stack.sup.pid}
    out: dict[str, Any] = {"words": words, "probe_pace_s": words * 0.02}  # probe.STREAM_DELAY
    biggest = max(counts)
    run_keys = [f"run-{i}" for i in range(runs)]
    asyncio.run(_warm(stack.url, stack.auth, run_keys, 16))
    watchers = max(1, biggest // runs)
    out["runs"] = _measured(
        both,
        lambda: asyncio.run(
            _streams_runs(stack.url, stack.auth, run_keys, watchers, words, timeout, gate)
        ),
    )
    out["runs"] |= {"runs": runs, "watchers_per_run": watchers, "gate_s": gate}
    keys = [f"sse-{i}" for i in range(biggest)]
    started = time.perf_counter()
    asyncio.run(_warm(stack.url, stack.auth, keys, 16))
    out["spawn_all_s"] = time.perf_counter() - started
    for count in counts:
        some = keys[:count]

        def http(some: list[str] = some) -> dict[str, Any]:
            return asyncio.run(_streams_chat(stack.url, stack.auth, some, words, timeout))

        def zmq(some: list[str] = some) -> dict[str, Any]:
            return asyncio.run(_streams_zmq(stack.state, some, words, timeout))

        out[f"chat_{count}"] = {
            "http": _measured(both, http),
            "zmq": _measured({"supervisor": stack.sup.pid}, zmq),
        }
    return out


# ---------------------------------------------------------------- turns/s


async def _turns_http(
    url: str, headers: dict[str, str], keys: list[str], total: int
) -> tuple[float, int]:
    """`total` non-streaming turns, one session per task; (seconds, done)."""
    left = [total]
    connector = aiohttp.TCPConnector(limit=len(keys) + 2)
    async with aiohttp.ClientSession(url, headers=headers, connector=connector) as http:

        async def worker(key: str) -> int:
            n = 0
            while left[0] > 0:
                left[0] -= 1
                async with http.post(
                    COMPLETIONS, json=chat_body("x"), headers={KEY_HEADER: key}
                ) as r:
                    body = await r.json()
                    assert r.status == 200 and body["choices"][0]["message"]["content"] == "x"
                n += 1
            return n

        started = time.perf_counter()
        done = await asyncio.gather(*(worker(k) for k in keys))
        return time.perf_counter() - started, sum(done)


async def _turns_zmq(state_dir: Path, keys: list[str], total: int) -> tuple[float, int]:
    left = [total]
    async with AsyncClient(state_dir, timeout=120) as client:

        async def worker(key: str) -> int:
            n = 0
            while left[0] > 0:
                left[0] -= 1
                assert (await client.run(key, "x")).text == "x"
                n += 1
            return n

        started = time.perf_counter()
        done = await asyncio.gather(*(worker(k) for k in keys))
        return time.perf_counter() - started, sum(done)


def turns_per_second(stack: Stack, concurrency: int, total: int, repeats: int) -> dict[str, Any]:
    """Turns/s at `concurrency` through the endpoint, the echo floor, the
    bridge floor and the Python client (AsyncClient), each run `repeats`
    times in turn; the median of each, and the CPU per turn of each server."""
    keys = [f"tp{concurrency}-{i}" for i in range(concurrency)]
    for url, headers in ((stack.url, stack.auth), (stack.bridge_url, {})):
        asyncio.run(_warm(url, headers, keys, concurrency))
    runs: dict[str, Callable[[], tuple[float, int]]] = {
        "echo_floor": lambda: asyncio.run(_turns_http(stack.echo_url, {}, keys, total)),
        "http": lambda: asyncio.run(_turns_http(stack.url, stack.auth, keys, total)),
        "http_uvloop": lambda: asyncio.run(_turns_http(stack.uv_url, stack.auth, keys, total)),
        "bridge_floor": lambda: asyncio.run(_turns_http(stack.bridge_url, {}, keys, total)),
        "zmq": lambda: asyncio.run(_turns_zmq(stack.state, keys, total)),
    }
    server = {"echo_floor": stack.echo.pid, "http": stack.endpoint.pid}
    server |= {"http_uvloop": stack.uv_endpoint.pid}
    server |= {"bridge_floor": stack.bridge.pid}
    rates: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    client_cpu: dict[str, list[float]] = {name: [] for name in runs}
    load = load_now()
    for _ in range(repeats):
        for name, run in runs.items():
            pids = [stack.sup.pid] + ([server[name]] if name in server else [])
            before = [cpu_seconds(p) for p in pids]
            mine = time.process_time()
            seconds, done = run()
            mine = time.process_time() - mine
            spent = [cpu_seconds(p) - b for p, b in zip(pids, before, strict=True)]
            rates[name].append(done / seconds)
            cpu[name].append(sum(spent) / done * 1e6)
            client_cpu[name].append(mine / done * 1e6)
    out: dict[str, Any] = {"load": load, "concurrency": concurrency, "turns": total}
    for name in runs:
        out[name] = {
            "turns_per_s": statistics.median(rates[name]),
            "all_turns_per_s": rates[name],
            "server_cpu_us_per_turn": statistics.median(cpu[name]),
            "client_cpu_us_per_turn": statistics.median(client_cpu[name]),
        }
    # The load here moves within seconds: each repeat's rate is divided by
    # the floor's from the same repeat, and the median of those is the ratio.
    floor = rates["echo_floor"]
    for name in ("http", "http_uvloop", "bridge_floor", "zmq"):
        out[name]["ratio_to_echo_floor"] = statistics.median(
            r / f for r, f in zip(rates[name], floor, strict=True)
        )
    out["http"]["ratio_to_zmq"] = statistics.median(
        r / z for r, z in zip(rates["http"], rates["zmq"], strict=True)
    )
    return out


# ---------------------------------------------------------------- report


def report(results: dict[str, Any]) -> None:
    rt = results.get("round_trip")
    if rt:
        print(f"round trip, one in flight (load {rt['load']['loadavg'][0]:.1f}):")
        for name in rt:
            if name in ("load", "cpu_us_per_request", "ab"):
                continue
            r = rt[name]
            added = f"  +{r['added_p50_ms']:.2f} ms p50" if "added_p50_ms" in r else ""
            paired = f" (paired {r['paired_added_p50_ms']:.2f})" if "added_p50_ms" in r else ""
            print(
                f"  {name:18} p50 {r['p50_ms']:6.2f}  p90 {r['p90_ms']:6.2f}  "
                f"p99 {r['p99_ms']:6.2f} ms{added}{paired}"
            )
        for name, us in rt["cpu_us_per_request"].items():
            print(f"  cpu {name}: {us:.0f} us/request")
        for name, ab in rt.get("ab", {}).items():
            print(
                f"  A/B {name}: this p50 {ab['this_p50_ms']:.2f} ms, B {ab['b_p50_ms']:.2f} ms, "
                f"paired difference p50 {ab['paired_diff_p50_ms']:+.3f} ms, "
                f"this faster in {ab['this_faster_share']:.0%}"
            )
    for server, prof in results.get("profile", {}).items():
        if not prof.get("samples"):
            print(f"profile of {server}: {prof}")
            continue
        print(f"profile of {server} ({prof['samples']} busy samples, {prof['idle_samples']} idle):")
        for name, share in prof["share_pct"].items():
            print(f"  {share:5.1f}%  {name}")
        for leaf, share in list(prof["top_leaves_pct"].items())[:8]:
            print(f"  {share:5.1f}%  leaf {leaf}")
    st = results.get("streams")
    if st:
        parts = [("runs", st["runs"])]
        parts += [(f"{k} {p}", v[p]) for k, v in st.items() if k.startswith("chat_") for p in v]
        for name, s_ in parts:
            print(
                f"streams {name}: {s_['outcomes']} of {s_['streams']}, peak "
                f"{s_['peak_open_at_once']} open at once, {s_['wall_s']:.1f} s "
                f"(load {s_['load']['loadavg'][0]:.1f}), errors {s_['errors']}"
            )
            for proc, m in s_["memory"].items():
                print(
                    f"  {proc}: RSS {m['rss_before_mib']:.0f} -> peak {m['rss_peak_mib']:.0f} "
                    f"-> {m['rss_after_mib']:.0f} MiB, fds peak {m['fds_peak']}"
                )
    for tp in results.get("turns_per_s", []):
        print(f"turns/s at concurrency {tp['concurrency']} (load {tp['load']['loadavg'][0]:.1f}):")
        for name in ("echo_floor", "http", "http_uvloop", "bridge_floor", "zmq"):
            r = tp[name]
            ratio = (
                f"  {r['ratio_to_echo_floor']:.2f}x the echo floor" if name != "echo_floor" else ""
            )
            print(
                f"  {name:12} {r['turns_per_s']:7.0f} turns/s, "
                f"CPU/turn: server {r['server_cpu_us_per_turn']:.0f} us, "
                f"client {r['client_cpu_us_per_turn']:.0f} us{ratio}"
            )


PARTS = ("round_trip", "turns", "streams")


def run_all(
    rounds: int,
    stream_counts: tuple[int, ...],
    words: int,
    turns: int,
    repeats: int,
    profile: str | None,
    concurrencies: tuple[int, ...] = (1, 16),
    parts: tuple[str, ...] = PARTS,
    stream_timeout: float = 120.0,
    ab_source: Path | None = None,
) -> dict[str, Any]:
    """The figures named in `parts`, on one stack; returns the results."""
    stack = Stack(ab_source=ab_source)
    try:
        results: dict[str, Any] = {
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "commit": _commit(),
        }
        if "round_trip" in parts:
            results["round_trip"] = round_trips(stack, rounds)
        if profile:
            turns_ = max(50, rounds // 4)
            results["profile"] = {
                "endpoint": profile_server(
                    stack, profile, stack.endpoint.pid, stack.url, stack.auth, turns_
                ),
                "bridge_floor": profile_server(
                    stack, profile, stack.bridge.pid, stack.bridge_url, {}, turns_
                ),
            }
            if stack.b_endpoint is not None and stack.b_url is not None:
                results["profile"]["endpoint_b"] = profile_server(
                    stack, profile, stack.b_endpoint.pid, stack.b_url, stack.auth, turns_
                )
        if "turns" in parts:
            results["turns_per_s"] = [
                turns_per_second(stack, c, turns, repeats) for c in concurrencies
            ]
        if "streams" in parts and stream_counts:
            results["streams"] = streams(stack, stream_counts, words, timeout=stream_timeout)
        return results
    finally:
        stack.close()


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        )
        return out.stdout.strip()
    except OSError:
        return ""


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.http", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="smaller counts, for a smoke run")
    parser.add_argument("--rounds", type=int, help="round-trip rounds (default 1,000; quick 200)")
    parser.add_argument(
        "--streams", help="SSE streams at once, comma-separated (default 250,1000; quick 100)"
    )
    parser.add_argument(
        "--stream-timeout", type=float, default=120.0, help="seconds, then a stream is unfinished"
    )
    parser.add_argument("--words", type=int, default=20, help="words each stream carries")
    parser.add_argument("--turns", type=int, help="turns per turns/s run (default 500; quick 200)")
    parser.add_argument("--repeats", type=int, default=10, help="turns/s runs of each, alternated")
    parser.add_argument(
        "--parts",
        default=",".join(PARTS),
        help=f"which figures, comma-separated (default {','.join(PARTS)})",
    )
    parser.add_argument(
        "--profile",
        nargs="?",
        const=shutil.which("py-spy") or "py-spy",
        metavar="PY_SPY",
        help="sample the endpoint with py-spy (path to it, if not on PATH)",
    )
    parser.add_argument(
        "--ab",
        type=Path,
        metavar="DIR",
        help="also serve another version's endpoint (DIR/hermes_sup, e.g. from `git archive "
        "COMMIT | tar -x -C DIR/hermes_sup`) against the same supervisor, and pair its round "
        "trips with this one's",
    )
    args = parser.parse_args()
    results = run_all(
        rounds=args.rounds or (200 if args.quick else 1000),
        stream_counts=tuple(
            int(n) for n in (args.streams or ("100" if args.quick else "250,1000")).split(",") if n
        ),
        stream_timeout=args.stream_timeout,
        words=args.words,
        turns=args.turns or (200 if args.quick else 500),
        repeats=args.repeats,
        profile=args.profile,
        parts=tuple(p.strip() for p in args.parts.split(",") if p.strip()),
        ab_source=args.ab,
    )
    report(results)
    RESULTS.mkdir(exist_ok=True)
    for server, prof in results.get("profile", {}).items():  # for flamegraph.pl
        (RESULTS / f"http-profile-{server}.txt").write_text(prof.pop("raw", ""))
    (RESULTS / "http.json").write_text(json.dumps(results, indent=2))
    print(f"wrote {RESULTS / 'http.json'}")


if __name__ == "__main__":
    main()
