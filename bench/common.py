"""What every benchmark here shares: percentiles, the measured supervisor,
CPU and memory readings, and stopping the processes a benchmark started.

Every percentile in bench/ is `pct`'s (nearest rank), so that a p99 means
the same in every results file. Times are taken with `time.perf_counter`
and CPU from the kernel's accounts (psutil or /proc), never from wall time.
"""

from __future__ import annotations

import math
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import psutil
import zmq

from hermes_sup.client import Client, ClientError
from hermes_sup.client.connection import Connection

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"


# ---------------------------------------------------------------- figures


def pct(values: Sequence[float], p: float) -> float:
    """The p-th percentile of `values` by nearest rank: the smallest value
    with at least p% of them at or below it (p50 of 1..5 is 3; p99 of 200
    values is the 198th smallest). No interpolation: every figure is a
    time that was measured."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    # round(): p / 100 * n in floating point may land a hair above a whole rank.
    rank = math.ceil(round(p / 100 * len(ordered), 9))
    return ordered[min(len(ordered), max(1, rank)) - 1]


def summary(seconds: Sequence[float]) -> dict[str, float]:
    """How a list of times in seconds is reported: count, p50, p90, p99,
    mean, min and max, in milliseconds."""
    return {
        "n": len(seconds),
        "p50_ms": pct(seconds, 50) * 1000,
        "p90_ms": pct(seconds, 90) * 1000,
        "p99_ms": pct(seconds, 99) * 1000,
        "mean_ms": statistics.fmean(seconds) * 1000,
        "min_ms": min(seconds) * 1000,
        "max_ms": max(seconds) * 1000,
    }


# ---------------------------------------------------------------- CPU and the machine


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU time of these processes (all their threads) so far."""
    total = 0.0
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


def context_switches(pid: int) -> int:
    """Context switches of every thread of a process so far: how often it
    was woken, which on a shared VM costs more than the work it then does."""
    total = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        for line in status.read_text().splitlines():
            if "ctxt_switches:" in line:
                total += int(line.split()[1])
    return total


def proc_usage(pid: int) -> tuple[int, int, int, float]:
    """RSS (KiB), open fds, threads and CPU seconds of a process, read from
    /proc directly (cheap enough to sample every few seconds for hours)."""
    rss = threads = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return rss, fds, threads, cpu


def cpu_ticks() -> list[int]:
    """The machine's CPU time by kind since boot (/proc/stat), in ticks."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def stolen_pct(before: list[int]) -> float:
    """Percent of CPU time since `before` that the hypervisor ran something
    else on our virtual CPUs ("steal"): on a shared VM it slows every step
    of whatever runs at the moment, which is how it shows in p99."""
    delta = [b - a for a, b in zip(before, cpu_ticks(), strict=True)]
    return 100.0 * delta[7] / max(1, sum(delta))


def machine() -> dict[str, Any]:
    """The machine a run was taken on, for its results file."""
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "load": os.getloadavg(),
    }


def load_now() -> dict[str, Any]:
    """The machine's load when a figure was taken (shared: other work runs)."""
    one, five, fifteen = os.getloadavg()
    return {"loadavg": [one, five, fifteen], "cpus": os.cpu_count()}


class MemorySampler:
    """The RSS of some processes (and their open fds) before, at the peak
    and after a stretch of work, sampled in a thread every `every` seconds."""

    def __init__(self, pids: dict[str, int], every: float = 0.1, fds: bool = True) -> None:
        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.fds = fds
        self.before = self._rss()
        self.peak = dict(self.before)
        self.peak_fds = {name: self._fds(p) for name, p in self.procs.items()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every,), daemon=True)
        self._thread.start()

    def _rss(self) -> dict[str, int]:
        return {name: p.memory_info().rss for name, p in self.procs.items()}

    def _fds(self, proc: psutil.Process) -> int:
        return proc.num_fds() if self.fds else 0

    def _run(self, every: float) -> None:
        while not self._stop.wait(every):
            try:
                for name, rss in self._rss().items():
                    self.peak[name] = max(self.peak[name], rss)
                for name, p in self.procs.items():
                    self.peak_fds[name] = max(self.peak_fds[name], self._fds(p))
            except psutil.Error:
                return  # a process ended: its peak is what was seen

    def stop(self) -> dict[str, dict[str, float]]:
        """Stop sampling; each process's RSS in MiB (and its peak fds)."""
        self._stop.set()
        self._thread.join()
        after = self._rss()
        mib = 1 / 2**20
        out: dict[str, dict[str, float]] = {}
        for name in self.procs:
            out[name] = {
                "rss_before_mib": self.before[name] * mib,
                "rss_peak_mib": max(self.peak[name], after[name]) * mib,
                "rss_after_mib": after[name] * mib,
            }
            if self.fds:
                out[name]["fds_peak"] = self.peak_fds[name]
        return out


# ---------------------------------------------------------------- the proxy floor


# The floor of every routed figure: a ROUTER-to-ROUTER proxy in a few lines
# of pyzmq that forwards frames without reading them, between clients on
# argv[1] and peers (echo workers, streams) on argv[2]; argv[3], if given,
# the high-water mark of both sockets (a fan-in's bursts outgrow zmq's 1,000).
BARE_PROXY = r"""
import sys, zmq
ctx = zmq.Context()
front = ctx.socket(zmq.ROUTER); front.bind(sys.argv[1])
back = ctx.socket(zmq.ROUTER); back.bind(sys.argv[2])
if len(sys.argv) > 3:
    for s in (front, back):
        s.setsockopt(zmq.SNDHWM, int(sys.argv[3])); s.setsockopt(zmq.RCVHWM, int(sys.argv[3]))
poller = zmq.Poller(); poller.register(front, zmq.POLLIN); poller.register(back, zmq.POLLIN)
while True:
    for sock, _ in poller.poll():
        if sock is front:   # [client, peer, payload] -> [peer, client, payload]
            client, peer, payload = front.recv_multipart()
            back.send_multipart([peer, client, payload])
        else:               # [peer, client, payload] -> [client, peer, payload]
            peer, client, payload = back.recv_multipart()
            front.send_multipart([client, peer, payload])
"""


class ProxyFloor:
    """A floor's processes: the bare proxy on ipc sockets in a temp dir of
    its own (`hwm`: see BARE_PROXY), what the floor puts behind it
    (`start`), and the floor's own DEALER (`client`, not yet connected);
    `close` ends them all."""

    def __init__(self, prefix: str, hwm: int | None = None) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
        self.front, self.back = f"ipc://{self.tmp}/front", f"ipc://{self.tmp}/back"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.start(BARE_PROXY, self.front, self.back, *([] if hwm is None else [str(hwm)]))
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.client = self.ctx.socket(zmq.DEALER)
        self.client.setsockopt(zmq.LINGER, 0)

    def start(self, script: str, *args: str) -> subprocess.Popen[bytes]:
        """Another process of the floor: `python -c script args`."""
        proc = subprocess.Popen([sys.executable, "-c", script, *args])
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        """Close the client, kill the floor's processes, remove the temp dir."""
        self.client.close(0)
        self.ctx.term()
        for p in self.procs:
            p.kill()
            p.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)


# ---------------------------------------------------------------- processes


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def answers(
    state: Path | None = None, *, connection: Connection | None = None, timeout: float = 1.0
) -> bool:
    """Whether the supervisor (or router) on `state` or `connection` answers a ping."""
    try:
        with Client(state, connection=connection, timeout=timeout) as c:
            c.ping()
        return True
    except (ClientError, OSError):
        return False


def wait_until(
    ready: Callable[[], bool],
    what: str,
    proc: subprocess.Popen[bytes] | None = None,
    timeout: float = 60.0,
) -> None:
    """Poll `ready` until it holds; fail at once if `proc` (what should make
    it hold) exits, or after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not answer within {timeout:g} s")
        time.sleep(0.05)


def stop(proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    """SIGTERM a process this benchmark started, if it still runs, and reap
    it; SIGKILL it if it is still there after `timeout` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Sup:
    """A real supervisor (`hermes-sup serve`) for a benchmark to measure.

    By default it runs on a temporary directory of its own under $HSB_DIR
    (default /tmp; /dev/shm puts its files on tmpfs), state in `s`, data in
    `d`, its output in `log`, and `close` removes it. Given `root`, it runs
    there and leaves the directory to the caller (who may share it among
    several supervisors, with `state`, `data` and `log` apart or shared).
    `python` runs another install's supervisor (bench/ab.py); `log_level`
    None leaves the supervisor's default. It is ready once it answers a
    ping; `timeout` is how long that may take (a sealed zygote that
    imports Hermes takes seconds)."""

    def __init__(
        self,
        *args: str,
        python: str = sys.executable,
        root: Path | None = None,
        state: Path | None = None,
        data: Path | None = None,
        log: Path | None = None,
        log_level: str | None = "warning",
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        timeout: float = 30.0,
    ) -> None:
        self.owns_root = root is None
        if root is None:
            root = Path(tempfile.mkdtemp(prefix="hsb-", dir=os.environ.get("HSB_DIR", "/tmp")))
        self.root = root
        self.state = state or root / "s"
        self.log = log or root / "log"
        cmd = [python, "-m", "hermes_sup.cli", "--state-dir", str(self.state), "serve"]
        cmd += ["--data-dir", str(data or root / "d")]
        cmd += ["--log-level", log_level] if log_level else []
        with open(self.log, "ab") as out:
            self.proc: subprocess.Popen[bytes] = subprocess.Popen(
                [*cmd, *args], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd
            )
        try:
            wait_until(lambda: answers(self.state), "the supervisor", self.proc, timeout)
        except RuntimeError as exc:
            stop(self.proc)
            text = self.log.read_text(errors="replace")
            self.close()
            raise RuntimeError(f"{exc} (serve {' '.join(args)}); its log:\n{text}") from None
        except BaseException:  # interrupted: leave nothing running
            self.close()
            raise

    def client(self, timeout: float = 60.0) -> Client:
        """A new blocking client of this supervisor."""
        return Client(self.state, timeout=timeout)

    def worker_pids(self) -> list[int]:
        """The pids of its sessions' workers, as `list` names them."""
        with self.client() as c:
            return [r["pid"] for r in c.sessions() if r["pid"]]

    def close(self) -> None:
        """Stop it (its workers and zygote go with it) and remove its
        directory if it made it."""
        stop(self.proc)
        if self.owns_root:
            shutil.rmtree(self.root, ignore_errors=True)
