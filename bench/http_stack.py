"""The servers the HTTP endpoint's benchmark measures, and what its clients share.

`Stack` starts, on one private temp dir: a supervisor (probe runtime); the
endpoint as `python -m hermes_sup.httpapi` (what `serve --http` runs, minus
its keeper); the floor apps of bench/http_floor.py (echo and bridge); the
same three on uvloop's event loop; and, for an A/B, another version's
endpoint. All are children of the benchmark, stopped by pid at the end.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from bench.common import REPO, Sup, free_port, stop, wait_until
from hermes_sup.client import Client
from hermes_sup.httpapi.keys import KeyStore

COMPLETIONS = "/v1/chat/completions"
KEY_HEADER = "X-Hermes-Session-Key"


def chat_body(text: str, stream: bool = False) -> dict[str, Any]:
    """A chat completion request of one user message."""
    return {
        "model": "hermes-agent",
        "messages": [{"role": "user", "content": text}],
        "stream": stream,
    }


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
            self.sup = Sup(
                *extra,
                root=self.root,
                state=self.state,
                data=self.data,
                log=self.root / "supervisor.log",
                env=self._env(None),
                cwd=REPO,
                timeout=60,
            )
            self.procs.append(self.sup.proc)
            endpoint = ["--state-dir", str(self.state), "--data-dir", str(self.data)]
            endpoint += ["--log-level", "warning"]
            self.url, self.endpoint = self._serve("endpoint", "hermes_sup.httpapi", *endpoint)
            self.echo_url, self.echo = self._serve("echo", "bench.http_floor")
            self.bridge_url, self.bridge = self._serve(
                "bridge", "bench.http_floor", "--state-dir", str(self.state)
            )
            # The same three on uvloop's event loop (see bench/http_floor.py).
            self.uv_url, self.uv_endpoint = self._serve(
                "endpoint-uvloop", "bench.http_floor", "--endpoint-on-uvloop", *endpoint
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
                    "endpoint-b", "hermes_sup.httpapi", *endpoint, source=ab_source
                )
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _env(source: Path | None) -> dict[str, str]:
        """The environment of a server: this checkout on its path, after
        `source` (a directory holding another version's `hermes_sup`) if given."""
        first = [str(source)] if source is not None else []
        path = [*first, str(REPO), os.environ.get("PYTHONPATH", "")]
        return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}

    def _serve(
        self, name: str, module: str, *args: str, source: Path | None = None
    ) -> tuple[str, subprocess.Popen[bytes]]:
        """Start `python -m module args --listen ...` (with `source`, that
        version's) and wait until it answers HTTP; its URL and process."""
        port = free_port()
        with open(self.root / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", module, *args, "--listen", f"127.0.0.1:{port}"],
                stderr=log,
                stdout=log,
                cwd=REPO,
                env=self._env(source),
            )
        self.procs.append(proc)
        url = f"http://127.0.0.1:{port}"

        def answers() -> bool:
            try:
                return httpx.get(url + "/health", timeout=2).status_code in (200, 404)
            except httpx.HTTPError:
                return False

        self._wait(answers, name, proc)
        return url, proc

    def _wait(self, ready: Callable[[], bool], what: str, proc: subprocess.Popen[bytes]) -> None:
        try:
            wait_until(ready, what, proc, timeout=60)
        except RuntimeError as exc:
            logs = "\n".join(p.read_text(errors="replace") for p in self.root.glob("*.log"))
            raise RuntimeError(f"{exc}:\n{logs}") from None

    def client(self) -> Client:
        """A new blocking client of the supervisor."""
        return Client(self.state, timeout=120)

    def close(self) -> None:
        """Stop the HTTP servers, then the supervisor (its workers go with it)."""
        for proc in reversed(self.procs):
            stop(proc)
        shutil.rmtree(self.root, ignore_errors=True)


async def warm(url: str, headers: dict[str, str], keys: list[str], concurrency: int) -> None:
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
