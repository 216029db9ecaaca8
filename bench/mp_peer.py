"""Peer: multiprocessing's `spawn` or warm `forkserver` starting a process
that answers over zmq. A script of its own, so that the children re-import
this small module and not the benchmark with everything it imports.

    python bench/mp_peer.py METHOD COUNT    # prints a JSON list of seconds

Run by its path, not as part of the bench package: a `spawn` child then
imports only this file.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import sys
import time
from typing import Any

import zmq


def child_answer(endpoint: str) -> None:
    """What every floor's child does: connect, say hello, answer one ping."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 1000)
    s.connect(endpoint)
    s.send(b"hello")
    s.send(s.recv())  # echo the ping
    s.close()
    ctx.term()


def answer_ping(router: zmq.Socket[bytes]) -> None:
    """The parent's side: take a child's hello, ping it, take its echo."""
    ident, _hello = router.recv_multipart()
    router.send_multipart([ident, b"ping"])
    router.recv_multipart()


def measure(method: str, count: int) -> list[float]:
    """`count` processes started by `method`, each until it answered."""
    mpctx: Any = mp.get_context(method)  # spawn or forkserver: both have Process
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    if method == "forkserver":
        mpctx.set_forkserver_preload(["zmq"])
        warm = mpctx.Process(target=child_answer, args=(endpoint,))
        warm.start()
        answer_ping(router)
        warm.join()
    times = []
    try:
        for _ in range(count):
            started = time.perf_counter()
            p = mpctx.Process(target=child_answer, args=(endpoint,))
            p.start()
            answer_ping(router)
            times.append(time.perf_counter() - started)
            p.join()
    finally:
        router.close(0)
        ctx.term()
    return times


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1], int(sys.argv[2]))))
