"""Round trips and throughput through the supervisor, beside the bare proxy.

A round trip is a turn to the probe runtime (it echoes) and its reply.
`_drive` measures it twice over the same path: with one request in flight
(latency), then with a window of them (throughput), with the CPU each
process spent per message. bench/run.py runs these in its round-trip figure.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from bench.common import ProxyFloor, Sup, cpu_seconds, summary
from hermes_sup.protocol import Kind

# An echo worker of the floor: answers each message with its payload.
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
    floor = ProxyFloor("hsp-")
    s = floor.client
    try:
        time.sleep(0.3)
        names = [f"w{i}" for i in range(sessions)]
        for n in names:
            floor.start(ECHO, floor.back, n)
        s.connect(floor.front)
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
            router=[floor.procs[0].pid],
            workers=[p.pid for p in floor.procs[1:]],
        )
    finally:
        floor.close()


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


def _drive(
    send: Callable[[int], object],
    recv: Callable[[], object],
    count: int,
    window: int,
    router: list[int],
    workers: list[int],
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
