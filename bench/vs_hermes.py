"""hermes-sup against Hermes's own API server: the same fake model, the same
requests, alternated, in one run.

    python -m bench.vs_hermes                   # 50 conversations (10 - 20 minutes)
    python -m bench.vs_hermes --conversations 20 --concurrency 1,8
    python -m bench.vs_hermes --many 1000       # also 1,000 held, 50 of them active

Both serve Hermes 0.19's chat completions on 127.0.0.1 in front of one fake
model server (tests/fake_model.py, which echoes the message with the number
of user turns it was sent, so a reply shows whether the server kept the
conversation's history), run in a process of its own: its CPU is neither
side's, nor the bench's. Hermes runs as `hermes gateway run` with its API
server; hermes-sup as `serve --agent hermes --http` with its defaults
(sealed where it can be), `--idle-timeout` short so that idle conversations
hibernate within the run. Each request names its conversation with
`X-Hermes-Session-Id` and carries only the new message: each server keeps
the history itself.

What it measures, each side in turn, in an order that alternates which side
goes first:
- a new conversation: first token and full reply;
- a follow-up (the conversation's second message): first token, full reply;
- a tool-call turn (the third: the model calls `terminal` to run `echo`,
  then answers with its output), as well as the echo turns;
- a woken conversation (hermes-sup: its worker hibernated; Hermes: the same
  fifth message, to a server that keeps no agent between requests anyway);
- turns/s at each `--concurrency`, follow-ups over distinct conversations;
- memory (PSS summed over every process of each side: for hermes-sup the
  supervisor, zygote, spares, workers, HTTP endpoint and its keeper) with
  the conversations live, and once idle (hibernated). "Live" is counted,
  not assumed: every conversation is touched again (8 at a time, on both
  sides) just before, and the live workers are counted at the moment of
  measurement and printed (`live_workers`); a count short of the
  conversations is said so (`live_short`), never labelled as all of them;
- with `--many`, memory with that many conversations held, 50 active.

Hermes's API server runs at most 10 agent turns at once (more are
answered 429 and retried here: `refused_429`); hermes-sup admits up to its
`max_sessions`. The throughput figures are under those caps.

Writes bench/results/vs-hermes.json. Judge ratios within one run only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.common import REPO, Sup, free_port, load_now, machine, pct
from hermes_sup.httpapi.keys import KeyStore

MIB = 1024 * 1024
KEY = "sk-fake-model"


class Side:
    """One server under test: its URL, key, and the root process of its tree."""

    name: str
    url: str
    key: str
    pid: int
    refused = 0  # requests answered 429 (too many at once), retried

    def roots(self) -> list[int]:
        """The pids whose trees make this side."""
        return [self.pid]

    def processes(self) -> list[psutil.Process]:
        """Every process of this side, each once."""
        seen: dict[int, psutil.Process] = {}
        for pid in self.roots():
            try:
                root = psutil.Process(pid)
                for proc in [root, *root.children(recursive=True)]:
                    seen[proc.pid] = proc
            except psutil.Error:
                pass
        return list(seen.values())

    def memory_mib(self) -> float:
        """PSS of every process of this side, MiB: pages shared between its
        processes (a zygote's and its workers') count once in the sum, as
        USS would not count them at all."""
        total = 0
        for proc in self.processes():
            try:
                total += proc.memory_full_info().pss
            except psutil.Error:
                pass
        return round(total / MIB, 1)

    def memory_by_kind(self) -> dict[str, float]:
        """PSS by process title (MiB), to see where it goes."""
        kinds: dict[str, float] = {}
        for proc in self.processes():
            try:
                title = " ".join(proc.cmdline()[:3])[:70] or proc.name()
                pss = proc.memory_full_info().pss
            except psutil.Error:
                continue
            kinds[title] = round(kinds.get(title, 0.0) + pss / MIB, 1)
        return kinds

    def close(self) -> None:
        raise NotImplementedError


class HermesApiServer(Side):
    """`hermes gateway run` with only its API server, in a home of its own."""

    name = "hermes"

    def __init__(self, root: Path, model_url: str) -> None:
        home = root / "hermes-home"
        home.mkdir()
        (home / "config.yaml").write_text(
            f"model:\n  default: fake-model\n  provider: custom\n  base_url: {model_url}\n"
            f"  api_key: {KEY}\n"
        )
        port = free_port()
        self.key = secrets.token_hex(32)  # Hermes refuses a short one
        self.url = f"http://127.0.0.1:{port}"
        env = {
            **os.environ,
            "HERMES_HOME": str(home),
            "HOME": str(root / "hermes-user"),
            "API_SERVER_ENABLED": "true",
            "API_SERVER_HOST": "127.0.0.1",
            "API_SERVER_PORT": str(port),
            "API_SERVER_KEY": self.key,
        }
        hermes = Path(sys.executable).parent / "hermes"
        self.log = root / "hermes.log"
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [str(hermes), "gateway", "run"],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=root,
                start_new_session=True,
            )
        self.pid = self.proc.pid
        _wait_http(self.url + "/health", self.proc, self.log)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class HermesSup(Side):
    """`hermes-sup serve --agent hermes --http`, with a key made for the run."""

    name = "hermes-sup"

    def __init__(self, root: Path, model_url: str, idle_timeout: float, sealed: str) -> None:
        config = root / "agent.toml"
        config.write_text(
            f'model = "fake-model"\nbase_url = "{model_url}"\nprovider = "custom"\n'
            f'api_key_env = "FAKE_MODEL_KEY"\n'
        )
        self.key = KeyStore(root / "d").generate("bench")
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        home = root / "sup-user"
        home.mkdir()
        env = {**os.environ, "FAKE_MODEL_KEY": KEY, "HOME": str(home)}
        self.sup = Sup(
            "--agent", "hermes", "--agent-config", str(config),
            "--http", f"127.0.0.1:{port}", "--idle-timeout", str(idle_timeout),
            "--sealed", sealed,
            root=root, env=env, timeout=900, log_level="info",
        )  # fmt: skip
        self.pid = self.sup.proc.pid
        _wait_http(self.url + "/health", self.sup.proc, self.sup.log)

    def roots(self) -> list[int]:
        """The supervisor, and the HTTP endpoint's keeper (which is not its child)."""
        found = re.search(r"http_endpoint_started pid=\d+ keeper=(\d+)", self.sup.log.read_text())
        return [self.pid, *([int(found.group(1))] if found else [])]

    def worker_uss_mib(self) -> dict[str, float]:
        """The USS of its live (not spare) workers: what one more costs."""
        uss = []
        for proc in self.processes():
            try:
                title = " ".join(proc.cmdline())
                if title.startswith("hermes-sup worker") and "(spare)" not in title:
                    uss.append(proc.memory_full_info().uss / MIB)
            except psutil.Error:
                continue
        if not uss:
            return {}
        return {"n": len(uss), "p50": round(pct(uss, 50), 1), "max": round(max(uss), 1)}

    def states(self) -> dict[str, int]:
        with self.sup.client() as c:
            return dict(c.status()["sessions"])

    def close(self) -> None:
        self.sup.close()


class ModelProcess:
    """tests/fake_model.py served from a process of its own."""

    def __init__(self) -> None:
        code = (
            "import sys, time\n"
            "from tests.fake_model import FakeModel\n"
            "m = FakeModel(); print(m.url, flush=True)\n"
            "while True: time.sleep(3600)\n"
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        self.url = self.proc.stdout.readline().strip()
        if not self.url:
            self.close()
            raise RuntimeError("the fake model server did not start")

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited:\n{log.read_text(errors='replace')}")
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer in {timeout:.0f}s")


async def turn(
    http: httpx.AsyncClient, side: Side, conversation: str, text: str
) -> tuple[float, float, str]:
    """One streamed chat completion: (first token s, full reply s, text)."""
    headers = {"Authorization": f"Bearer {side.key}", "X-Hermes-Session-Id": conversation}
    body = {
        "model": "hermes-agent",
        "stream": True,
        "messages": [{"role": "user", "content": text}],
    }
    started = time.perf_counter()
    first = None
    parts: list[str] = []
    async with http.stream(
        "POST", side.url + "/v1/chat/completions", json=body, headers=headers
    ) as response:
        if response.status_code == 429:  # Hermes runs at most 10 at once
            side.refused += 1
            await response.aread()
            await asyncio.sleep(0.05)
            return await turn(http, side, conversation, text)
        if response.status_code != 200:
            raise RuntimeError(f"{side.name}: {response.status_code} {await response.aread()!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                content = (choice.get("delta") or {}).get("content")
                if content:
                    if first is None:
                        first = time.perf_counter() - started
                    parts.append(content)
    full = time.perf_counter() - started
    return first if first is not None else full, full, "".join(parts)


def _check(text: str, side: Side, conversation: str, turn_number: int) -> None:
    """The model saw the conversation's earlier messages: its echo counts
    them (0: not checked); a tool-call turn (-1) ended with the tool's
    output."""
    if turn_number == -1 and "done:" not in text:
        raise RuntimeError(f"{side.name} {conversation}: the tool call did not end: {text!r}")
    if turn_number > 0 and f"(turn {turn_number})" not in text:
        raise RuntimeError(
            f"{side.name} {conversation}: expected the model to see {turn_number} user "
            f"turns, it answered {text!r}"
        )


def _stats(seconds: list[float]) -> dict[str, float]:
    return {
        "p50_s": round(pct(seconds, 50), 3),
        "p90_s": round(pct(seconds, 90), 3),
        "n": len(seconds),
    }


async def _each(
    sides: list[Side], conversations: list[str], steps: list[tuple[str, int]]
) -> list[dict[str, dict[str, list[float]]]]:
    """Each conversation's `steps` (message, the user turn it is), one
    conversation after another, alternating which side goes first: first-
    token and full-reply times of each step, by side. A conversation's steps
    follow one another at once (so its follow-up finds it live)."""
    out = [{s.name: {"first": [], "full": []} for s in sides} for _ in steps]
    async with httpx.AsyncClient(timeout=600) as http:
        for i, conv in enumerate(conversations):
            for side in sides if i % 2 == 0 else sides[::-1]:
                for n, (text, turn_number) in enumerate(steps):
                    first, full, reply = await turn(http, side, conv, text)
                    _check(reply, side, conv, turn_number)
                    out[n][side.name]["first"].append(first)
                    out[n][side.name]["full"].append(full)
    return out


async def _throughput(side: Side, conversations: list[str], concurrency: int, turns: int) -> float:
    """Follow-ups over `conversations` (as many as run at once, so each
    stays live), `concurrency` at a time: turns/s."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as http:

        async def one(i: int) -> None:
            async with gate:
                await turn(http, side, conversations[i % len(conversations)], f"tp {i}")

        # Wake (or warm) every conversation used first, outside the clock.
        await asyncio.gather(*(one(i) for i in range(min(turns, len(conversations)))))
        started = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(turns)))
        return round(turns / (time.perf_counter() - started), 2)


def _wait_hibernated(sup: HermesSup, timeout: float = 300) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = sup.states()
        if not any(states.get(s) for s in ("idle", "busy", "starting", "stopping")):
            return states
        time.sleep(1.0)
    raise RuntimeError(f"conversations still live: {sup.states()}")


def _summarize(times: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    return {
        side: {"first_token": _stats(t["first"]), "full_reply": _stats(t["full"])}
        for side, t in times.items()
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="hsb-vs-", dir=os.environ.get("HSB_DIR", "/tmp")))
    model = ModelProcess()
    sides: list[Side] = []
    results: dict[str, Any] = {"machine": machine(), "args": vars(args) | {"out": None}}
    try:
        (root / "h").mkdir()
        (root / "s").mkdir()
        started = time.monotonic()
        sup = HermesSup(root / "s", model.url, args.idle_timeout, args.sealed)
        results["sup_ready_s"] = round(time.monotonic() - started, 1)
        hermes = HermesApiServer(root / "h", model.url)
        sides = [hermes, sup]
        convs = [f"bench-{i}" for i in range(args.conversations)]
        base = {s.name: s.memory_mib() for s in sides}
        results["memory_empty_mib"] = base
        print("new conversations and their follow-ups...", flush=True)
        steps = [("hello", 1), ("again", 2), ("run: echo tool-call", -1)]
        new, follow_up, tool_call = asyncio.run(_each(sides, convs, steps))
        results["new"], results["follow_up"] = _summarize(new), _summarize(follow_up)
        results["tool_call"] = _summarize(tool_call)
        # Every conversation touched again just before the figure, so that
        # "N live" has N live workers (the first ones would have hibernated).
        asyncio.run(_touch(sides, convs))
        results["memory_live_mib"] = {s.name: s.memory_mib() for s in sides}
        results["memory_live_by_process"] = {s.name: s.memory_by_kind() for s in sides}
        results["live_worker_uss_mib"] = sup.worker_uss_mib()
        live = results["live_worker_uss_mib"].get("n", 0)
        results["live_workers"] = live
        results["live_short"] = live < len(convs)
        print(f"live workers at the memory figure: {live} of {len(convs)}", flush=True)
        print("waiting for hibernation...", flush=True)
        results["idle_states"] = _wait_hibernated(sup)
        time.sleep(2)  # let the last stops' memory go back
        results["memory_idle_mib"] = {s.name: s.memory_mib() for s in sides}
        results["memory_idle_by_process"] = {s.name: s.memory_by_kind() for s in sides}
        print("woken conversations...", flush=True)
        woken = convs[: args.woken]
        # Its fifth user turn: hello, again, the tool call, the touch, this.
        (woke,) = asyncio.run(_each(sides, woken, [("woken", 5)]))
        results["woken"] = _summarize(woke)
        results["turns_per_s"] = {}
        for concurrency in [int(x) for x in args.concurrency.split(",")]:
            for side in sides if concurrency % 2 else sides[::-1]:
                rate = asyncio.run(
                    _throughput(
                        side, convs[:concurrency], concurrency, max(args.turns, 2 * concurrency)
                    )
                )
                results["turns_per_s"].setdefault(str(concurrency), {})[side.name] = rate
                print(f"c={concurrency} {side.name}: {rate} turns/s", flush=True)
        if args.many:
            print(f"{args.many} conversations held...", flush=True)
            extra = [f"held-{i}" for i in range(args.many - len(convs))]
            asyncio.run(_many(sides, extra))
            _wait_hibernated(sup)
            asyncio.run(_each(sides, convs[:50], [("active", 0)]))
            results["memory_many_mib"] = {s.name: s.memory_mib() for s in sides}
        results["refused_429"] = {s.name: s.refused for s in sides}
        results["load"] = load_now()
    finally:
        for side in sides:
            side.close()
        model.close()
        shutil.rmtree(root, ignore_errors=True)
    return results


async def _touch(sides: list[Side], conversations: list[str]) -> None:
    """One more turn of every conversation, 8 at a time, each side in turn."""
    gate = asyncio.Semaphore(8)
    async with httpx.AsyncClient(timeout=600) as http:

        async def one(side: Side, conv: str) -> None:
            async with gate:
                await turn(http, side, conv, "touch")

        for side in sides:
            await asyncio.gather(*(one(side, c) for c in conversations))


async def _many(sides: list[Side], conversations: list[str]) -> None:
    gate = asyncio.Semaphore(8)
    async with httpx.AsyncClient(timeout=600) as http:

        async def one(side: Side, conv: str) -> None:
            async with gate:
                await turn(http, side, conv, "hello")

        for side in sides:
            await asyncio.gather(*(one(side, c) for c in conversations))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=50)
    parser.add_argument("--woken", type=int, default=20, help="conversations woken")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--turns", type=int, default=48, help="turns per throughput run")
    parser.add_argument("--idle-timeout", type=float, default=20.0)
    parser.add_argument("--sealed", default="auto", choices=["auto", "on", "off"])
    parser.add_argument("--many", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "vs-hermes.json")
    args = parser.parse_args()
    results = run(args)
    print(json.dumps(results, indent=2))
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
