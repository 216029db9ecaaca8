"""What each key's fair share (httpapi/shares.py) costs a request: two
uvicorn servers of one bare ASGI app, served as the endpoint is
(guard.py's protocol), one counting each request in its key's share and
one not, asked in turn request by request (bench/ab.py's pairing), so the
noise of a shared machine falls on both alike.

    .venv/bin/python -m bench.shares_ab [--requests 3000]

Prints each side's p50, the p50 of the paired differences and the ratio of
the p50s (the share's side over the floor's, measured in the same run).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import httpx

from bench.ab import alternate, report
from bench.common import pct

SERVER = """
import asyncio, sys
import uvicorn
from hermes_sup.httpapi.guard import guarded_protocol
from hermes_sup.httpapi.serve import bind
from hermes_sup.httpapi.shares import ShareLimits, Shares

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b"{}"})

shares = Shares(ShareLimits(), 4096) if sys.argv[1] == "shares" else None
sock = bind("127.0.0.1", 0)
print(sock.getsockname()[1], flush=True)
config = uvicorn.Config(app, http=guarded_protocol(10.0, 4096, shares), log_level="warning",
                        access_log=False, lifespan="off", log_config=None)
asyncio.run(uvicorn.Server(config).serve(sockets=[sock]))
"""


def main() -> None:
    """Start both servers, alternate requests, report."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=3000)
    args = parser.parse_args()
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-c", SERVER, kind], stdout=subprocess.PIPE, text=True
        )
        for name, kind in (("this", "shares"), ("other", "floor"))
    }
    try:
        assert all(p.stdout is not None for p in procs.values())
        ports = {name: int(p.stdout.readline()) for name, p in procs.items()}  # type: ignore[union-attr]
        headers = {"Authorization": "Bearer k-" + "x" * 40}
        with httpx.Client(headers=headers) as http:
            urls = {name: f"http://127.0.0.1:{port}/v1/models" for name, port in ports.items()}

            def measure(name: str, _: int) -> float:
                started = time.perf_counter()
                http.get(urls[name])
                return time.perf_counter() - started

            alternate(measure, 200)  # warm both
            samples = alternate(measure, args.requests)
        report("a request (this: counted in its key's share; other: not)", samples, 1e6, "µs")
        print(f"ratio of p50s: {pct(samples['this'], 50) / pct(samples['other'], 50):.3f}")
    finally:
        for proc in procs.values():
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    main()
