"""hermes-sup benchmarks, each measured next to its floor in the same run.

    make bench                   # everything (a few minutes)
    python bench/run.py --quick  # smaller counts, for a smoke run
    python bench/run.py --only spawn       # just spawns (no peers) next to the bare fork
    python bench/run.py --only round_trip  # just round trips next to the bare proxy

Prints a table and writes bench/results/latest.json. Machines here are
shared and noisy: repeat, report p50 and p99, and judge by ratios to a floor
measured side by side, never by absolute times.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import zmq

from hermes_sup.client import Client
from hermes_sup.protocol import Kind

RESULTS = Path(__file__).parent / "results"


def pct(values: list[float], p: float) -> float:
    """The p-th percentile (nearest rank) of values."""
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(p / 100 * len(ordered)) - 1))
    return ordered[index]


def summary(values: list[float]) -> dict[str, float]:
    """p50/p99/mean of a list of seconds, in milliseconds."""
    return {
        "n": len(values),
        "p50_ms": pct(values, 50) * 1000,
        "p99_ms": pct(values, 99) * 1000,
        "mean_ms": statistics.fmean(values) * 1000,
    }


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


# ---------------------------------------------------------------- supervisor


class Sup:
    """A real supervisor for the benchmark, on a private temp dir."""

    def __init__(self, *args: str, python: str = sys.executable) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="hsb-", dir=os.environ.get("HSB_DIR", "/tmp")))
        self.state = self.root / "s"
        cmd = [
            python,
            "-m",
            "hermes_sup.cli",
            "--state-dir",
            str(self.state),
            "serve",
            "--data-dir",
            str(self.root / "d"),
            "--log-level",
            "warning",
            *args,
        ]
        self.proc = subprocess.Popen(cmd, stderr=open(self.root / "log", "wb"))  # noqa: SIM115
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with Client(self.state, timeout=1) as c:
                    c.ping()
                return
            except Exception:
                time.sleep(0.05)
        raise RuntimeError((self.root / "log").read_text())

    def client(self) -> Client:
        return Client(self.state, timeout=60)

    def worker_pids(self) -> list[int]:
        with self.client() as c:
            return [r["pid"] for r in c.sessions() if r["pid"]]

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)


def spawn_hermes_sup(sup: Sup, count: int, prefix: str, gap: float = 0.0) -> list[float]:
    """First message to a new key -> its reply, one key at a time, `gap`
    seconds apart (0: back to back)."""
    times = []
    with sup.client() as c:
        for i in range(count):
            time.sleep(gap)
            started = time.perf_counter()
            reply = c.run(f"{prefix}{i}", "pid")
            times.append(time.perf_counter() - started)
            assert reply.ok
    return times


def spawn_without_spares(count: int) -> dict[str, Any]:
    """The same from a supervisor told `--spare-workers 0`: every new
    session's worker forked on its way (the default before spares were)."""
    sup = Sup("--spare-workers", "0")
    try:
        return summary(spawn_hermes_sup(sup, count, "nospare"))
    finally:
        sup.close()


def spawn_with_spares(count: int) -> dict[str, Any]:
    """The same, from a supervisor keeping 2 spare workers: new sessions
    20 ms apart (the pool refills between them), then back to back."""
    sup = Sup("--spare-workers", "2")
    try:
        with sup.client() as c:
            deadline = time.monotonic() + 10
            while c.status()["spare_workers"] < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
        return {
            "spaced": summary(spawn_hermes_sup(sup, count, "spaced", gap=0.02)),
            "back_to_back": summary(spawn_hermes_sup(sup, count, "burst")),
        }
    finally:
        sup.close()


# ---------------------------------------------------------------- floors


FORKER = r"""
import gc, os, sys, zmq, msgpack  # preloaded like our zygote; no context yet
gc.collect(); gc.freeze()
endpoint = sys.argv[1]
for line in sys.stdin:
    pid = os.fork()
    if pid == 0:
        ctx = zmq.Context(); s = ctx.socket(zmq.DEALER); s.setsockopt(zmq.LINGER, 1000)
        s.connect(endpoint); s.send(b"hello"); s.send(s.recv()); s.close(); ctx.term()
        os._exit(0)
    os.waitpid(pid, os.WNOHANG)
    sys.stdout.write("%d\n" % pid); sys.stdout.flush()
"""


def _answer_ping(router: zmq.Socket) -> None:
    ident, hello = router.recv_multipart()
    router.send_multipart([ident, b"ping"])
    router.recv_multipart()


def spawn_bare_fork(count: int) -> list[float]:
    """Floor: a preloaded, gc-frozen process forks a child that answers over zmq."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    forker = subprocess.Popen(
        [sys.executable, "-c", FORKER, endpoint],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    times = []
    try:
        for _ in range(count):
            started = time.perf_counter()
            forker.stdin.write("go\n")
            forker.stdin.flush()
            _answer_ping(router)
            times.append(time.perf_counter() - started)
            forker.stdout.readline()
    finally:
        forker.stdin.close()
        forker.wait()
        router.close(0)
        ctx.term()
    return times


def spawn_multiprocessing(method: str, count: int) -> list[float]:
    """Peer: multiprocessing's `spawn` or (warm) `forkserver` start method,
    run from bench/mp_peer.py so its children re-import only that."""
    out = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("mp_peer.py")), method, str(count)],
        capture_output=True,
        text=True,
        check=True,
    )
    return [float(t) for t in json.loads(out.stdout)]


CHILD = r"""
import sys, zmq
ctx = zmq.Context(); s = ctx.socket(zmq.DEALER); s.setsockopt(zmq.LINGER, 1000)
s.connect(sys.argv[1]); s.send(b"hello"); s.send(s.recv()); s.close(); ctx.term()
"""


def spawn_circus(count: int) -> list[float] | None:
    """Peer (bench extra): a circus watcher added with start=True, from the
    `add` command to its process answering over zmq."""
    try:
        from circus.client import CircusClient
    except ImportError:
        return None
    tmp = Path(tempfile.mkdtemp(prefix="hsc-", dir="/tmp"))
    ini = tmp / "circus.ini"
    ini.write_text(
        f"[circus]\nendpoint = ipc://{tmp}/ctl\npubsub_endpoint = ipc://{tmp}/pub\n"
        "check_delay = 0\nstatsd = False\n"
    )
    daemon = subprocess.Popen(
        [sys.executable, "-m", "circus.circusd", str(ini)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    child = tmp / "child.py"
    child.write_text(CHILD)
    client = CircusClient(endpoint=f"ipc://{tmp}/ctl", timeout=30)
    times = []
    try:
        deadline = time.monotonic() + 30
        while client.call({"command": "list", "properties": {}}).get("status") != "ok":
            if time.monotonic() > deadline:
                raise RuntimeError("circusd did not answer")
            time.sleep(0.1)
        for i in range(count):
            started = time.perf_counter()
            answer = client.call(
                {
                    "command": "add",
                    "properties": {
                        "name": f"w{i}",
                        "cmd": f"{sys.executable} {child} tcp://127.0.0.1:{port}",
                        "start": True,
                        "options": {"respawn": False},
                    },
                }
            )
            assert answer.get("status") == "ok", answer
            _answer_ping(router)
            times.append(time.perf_counter() - started)
            client.call({"command": "rm", "properties": {"name": f"w{i}", "waiting": True}})
    finally:
        try:
            client.call({"command": "quit", "properties": {}})
        except Exception:
            pass
        client.stop()
        try:
            daemon.wait(20)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        router.close(0)
        ctx.term()
        shutil.rmtree(tmp, ignore_errors=True)
    return times


def spawn_jupyter(count: int) -> list[float] | None:
    """Peer (bench extra): a Jupyter kernel, from start to ready (its
    kernel_info answered over zmq)."""
    try:
        from jupyter_client.manager import start_new_kernel
    except ImportError:
        return None
    times = []
    for _ in range(count):
        started = time.perf_counter()
        km, kc = start_new_kernel(kernel_name="python3", startup_timeout=60)
        times.append(time.perf_counter() - started)
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    return times


# ---------------------------------------------------------------- round trips


PROXY = r"""
import sys, zmq
ctx = zmq.Context()
front = ctx.socket(zmq.ROUTER); front.bind(sys.argv[1])
back = ctx.socket(zmq.ROUTER); back.bind(sys.argv[2])
poller = zmq.Poller(); poller.register(front, zmq.POLLIN); poller.register(back, zmq.POLLIN)
while True:
    for sock, _ in poller.poll():
        if sock is front:   # [client, worker, payload] -> [worker, client, payload]
            client, worker, payload = front.recv_multipart()
            back.send_multipart([worker, client, payload])
        else:               # [worker, client, payload] -> [client, worker, payload]
            worker, client, payload = back.recv_multipart()
            front.send_multipart([client, worker, payload])
"""

ECHO = r"""
import sys, zmq
ctx = zmq.Context(); s = ctx.socket(zmq.DEALER)
s.setsockopt(zmq.ROUTING_ID, sys.argv[2].encode()); s.connect(sys.argv[1])
s.send_multipart([b"", b"ready"])
while True:
    client, payload = s.recv_multipart()
    s.send_multipart([client, payload])
"""


def proxy_floor(sessions: int, count: int, window: int) -> dict[str, Any]:
    """Floor: a bare ROUTER-to-ROUTER proxy forwarding frames to echo workers."""
    tmp = Path(tempfile.mkdtemp(prefix="hsp-", dir="/tmp"))
    front_ep, back_ep = f"ipc://{tmp}/front", f"ipc://{tmp}/back"
    procs = [subprocess.Popen([sys.executable, "-c", PROXY, front_ep, back_ep])]
    time.sleep(0.3)
    names = [f"w{i}" for i in range(sessions)]
    procs += [subprocess.Popen([sys.executable, "-c", ECHO, back_ep, n]) for n in names]
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(front_ep)
    try:
        time.sleep(0.5 + sessions * 0.02)  # let the echo workers connect
        # One warm-up each, resent until it is answered: the proxy drops a
        # message to an echo worker that has not connected yet (under load
        # the sleep above is not enough), and a recv for it never returned.
        for n in names:
            while True:
                s.send_multipart([n.encode(), b"x"])
                if s.poll(1000):
                    s.recv_multipart()
                    break
        while s.poll(300):  # a late second answer to a resent warm-up
            s.recv_multipart()
        return _drive(
            lambda i: s.send_multipart([names[i % sessions].encode(), b"x"]),
            lambda: s.recv_multipart(),
            count,
            window,
            router=[procs[0].pid],
            workers=[p.pid for p in procs[1:]],
        )
    finally:
        s.close(0)
        ctx.term()
        for p in procs:
            p.kill()
            p.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def routed(sup: Sup, sessions: int, count: int, window: int, ack: bool = True) -> dict[str, Any]:
    """hermes-sup: client -> supervisor -> probe worker (echo) -> client.
    `ack=False` sends `ack: false`: no `running` event a turn."""
    keys = [f"rt{sessions}{'' if ack else 'q'}-{i}" for i in range(sessions)]
    body: dict[str, Any] = {"text": "x"} if ack else {"text": "x", "ack": False}
    with sup.client() as c:
        for k in keys:
            c.run(k, "x")

        def send(i: int) -> None:
            c.submit(Kind.SEND, body, session=keys[i % sessions])

        def recv() -> None:
            while c.next().kind is Kind.EVENT:
                pass

        rows = {r["key"]: r["pid"] for r in c.sessions()}
        return _drive(
            send,
            recv,
            count,
            window,
            router=[sup.proc.pid],
            workers=[rows[k] for k in keys],
        )


def ack_paired(sup: Sup, count: int) -> dict[str, Any]:
    """Round trips of one session, one in flight, alternating a `send` with
    the `running` acknowledgement and one with `ack: false`, so that each
    pair ran under the same load; and the messages a turn cost each way."""
    key = "ack-1"
    times: dict[bool, list[float]] = {True: [], False: []}
    messages: dict[bool, int] = {True: 0, False: 0}
    with sup.client() as c:
        c.run(key, "x")
        for i in range(count * 2):
            ack = i % 2 == 0
            body: dict[str, Any] = {"text": "x"} if ack else {"text": "x", "ack": False}
            started = time.perf_counter()
            c.submit(Kind.SEND, body, session=key)
            got = 1
            while c.next().kind is Kind.EVENT:
                got += 1
            times[ack].append(time.perf_counter() - started)
            messages[ack] = got
    diffs = [a - b for a, b in zip(times[True], times[False], strict=True)]
    return {
        "ack": summary(times[True]),
        "no_ack": summary(times[False]),
        "median_paired_saving_ms": statistics.median(diffs) * 1e3,
        "messages_to_client": {"ack": messages[True], "no_ack": messages[False]},
    }


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of these processes (and their threads)."""
    total = 0.0
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


def _drive(
    send: Any, recv: Any, count: int, window: int, router: list[int], workers: list[int]
) -> dict[str, Any]:
    """Latency with one request in flight, then throughput with `window` in
    flight; and the CPU each part spent per message in the throughput phase
    (CPU time is far less noisy here than wall time)."""
    lat = []
    for i in range(count):
        started = time.perf_counter()
        send(i)
        recv()
        lat.append(time.perf_counter() - started)
    total = count * 4
    cpu_before = (cpu_seconds(router), cpu_seconds(workers), time.process_time())
    started = time.perf_counter()
    sent = done = 0
    while done < total:
        while sent < total and sent - done < window:
            send(sent)
            sent += 1
        recv()
        done += 1
    rate = total / (time.perf_counter() - started)
    cpu_after = (cpu_seconds(router), cpu_seconds(workers), time.process_time())
    per = [(a - b) / total * 1e6 for a, b in zip(cpu_after, cpu_before, strict=True)]
    return {
        "latency": summary(lat),
        "throughput_per_s": rate,
        "cpu_us_per_message": {"router": per[0], "workers": per[1], "client": per[2]},
    }


# ---------------------------------------------------------------- memory


def memory_of(pids: list[int]) -> dict[str, float]:
    """Median USS and PSS (MiB) of the given processes, and their minor page
    faults so far: for a worker forked from the zygote, nearly all of them
    are copy-on-write copies of its pages. Unlike a time, that count repeats
    within a few faults from run to run, so it shows small changes to what
    a worker touches where timings on this machine cannot."""
    uss, pss, faults = [], [], []
    for pid in pids:
        try:
            info = psutil.Process(pid).memory_full_info()
            with open(f"/proc/{pid}/stat") as f:
                faults.append(int(f.read().rsplit(")", 1)[1].split()[7]))  # minflt
        except (psutil.Error, OSError):
            continue
        uss.append(info.uss / 2**20)
        pss.append(info.pss / 2**20)
    return {
        "n": len(uss),
        "uss_mib_p50": statistics.median(uss),
        "pss_mib_p50": statistics.median(pss),
        "uss_mib_max": max(uss),
        "minor_faults_p50": statistics.median(faults),
    }


def supervisor_usage(sup: Sup) -> dict[str, float]:
    p = psutil.Process(sup.proc.pid)
    return {"rss_mib": p.memory_info().rss / 2**20, "fds": p.num_fds()}


# ---------------------------------------------------------------- hermes


def hermes_bench(count: int) -> dict[str, Any] | None:
    """Ready time and idle memory of hermes sessions (no model call needed)."""
    try:
        import importlib.util

        if importlib.util.find_spec("run_agent") is None:
            return None
    except Exception:
        return None
    sup = Sup("--agent", "hermes")
    try:
        times = []
        with sup.client() as c:
            for i in range(count):
                started = time.perf_counter()
                c.open(f"h{i}")
                while c.sessions(prefix=f"h{i}")[0]["state"] != "idle":
                    time.sleep(0.002)
                times.append(time.perf_counter() - started)
        time.sleep(1)
        return {"ready": summary(times), "memory": memory_of(sup.worker_pids())}
    finally:
        sup.close()


# ---------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="small counts (smoke run)")
    parser.add_argument("--skip-scale", action="store_true")
    parser.add_argument(
        "--only",
        choices=("spawn", "round_trip"),
        help="just this figure and its floor (spawn: without peers), for a quick check",
    )
    args = parser.parse_args()
    # Killed (a timeout's SIGTERM), still stop the supervisors and the floor's
    # processes in the `finally`s: they would outlive us otherwise.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    q = args.quick
    n_spawn = 50 if q else 200
    n_rt = 500 if q else 2000
    out: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "kernel": platform.release(),
            "load": os.getloadavg(),
        },
    }
    gc.collect()

    sup = Sup()
    try:
        if args.only in (None, "spawn"):
            out["spawn"] = measure_spawns(sup, n_spawn, peers=args.only is None)
        if args.only in (None, "round_trip"):
            out["round_trip"] = measure_round_trips(sup, n_rt)
        if args.only is None:
            print("memory ...", flush=True)
            time.sleep(1)
            pids = sup.worker_pids()[:50]
            out["memory"] = {"probe_idle_50": memory_of(pids)}
    finally:
        sup.close()

    if args.only is None and not args.skip_scale:
        print("scale ...", flush=True)
        out["scale"] = scale(200 if q else 2000, n_rt // 10)
        out["memory"]["probe_idle_1000"] = out["scale"].pop("memory_at_1000", None)

    if args.only is None:
        print("hermes ...", flush=True)
        out["hermes"] = hermes_bench(5 if q else 20)

    RESULTS.mkdir(exist_ok=True)
    name = "latest.json" if args.only is None else f"latest-{args.only}.json"
    (RESULTS / name).write_text(json.dumps(out, indent=2))
    print_table(out)
    print(f"\nfull results: {RESULTS / name}")
    return 0


def measure_spawns(sup: Sup, n_spawn: int, peers: bool) -> dict[str, Any]:
    """Spawns of `sup` (default settings: spare workers on), of one with
    none and one with 2, next to the bare fork floor (and the peers)."""
    print("spawn ...", flush=True)
    ticks = cpu_ticks()
    floor = spawn_bare_fork(n_spawn)
    with sup.client() as c:  # the default spares, ready, as on a serving machine
        deadline = time.monotonic() + 10
        while c.status()["spare_workers"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
    ours = spawn_hermes_sup(sup, n_spawn, "sp")
    out: dict[str, Any] = {"bare_fork_floor": summary(floor), "hermes_sup": summary(ours)}
    if peers:
        out["forkserver_warm"] = summary(spawn_multiprocessing("forkserver", n_spawn))
        out["mp_spawn"] = summary(spawn_multiprocessing("spawn", max(10, n_spawn // 4)))
        # Peers from the `bench` extra, when it is installed.
        for name, measure in (("circus", spawn_circus), ("jupyter", spawn_jupyter)):
            times = measure(max(5, n_spawn // 10))
            if times is not None:
                out[name] = summary(times)
    out["ratio_p50_to_floor"] = out["hermes_sup"]["p50_ms"] / out["bare_fork_floor"]["p50_ms"]
    out["ratio_p99_to_floor"] = out["hermes_sup"]["p99_ms"] / out["bare_fork_floor"]["p99_ms"]
    out["hermes_sup_no_spares"] = spawn_without_spares(n_spawn)
    out["hermes_sup_2_spares"] = spawn_with_spares(n_spawn)
    out["cpu_stolen_pct"] = stolen_pct(ticks)
    return out


def measure_round_trips(sup: Sup, n_rt: int) -> dict[str, Any]:
    """Round trips and throughput with 1 and 64 sessions next to the bare
    proxy, and what the `running` acknowledgement costs one session."""
    print("round trips ...", flush=True)
    rt: dict[str, Any] = {}
    for sessions in (1, 64):
        rt[f"floor_{sessions}"] = proxy_floor(sessions, n_rt, 256)
        rt[f"hermes_sup_{sessions}"] = routed(sup, sessions, n_rt, 256)
        rt[f"ratio_p50_{sessions}"] = (
            rt[f"hermes_sup_{sessions}"]["latency"]["p50_ms"]
            / rt[f"floor_{sessions}"]["latency"]["p50_ms"]
        )
        rt[f"ratio_throughput_{sessions}"] = (
            rt[f"hermes_sup_{sessions}"]["throughput_per_s"]
            / rt[f"floor_{sessions}"]["throughput_per_s"]
        )
    rt["hermes_sup_1_no_ack"] = routed(sup, 1, n_rt, 256, ack=False)
    rt["ratio_p50_1_no_ack"] = (
        rt["hermes_sup_1_no_ack"]["latency"]["p50_ms"] / rt["floor_1"]["latency"]["p50_ms"]
    )
    rt["ack_paired"] = ack_paired(sup, n_rt // 2)
    return rt


def spawn_rows(s: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    rows = [
        (
            "spawn p50 ms (default spares)",
            f"{s['hermes_sup']['p50_ms']:.2f}",
            f"{s['bare_fork_floor']['p50_ms']:.2f} bare fork",
            f"{s['ratio_p50_to_floor']:.2f}x",
        ),
        (
            "spawn p99 ms (default spares)",
            f"{s['hermes_sup']['p99_ms']:.2f}",
            f"{s['bare_fork_floor']['p99_ms']:.2f} bare fork",
            f"{s['ratio_p99_to_floor']:.2f}x" if "ratio_p99_to_floor" in s else "",
        ),
    ]
    floor_p50 = s["bare_fork_floor"]["p50_ms"]
    none = s.get("hermes_sup_no_spares")
    if none:
        rows.append(
            (
                "  with --spare-workers 0: p50 (p99)",
                f"{none['p50_ms']:.2f} ({none['p99_ms']:.1f})",
                "",
                f"{none['p50_ms'] / floor_p50:.2f}x",
            )
        )
    for mode, label in (("spaced", "20 ms apart"), ("back_to_back", "back to back")):
        spared = s.get("hermes_sup_2_spares", {}).get(mode)
        if spared:
            rows.append(
                (
                    f"  with 2 spares, {label}: p50 (p99)",
                    f"{spared['p50_ms']:.2f} ({spared['p99_ms']:.1f})",
                    "",
                    f"{spared['p50_ms'] / floor_p50:.2f}x",
                )
            )
    if "cpu_stolen_pct" in s:
        rows.append(("  CPU stolen by the host, %", f"{s['cpu_stolen_pct']:.1f}", "", ""))
    for name, label in (
        ("forkserver_warm", "warm forkserver"),
        ("mp_spawn", "mp spawn"),
        ("circus", "circus watcher"),
        ("jupyter", "Jupyter kernel"),
    ):
        if name in s:
            rows.append(("", "", f"{s[name]['p50_ms']:.2f} {label}", ""))
    return rows


def round_trip_rows(r: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    rows = []
    for n in (1, 64):
        ours, floor = r[f"hermes_sup_{n}"], r[f"floor_{n}"]
        rows.append(
            (
                f"round trip p50 ms, {n} sess",
                f"{ours['latency']['p50_ms']:.3f}",
                f"{floor['latency']['p50_ms']:.3f} bare proxy",
                f"{r[f'ratio_p50_{n}']:.2f}x",
            )
        )
        if n == 1 and "hermes_sup_1_no_ack" in r:
            rows.append(
                (
                    "  with ack: false",
                    f"{r['hermes_sup_1_no_ack']['latency']['p50_ms']:.3f}",
                    "",
                    f"{r['ratio_p50_1_no_ack']:.2f}x",
                )
            )
        rows.append(
            (
                f"throughput msg/s, {n} sess",
                f"{ours['throughput_per_s']:.0f}",
                f"{floor['throughput_per_s']:.0f} bare proxy",
                f"{r[f'ratio_throughput_{n}']:.2f}x",
            )
        )
        for part in ("router", "workers", "client"):
            mine, base = ours["cpu_us_per_message"][part], floor["cpu_us_per_message"][part]
            rows.append(
                (
                    f"  CPU us/msg {part}, {n} sess",
                    f"{mine:.0f}",
                    f"{base:.0f} bare proxy",
                    f"{mine / base:.1f}x" if base > 0 else "",
                )
            )
    paired = r.get("ack_paired")
    if paired:
        rows.append(
            (
                "  paired: ack / ack: false p50 ms",
                f"{paired['ack']['p50_ms']:.3f} / {paired['no_ack']['p50_ms']:.3f}",
                f"saving {paired['median_paired_saving_ms'] * 1e3:.0f} us",
                "",
            )
        )
    return rows


def print_table(out: dict[str, Any]) -> None:
    """The figures that matter, with their floors and the ratio between."""
    rows: list[tuple[str, str, str, str]] = [("figure", "hermes-sup", "floor/peer", "ratio")]
    if "spawn" in out:
        rows += spawn_rows(out["spawn"])
    if "round_trip" in out:
        rows += round_trip_rows(out["round_trip"])
    for name, mem in out.get("memory", {}).items():
        if mem:
            rows.append(
                (
                    f"USS MiB, {name}",
                    f"{mem['uss_mib_p50']:.2f}",
                    f"PSS {mem['pss_mib_p50']:.2f}",
                    f"{mem.get('minor_faults_p50', 0):.0f} faults",
                )
            )
    for size, sc in out.get("scale", {}).items():
        rows.append(
            (
                f"at {size}: spawn p99 / rtt p99 ms",
                f"{sc['spawn_last_batch']['p99_ms']:.1f} / {sc['round_trip']['p99_ms']:.1f}",
                f"sup {sc['supervisor']['rss_mib']:.0f} MiB, {sc['supervisor']['fds']} fds",
                "",
            )
        )
    h = out.get("hermes")
    if h:
        rows.append(("hermes ready p50 ms", f"{h['ready']['p50_ms']:.0f}", "", ""))
        rows.append(("hermes idle USS MiB", f"{h['memory']['uss_mib_p50']:.1f}", "", ""))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip())


def scale(total: int, pings: int) -> dict[str, Any]:
    """Spawn up to `total` idle sessions; at checkpoints measure spawn p99 of
    the last 100, round-trip p99 to random sessions, supervisor fds and RSS."""
    import random

    sup = Sup()
    result: dict[str, Any] = {}
    try:
        with sup.client() as c:
            done = 0
            for checkpoint in (100, 1000, 2000):
                if checkpoint > total:
                    break
                spawn = []
                for i in range(done, checkpoint):
                    started = time.perf_counter()
                    c.run(f"sc{i}", "x")
                    spawn.append(time.perf_counter() - started)
                done = checkpoint
                rtt = []
                for _ in range(pings):
                    key = f"sc{random.randrange(done)}"
                    started = time.perf_counter()
                    c.run(key, "x")
                    rtt.append(time.perf_counter() - started)
                result[str(checkpoint)] = {
                    "spawn_last_batch": summary(spawn[-100:]),
                    "round_trip": summary(rtt),
                    "supervisor": supervisor_usage(sup),
                }
                if checkpoint == 1000:
                    time.sleep(1)
                    result["memory_at_1000"] = memory_of(sup.worker_pids())
    finally:
        sup.close()
    return result


if __name__ == "__main__":
    sys.exit(main())
