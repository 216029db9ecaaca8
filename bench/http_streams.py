"""Many SSE streams held at once through the HTTP endpoint, each checked in order.

`streams` runs (a) many `GET /v1/runs/{id}/events` streams watching a few
runs, all connected before the first token, and (b) for each count, that
many streaming chat completions (one session each) beside the same turns
read through one `AsyncClient` (the floor); each stream a probe `stream`
of `words` words, judged by `verdict`; with the endpoint's and the
supervisor's memory while they run.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import MemorySampler, load_now, summary
from bench.http_stack import COMPLETIONS, KEY_HEADER, Stack, chat_body, warm
from hermes_sup.client import AsyncClient, Reply, Token


def words_of(words: int) -> tuple[str, list[str]]:
    """The probe command that streams `words` words, and the deltas expected."""
    ws = [f"w{i}" for i in range(words)]
    return "stream " + " ".join(ws), [w if i == 0 else " " + w for i, w in enumerate(ws)]


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
        """A stream opened."""
        self.open += 1
        self.peak = max(self.peak, self.open)

    def closed(self) -> None:
        """A stream closed."""
        self.open -= 1

    def summary(self, wall: float) -> dict[str, Any]:
        """The streams' outcomes, errors and times, `wall` seconds in all."""
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
    both = {"endpoint": stack.endpoint.pid, "supervisor": stack.sup.proc.pid}
    out: dict[str, Any] = {"words": words, "probe_pace_s": words * 0.02}  # probe.STREAM_DELAY
    biggest = max(counts)
    run_keys = [f"run-{i}" for i in range(runs)]
    asyncio.run(warm(stack.url, stack.auth, run_keys, 16))
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
    asyncio.run(warm(stack.url, stack.auth, keys, 16))
    out["spawn_all_s"] = time.perf_counter() - started
    for count in counts:
        some = keys[:count]

        def http(some: list[str] = some) -> dict[str, Any]:
            return asyncio.run(_streams_chat(stack.url, stack.auth, some, words, timeout))

        def zmq(some: list[str] = some) -> dict[str, Any]:
            return asyncio.run(_streams_zmq(stack.state, some, words, timeout))

        out[f"chat_{count}"] = {
            "http": _measured(both, http),
            "zmq": _measured({"supervisor": stack.sup.proc.pid}, zmq),
        }
    return out
