"""A model call through the supervisor's model endpoint (supervisor/model_gate.py)
against the same call made directly, on loopback, paired and interleaved.

    python -m bench.model_gate            # 400 pairs
    python -m bench.model_gate --quick    # 60 pairs

Three processes, as in service: the fake model (tests/fake_model.py, the
floor), the gate in an asyncio loop of its own (as in the supervisor) and
this client (as the worker's agent), which keeps its connection open as
the openai client does. Each pair is one non-streaming and one streamed
chat completion each way, in random order; what the gate adds is the
p50 of the paired differences (goal: at most 1 ms). Writes
bench/results/latest-model_gate.json.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from typing import Any

import httpx

from bench.common import RESULTS, free_port, machine, pct, summary, wait_until

FAKE_MODEL = """
import sys, time
from tests.fake_model import FakeModel
model = FakeModel()
print(model.url, flush=True)
sys.stdin.read()
"""

GATE = """
import asyncio, sys
from hermes_sup.supervisor.model_gate import Gate, Upstream

async def main(base_url, port):
    upstream = Upstream.from_config({"base_url": base_url, "api_key": "sk-bench"})
    gate = Gate(lambda session: upstream)

    async def serve(reader, writer):
        head = await reader.readuntil(b"\\r\\n\\r\\n")
        await gate.handle("bench+0123456789ab+1", reader, writer, head)

    server = await asyncio.start_server(serve, "127.0.0.1", port)
    async with server:
        await server.serve_forever()

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


def _call(client: httpx.Client, url: str, stream: bool, close: bool = False) -> float:
    body = {
        "model": "fake-model",
        "stream": stream,
        "messages": [{"role": "user", "content": "hi"}],
    }
    # The fake model writes a JSON answer's head and body apart: on a kept
    # connection the client's delayed ACK holds the body ~40 ms. The direct
    # path therefore connects per call, as the gate does upstream.
    headers = {"Connection": "close"} if close else {}
    started = time.perf_counter()
    if stream:
        with client.stream(
            "POST", url + "/chat/completions", json=body, headers=headers
        ) as response:
            for _ in response.iter_bytes():
                pass
    else:
        client.post(url + "/chat/completions", json=body, headers=headers).raise_for_status()
    return time.perf_counter() - started


def measure(pairs: int) -> dict[str, Any]:
    """Paired direct and gated calls; the times and what the gate adds."""
    model = subprocess.Popen(
        [sys.executable, "-c", FAKE_MODEL], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    gate: subprocess.Popen[bytes] | None = None
    try:
        assert model.stdout is not None
        direct_url = model.stdout.readline().decode().strip()
        port = free_port()
        gate = subprocess.Popen([sys.executable, "-c", GATE, direct_url, str(port)])
        gated_url = f"http://127.0.0.1:{port}/model/v1"

        def up() -> bool:
            try:
                httpx.get(gated_url + "/models", timeout=1).raise_for_status()
                return True
            except httpx.HTTPError:
                return False

        wait_until(up, "the gate", gate)
        out: dict[str, Any] = {}
        with httpx.Client(timeout=30) as direct, httpx.Client(timeout=30) as gated:
            for stream in (False, True):
                for _ in range(20):  # warm both paths
                    _call(direct, direct_url, stream, close=True)
                    _call(gated, gated_url, stream)
                times: dict[str, list[float]] = {"direct": [], "gated": []}
                added = []
                for _ in range(pairs):
                    order = [("direct", direct, direct_url), ("gated", gated, gated_url)]
                    random.shuffle(order)
                    took = {
                        name: _call(client, url, stream, close=name == "direct")
                        for name, client, url in order
                    }
                    for name, seconds in took.items():
                        times[name].append(seconds)
                    added.append(took["gated"] - took["direct"])
                kind = "stream" if stream else "json"
                out[kind] = {
                    "direct": summary(times["direct"]),
                    "gated": summary(times["gated"]),
                    "added_p50_ms": pct(added, 50) * 1000,
                    "ratio_p50": pct(times["gated"], 50) / pct(times["direct"], 50),
                }
        return out
    finally:
        for proc in (gate, model):
            if proc is not None:
                proc.kill()
                proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="60 pairs instead of 400")
    args = parser.parse_args()
    result = {"machine": machine(), "model_gate": measure(60 if args.quick else 400)}
    for kind, figures in result["model_gate"].items():
        print(
            f"{kind:6}  direct p50 {figures['direct']['p50_ms']:.3f} ms  "
            f"gated p50 {figures['gated']['p50_ms']:.3f} ms  "
            f"added p50 {figures['added_p50_ms']:.3f} ms  (x{figures['ratio_p50']:.2f})"
        )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "latest-model_gate.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
