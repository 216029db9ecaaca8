"""Spawn: a new session's first reply, beside the bare fork floor and peers.

A spawn is the time from a client sending the first message (`pid`, probe
runtime) to a new key until its reply. The floor is the least any
fork-per-session design can do; the peers are other ways to start a
process that answers over zmq. bench/run.py runs these in its spawn figure.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import zmq

from bench.common import Sup, summary
from bench.mp_peer import answer_ping

# ---------------------------------------------------------------- hermes-sup


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


def wait_for_spares(sup: Sup, count: int) -> None:
    """Until `sup` has `count` spare workers ready (10 s at most), as on a
    serving machine between new sessions."""
    with sup.client() as c:
        deadline = time.monotonic() + 10
        while c.status()["spare_workers"] < count and time.monotonic() < deadline:
            time.sleep(0.01)


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
        wait_for_spares(sup, 2)
        return {
            "spaced": summary(spawn_hermes_sup(sup, count, "spaced", gap=0.02)),
            "back_to_back": summary(spawn_hermes_sup(sup, count, "burst")),
        }
    finally:
        sup.close()


# ---------------------------------------------------------------- the floor


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
    assert forker.stdin is not None and forker.stdout is not None
    times = []
    try:
        for _ in range(count):
            started = time.perf_counter()
            forker.stdin.write("go\n")
            forker.stdin.flush()
            answer_ping(router)
            times.append(time.perf_counter() - started)
            forker.stdout.readline()
    finally:
        forker.stdin.close()
        forker.wait()
        router.close(0)
        ctx.term()
    return times


# ---------------------------------------------------------------- peers


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
            answer_ping(router)
            times.append(time.perf_counter() - started)
            client.call({"command": "rm", "properties": {"name": f"w{i}", "waiting": True}})
    finally:
        try:
            client.call({"command": "quit", "properties": {}})
        except Exception:  # circusd already gone: it is waited for below
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
