"""Soak: mixed load and faults against one real supervisor for N minutes.

    make soak                                   # 30 minutes
    python -m bench.soak --minutes 5            # shorter

A supervisor with the probe runtime, spare workers on and a configuration
file, driven for `--minutes` by many sessions at once: short turns,
streaming ones (`stream`), `sh` output, approvals (`ask`, answered, or left
to the probe's approval timeout or the turn timeout), bounded output floods
(one 20 MB line, thousands of lines, the worker's own log). Meanwhile, at
random: SIGKILL of a worker (only pids that this supervisor's `list` names
and that descend from it), clients closed while their turn runs, `kill`
and `kill --purge` of sessions, and `reload` after rewriting the file
between two valid settings.

Every turn sent is recorded with its outcome: a reply, an error with its
code, or, for a client closed mid-turn, whether the supervisor still gave
the turn its final answer (seen by a watcher of every session). A turn
with no final answer by the end of the load plus `--grace` is lost; the
goal is none. The supervisor's RSS and open fds are read from /proc every
`--sample` seconds; the goal is that they stay flat (the slope of RSS over
the second half of the load, in KiB a minute, is reported).

Writes bench/results/soak.json and bench/results/soak.png and prints a
short summary. Exits 1 if a turn was lost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from bench.common import RESULTS, Sup, pct
from hermes_sup.client import (
    ApprovalRequest,
    ApprovalTimeout,
    AsyncClient,
    Client,
    ClientError,
    Running,
    SupervisorError,
)
from hermes_sup.supervisor.turns import DEDUP_ENTRIES

# Two valid settings the configuration file alternates between. What differs
# takes effect at once for new sessions (see README, "Reload"); turn_timeout
# on each side of the probe's 60 s approval timeout makes an unanswered
# `ask` end both ways: turn_timeout (A) or an approval_timeout then a
# "denied" reply (B). A short failed_cooldown keeps a session that random
# kills drove to `failed` from refusing turns for the rest of a short run.
CONFIGS = {
    "A": (
        "spare_workers = 2\nturn_timeout = 45\nhistory = 200\nmax_queue = 64\n"
        "failed_cooldown = 20\nlog_rate_limit = 1048576\n"
    ),
    "B": (
        "spare_workers = 3\nturn_timeout = 90\nhistory = 100\nmax_queue = 128\n"
        "failed_cooldown = 20\nlog_rate_limit = 2097152\n"
    ),
}
LONGEST_TURN = 90.0  # turn_timeout of B: an unanswered ask ends by then

FLOODS = {
    # One 20 MB line: over the frame limit, it must end as a too_large event.
    "flood_line": "sh head -c 20000000 /dev/zero | tr '\\0' x; echo",
    # 3,000 output events of 1,000 bytes.
    "flood_lines": "sh head -c 3000000 /dev/zero | tr '\\0' x | fold -w 1000",
    # 8 MB into the worker's own stderr: the session log and its rate limit.
    "flood_log": "sh head -c 8000000 /dev/zero | tr '\\0' x | fold -w 200 > /proc/$PPID/fd/2",
}

WORDS = "the quick brown fox jumps over the lazy dog while soak turns go by".split()


@dataclass
class TurnRecord:
    """One turn sent, and what became of it."""

    kind: str
    session: str
    text: str
    sent: float  # seconds since the load started
    id: str = ""
    ended: float | None = None
    # reply | error | client_error | disconnected | lost
    outcome: str = "pending"
    code: str = ""  # the error code, or the client exception's name
    detail: str = ""
    events: int = 0
    ran: bool = False  # a `running` status arrived
    approval: str = ""  # the answer sent to an approval, or "timeout"


@dataclass
class Chaos:
    """One fault or operation the soak caused."""

    t: float
    what: str  # sigkill | kill | kill_purge | reload | disconnect
    session: str = ""
    result: str = ""


@dataclass
class Soak:
    """Everything a run records; the tasks below share it."""

    sup: Sup
    started: float
    load_until: float
    rng: random.Random
    turns: list[TurnRecord] = field(default_factory=list)
    chaos: list[Chaos] = field(default_factory=list)
    samples: list[dict[str, float]] = field(default_factory=list)
    finals: dict[str, str] = field(default_factory=dict)  # turn id -> reply / code, by watch
    watch_error: str = ""
    config_now: str = "A"
    asks: list[TurnRecord] = field(default_factory=list)  # sent to be left unanswered
    drained_at: float = 0.0  # when the last turn of the load ended (or was given up)

    def now(self) -> float:
        return time.monotonic() - self.started

    def loading(self) -> bool:
        return time.monotonic() < self.load_until

    def unanswered_asks(self) -> int:
        """Asks nobody will answer whose final answer has not come yet."""
        self.asks = [
            r
            for r in self.asks
            if r.outcome in ("pending", "disconnected") and r.id not in self.finals
        ]
        return len(self.asks)


# ---------------------------------------------------------------- turns


def pick_turn(rng: random.Random, no_unanswered: bool) -> tuple[str, str]:
    """A turn's kind and text, by the mix's weights; with `no_unanswered`
    (late in the run, so that the drain stays short, or while two are
    out), no `ask` that nobody will answer."""
    kinds = [
        ("short", 34),
        ("medium", 10),
        ("stream", 15),
        ("sh", 15),
        ("ask_answered", 8),
        ("ask_left", 0 if no_unanswered else 2),
        ("flood", 4),
        ("disconnect", 12),
    ]
    kind = rng.choices([k for k, _ in kinds], [w for _, w in kinds])[0]
    if kind == "short":
        text = rng.choice(["pid", "hello soak", "sleep 0.05", "env HERMES_SESSION_KEY", "cwd"])
    elif kind == "medium":
        text = f"sleep {rng.uniform(1, 3):.1f}"
    elif kind == "stream":
        text = "stream " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 60)))
    elif kind == "sh":
        text = rng.choice(
            ["sh seq 1 300", "sh ls -la; date; uname -a", "sh echo out; echo err >&2"]
        )
    elif kind == "ask_answered":
        text = "ask echo approved"
    elif kind == "ask_left":
        text = "ask echo nobody-answers"
    elif kind == "flood":
        kind = rng.choice(list(FLOODS))
        text = FLOODS[kind]
    else:
        text = rng.choices(
            ["sleep 3", "stream " + " ".join(WORDS * 4), FLOODS["flood_lines"], "ask echo gone"],
            [35, 30, 25, 0 if no_unanswered else 10],
        )[0]
    return kind, text


async def run_turn(soak: Soak, client: AsyncClient, rec: TurnRecord) -> None:
    """Send one turn and read it to its end; answer an approval if asked to."""
    try:
        turn = await client.send(rec.session, rec.text)
        rec.id = turn.id
        async for event in turn:
            rec.events += 1
            if isinstance(event, Running):
                rec.ran = True
            elif isinstance(event, ApprovalTimeout):
                rec.approval = "timeout"
            elif isinstance(event, ApprovalRequest) and rec.kind == "ask_answered":
                rec.approval = soak.rng.choice(["once", "session", "deny"])
                try:
                    await client.approve(rec.session, rec.approval)
                except SupervisorError as exc:  # the turn ended first (killed, say)
                    rec.approval += f" ({exc.code})"
        assert turn.reply is not None
        rec.outcome, rec.detail = "reply", turn.reply.text[:60]
    except SupervisorError as exc:
        rec.outcome, rec.code, rec.detail = "error", exc.code, exc.message[:200]
    except ClientError as exc:
        rec.outcome, rec.code, rec.detail = "client_error", type(exc).__name__, str(exc)[:200]
    finally:
        if rec.outcome != "pending":
            rec.ended = soak.now()


async def disconnect_turn(soak: Soak, rec: TurnRecord, timeout: float) -> None:
    """A client of its own sends the turn and is closed once the turn runs."""
    client = AsyncClient(soak.sup.state, timeout=timeout)
    events = None
    try:
        turn = await client.send(rec.session, rec.text)
        rec.id = turn.id
        events = turn.__aiter__()
        while True:
            event = await events.__anext__()
            rec.events += 1
            if event.type == "reply":
                assert turn.reply is not None
                rec.outcome, rec.detail = "reply", turn.reply.text[:60]  # over before we left
                break
            if isinstance(event, Running):
                rec.ran = True
                await asyncio.sleep(soak.rng.uniform(0, 0.5))  # mid-turn, not at its start
                rec.outcome = "disconnected"
                break
    except SupervisorError as exc:
        rec.outcome, rec.code, rec.detail = "error", exc.code, exc.message[:200]
    except ClientError as exc:
        rec.outcome, rec.code, rec.detail = "client_error", type(exc).__name__, str(exc)[:200]
    except StopAsyncIteration:
        rec.outcome, rec.code = "client_error", "StopAsyncIteration"
    finally:
        if events is not None:
            await events.aclose()
        await client.close()  # linger 0: whatever the supervisor still sends is dropped
        if rec.outcome != "pending":
            rec.ended = soak.now()


async def driver(
    soak: Soak, client: AsyncClient, keys: list[str], side: set[asyncio.Task[None]], timeout: float
) -> None:
    """Send turns one after another until the load ends. An unanswered ask
    and a client closed mid-turn run beside the driver, so it keeps going."""
    rng = soak.rng
    while soak.loading():
        late = soak.load_until - time.monotonic() < 60
        # Each unanswered ask holds its session (and every turn queued
        # behind it) for up to a minute: two at a time at most.
        kind, text = pick_turn(rng, late or soak.unanswered_asks() >= 2)
        rec = TurnRecord(kind, rng.choice(keys), text, soak.now())
        soak.turns.append(rec)
        if text.startswith("ask echo gone") or kind == "ask_left":
            soak.asks.append(rec)
        if kind == "disconnect":
            side.add(asyncio.create_task(disconnect_turn(soak, rec, timeout)))
            soak.chaos.append(Chaos(soak.now(), "disconnect", rec.session))
        elif kind == "ask_left":
            side.add(asyncio.create_task(run_turn(soak, client, rec)))
        else:
            await run_turn(soak, client, rec)
        await asyncio.sleep(rng.uniform(0, 0.2))


# ---------------------------------------------------------------- faults


def is_our_worker(sup: Sup, pid: int, seen: dict[str, Any]) -> psutil.Process | None:
    """The process `pid` if it still is the worker `list` named: a
    descendant of this supervisor, started after it, running when listed."""
    try:
        proc = psutil.Process(pid)
        if sup.proc.pid not in {p.pid for p in proc.parents()}:
            return None
        if seen.get("started") and proc.create_time() > seen["started"] + 1:
            return None  # not the worker that was listed: a newer process
        return proc
    except psutil.Error:
        return None


async def killer(soak: Soak, client: AsyncClient, every: tuple[float, float]) -> None:
    """SIGKILL a random worker of this supervisor's sessions, now and then."""
    while soak.loading():
        await asyncio.sleep(soak.rng.uniform(*every))
        if not soak.loading():
            break
        try:
            rows = [r for r in await client.sessions(prefix="soak-") if r.get("pid")]
        except ClientError as exc:
            soak.chaos.append(Chaos(soak.now(), "sigkill", "", f"list failed: {exc}"))
            continue
        if not rows:
            continue
        row = soak.rng.choice(rows)
        proc = is_our_worker(soak.sup, row["pid"], row)
        if proc is None:
            result = "skipped: not this supervisor's worker any more"
        else:
            try:
                proc.send_signal(signal.SIGKILL)
                result = f"pid {row['pid']} ({row['state']})"
            except psutil.Error as exc:
                result = f"skipped: {exc}"
        soak.chaos.append(Chaos(soak.now(), "sigkill", row["key"], result))


async def stopper(
    soak: Soak, client: AsyncClient, keys: list[str], every: tuple[float, float]
) -> None:
    """`kill` or `kill --purge` a random session, now and then."""
    while soak.loading():
        await asyncio.sleep(soak.rng.uniform(*every))
        if not soak.loading():
            break
        key = soak.rng.choice(keys)
        purge = soak.rng.random() < 0.5
        try:
            result = (await client.kill(key, purge=purge)).reason
        except SupervisorError as exc:
            result = exc.code
        except ClientError as exc:
            result = f"{type(exc).__name__}: {exc}"
        soak.chaos.append(Chaos(soak.now(), "kill_purge" if purge else "kill", key, result))


async def reloader(soak: Soak, config: Path, every: tuple[float, float]) -> None:
    """Rewrite the configuration file to the other settings and `reload`."""
    blocking = Client(soak.sup.state, timeout=60)
    try:
        while soak.loading():
            await asyncio.sleep(soak.rng.uniform(*every))
            if not soak.loading():
                break
            soak.config_now = "B" if soak.config_now == "A" else "A"
            write_config(config, soak.config_now)
            try:  # the asyncio client has no reload(): the blocking one, in a thread
                answer = await asyncio.to_thread(blocking.reload)
                result = f"{soak.config_now}: changed {','.join(answer.get('changed', []))}"
            except ClientError as exc:
                result = f"{soak.config_now}: {exc}"
            soak.chaos.append(Chaos(soak.now(), "reload", "", result))
    finally:
        await asyncio.to_thread(blocking.close)


def write_config(path: Path, name: str) -> None:
    """Replace the file whole, so a reload never reads half of it."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(CONFIGS[name])
    tmp.replace(path)


# ---------------------------------------------------------------- watching


async def watcher(soak: Soak, timeout: float) -> None:
    """Every turn's final answer as the supervisor published it, by turn id:
    how a turn whose client was closed is known to have ended."""
    client = AsyncClient(soak.sup.state, timeout=timeout)
    try:
        async for event in client.watch(None):
            if event.turn is None:
                continue
            if event.type == "reply":
                soak.finals[event.turn] = "reply"
            elif event.type == "error":
                data = event.data if isinstance(event.data, dict) else {}
                soak.finals[event.turn] = str(data.get("code", "error"))
    except ClientError as exc:
        soak.watch_error = f"{type(exc).__name__}: {exc}"
    finally:
        await client.close()


def read_proc(pid: int) -> tuple[int, int, int, float]:
    """RSS (KiB), open fds, threads and CPU seconds of a process, from /proc."""
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


async def sampler(soak: Soak, client: AsyncClient, every: float, stop: asyncio.Event) -> None:
    """The supervisor's RSS, fds, threads and CPU, and its session counts."""
    pid = soak.sup.proc.pid
    while not stop.is_set():
        rss, fds, threads, cpu = read_proc(pid)
        sample: dict[str, float] = {
            "t": round(soak.now(), 2),
            "rss_kib": rss,
            "fds": fds,
            "threads": threads,
            "cpu_s": cpu,
            "load1": os.getloadavg()[0],
        }
        try:
            info = await asyncio.wait_for(client.status(), 10)
            sample["sessions_live"] = sum(
                n for state, n in info["sessions"].items() if state != "exited"
            )
            sample["sessions_total"] = info["total_sessions"]
            sample["spares"] = info["spare_workers"]
            sample["queued"] = info["queued"]
        except (ClientError, TimeoutError):
            pass
        soak.samples.append(sample)
        try:
            await asyncio.wait_for(stop.wait(), every)
        except TimeoutError:
            pass


# ---------------------------------------------------------------- the run


async def soak_run(args: argparse.Namespace, sup: Sup, config: Path) -> Soak:
    load = args.minutes * 60
    started = time.monotonic()
    soak = Soak(sup, started, started + load, random.Random(args.seed))
    keys = [f"soak-{i:02d}" for i in range(args.sessions)]
    timeout = LONGEST_TURN + args.grace  # no request gives up before the drain does
    clients = [AsyncClient(sup.state, timeout=timeout) for _ in range(args.clients)]
    chaos_client = AsyncClient(sup.state, timeout=60)
    stop_sampling = asyncio.Event()
    side: set[asyncio.Task[None]] = set()
    background = [
        asyncio.create_task(watcher(soak, timeout)),
        asyncio.create_task(sampler(soak, chaos_client, args.sample, stop_sampling)),
    ]
    await asyncio.sleep(0.5)  # the watch is in place before the first turn
    load_tasks = [
        asyncio.create_task(driver(soak, clients[i % len(clients)], keys, side, timeout))
        for i in range(args.drivers)
    ]
    load_tasks += [
        asyncio.create_task(killer(soak, chaos_client, (2, 8))),
        asyncio.create_task(stopper(soak, chaos_client, keys, (5, 15))),
        asyncio.create_task(reloader(soak, config, (15, 30))),
    ]
    # The load ends at load_until; every turn still out then has `grace`
    # seconds (plus the longest turn) to get its final answer.
    deadline = soak.load_until + LONGEST_TURN + args.grace
    await asyncio.sleep(max(0.0, soak.load_until - time.monotonic()))
    pending = [t for t in [*load_tasks, *side] if not t.done()]
    if pending:
        await asyncio.wait(pending, timeout=max(0.1, deadline - time.monotonic()))
    for task in [*load_tasks, *side]:
        if not task.done():
            task.cancel()
    await asyncio.gather(*load_tasks, *side, return_exceptions=True)
    soak.drained_at = soak.now()
    for rec in soak.turns:
        if rec.outcome == "pending":
            rec.outcome = "lost"
    # A little longer: the watcher hears the last finals, the sampler sees
    # the supervisor settle with no load.
    await asyncio.sleep(args.settle)
    stop_sampling.set()
    for task in background:
        task.cancel()
    await asyncio.gather(*background, return_exceptions=True)
    for c in [*clients, chaos_client]:
        await c.close()
    return soak


def slope_per_minute(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) points, per minute."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx = sum(t for t, _ in points) / n
    my = sum(v for _, v in points) / n
    den = sum((t - mx) ** 2 for t, _ in points)
    if den == 0:
        return 0.0
    return 60 * sum((t - mx) * (v - my) for t, v in points) / den


def log_summary(path: Path) -> dict[str, Any]:
    """Counts of the supervisor's warning and error lines by event name."""
    counts: Counter[str] = Counter()
    tracebacks = 0
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return {}
    for line in lines:
        parts = line.split(" ", 5)
        if len(parts) >= 5 and parts[2] in ("WARNING", "ERROR", "CRITICAL"):
            counts[f"{parts[2]} {parts[4]}"] += 1
        if line.startswith("Traceback"):
            tracebacks += 1
    return {"by_event": dict(counts.most_common()), "tracebacks": tracebacks}


def report(soak: Soak, args: argparse.Namespace, log: dict[str, Any]) -> dict[str, Any]:
    """The figures: turns by outcome, faults caused, RSS and fds over time."""
    turns = soak.turns
    for rec in turns:  # a closed client's turn counts as ended once the watcher saw its final
        if rec.outcome == "disconnected" and rec.id in soak.finals:
            rec.code = soak.finals[rec.id]
    disconnected = [r for r in turns if r.outcome == "disconnected"]
    unconfirmed = [r for r in disconnected if r.id not in soak.finals]
    ran = [r for r in turns if r.ran and r.outcome in ("reply", "error")]
    seen = sum(1 for r in ran if r.id in soak.finals)
    lost = [r for r in turns if r.outcome == "lost"] + unconfirmed
    errors = Counter(r.code for r in turns if r.outcome == "error")
    load_s = args.minutes * 60
    in_load = [s for s in soak.samples if s["t"] <= load_s]
    half = [s for s in in_load if s["t"] >= load_s / 2]
    rss_slope = slope_per_minute([(s["t"], s["rss_kib"]) for s in half])
    fd_slope = slope_per_minute([(s["t"], s["fds"]) for s in half])
    first, last = soak.samples[0], soak.samples[-1]
    cpu_s = last["cpu_s"] - first["cpu_s"]
    return {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "kernel": platform.release(),
        },
        "args": vars(args),
        "configs": CONFIGS,
        "summary": {
            "turns_sent": len(turns),
            "replied": sum(1 for r in turns if r.outcome == "reply"),
            "failed_with_reason": sum(errors.values()),
            "failed_by_code": dict(errors.most_common()),
            "client_errors": dict(Counter(r.code for r in turns if r.outcome == "client_error")),
            "disconnected": len(disconnected),
            "disconnected_final_seen": len(disconnected) - len(unconfirmed),
            "disconnected_final_by_code": dict(
                Counter(r.code for r in disconnected if r.id in soak.finals)
            ),
            "lost": len(lost),
            "watch_saw_finals_of_started_turns": f"{seen}/{len(ran)}",
            "watch_error": soak.watch_error,
            "drained_after_load_s": round(soak.drained_at - load_s, 1),
            # The supervisor remembers the last DEDUP_ENTRIES sends for
            # resends: its memory grows until then, so the slope below says
            # whether it is flat only once that many were sent before the
            # second half began.
            "sends_before_second_half": sum(1 for r in turns if r.sent < load_s / 2),
            "resend_cache_entries": DEDUP_ENTRIES,
            "by_kind": {
                kind: dict(Counter(r.outcome if r.outcome != "error" else r.code for r in rows))
                for kind, rows in sorted(_group(turns).items())
            },
            "reply_seconds_p50_p99_by_kind": {
                kind: [round(pct(d, 50), 2), round(pct(d, 99), 2)]
                for kind, rows in sorted(_group(turns).items())
                if (d := [r.ended - r.sent for r in rows if r.outcome == "reply" and r.ended])
            },
            "faults": dict(Counter(c.what for c in soak.chaos)),
            "sigkills_done": sum(
                1 for c in soak.chaos if c.what == "sigkill" and c.result.startswith("pid")
            ),
            "supervisor": {
                "rss_mib_start": first["rss_kib"] / 1024,
                "rss_mib_max": max(s["rss_kib"] for s in soak.samples) / 1024,
                "rss_mib_end": last["rss_kib"] / 1024,
                "rss_slope_kib_per_min_second_half": round(rss_slope, 1),
                "fds_start": first["fds"],
                "fds_max": max(s["fds"] for s in soak.samples),
                "fds_end": last["fds"],
                "fds_slope_per_min_second_half": round(fd_slope, 2),
                "threads_max": max(s["threads"] for s in soak.samples),
                "cpu_percent_of_one_core": round(
                    100 * cpu_s / max(1e-9, last["t"] - first["t"]), 1
                ),
            },
        },
        "lost_turns": [asdict(r) for r in lost],
        "supervisor_log": log,
        "chaos": [asdict(c) for c in soak.chaos],
        "samples": soak.samples,
        "turns": [asdict(r) for r in turns],
    }


def _group(turns: list[TurnRecord]) -> dict[str, list[TurnRecord]]:
    out: dict[str, list[TurnRecord]] = {}
    for rec in turns:
        out.setdefault(rec.kind, []).append(rec)
    return out


# ---------------------------------------------------------------- the plot


def plot(result: dict[str, Any], path: Path) -> str:
    """RSS and fds of the supervisor over time, with the faults marked, and
    the turns ended every 10 s by outcome. matplotlib when installed (the
    `bench` extra), else a plain SVG beside where the PNG would be."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        svg = path.with_suffix(".svg")
        svg.write_text(plot_svg(result))
        return str(svg)
    samples = result["samples"]
    load_min = result["args"]["minutes"]
    t = [s["t"] / 60 for s in samples]
    fig, axes = plt.subplots(
        4, 1, figsize=(10, 9.5), sharex=True, gridspec_kw={"height_ratios": [3, 3, 1.4, 3]}
    )
    fig.suptitle(
        f"hermes-sup soak: {result['summary']['turns_sent']} turns, "
        f"{result['summary']['lost']} lost; supervisor RSS slope over the second half "
        f"{result['summary']['supervisor']['rss_slope_kib_per_min_second_half']:+.0f} KiB/min"
    )
    ax = axes[0]
    ax.plot(t, [s["rss_kib"] / 1024 for s in samples], color="tab:blue")
    ax.set_ylabel("supervisor RSS, MiB")
    ax.set_ylim(bottom=0)
    ax = axes[1]
    ax.plot(t, [s["fds"] for s in samples], color="tab:orange", label="supervisor open fds")
    live = [s for s in samples if "sessions_live" in s]
    if live:
        ax.plot(
            [s["t"] / 60 for s in live],
            [s["sessions_live"] for s in live],
            color="tab:gray",
            linewidth=1,
            label="live sessions",
        )
    ax.set_ylabel("count")
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower right", fontsize=8)
    # The faults, one row each.
    ax = axes[2]
    rows = [
        ("sigkill", "SIGKILL", "tab:red"),
        ("kill", "kill", "tab:purple"),
        ("kill_purge", "kill --purge", "tab:brown"),
        ("reload", "reload", "tab:green"),
        ("disconnect", "client closed", "tab:gray"),
    ]
    ax.eventplot(
        [[c["t"] / 60 for c in result["chaos"] if c["what"] == what] for what, _, _ in rows],
        colors=[color for _, _, color in rows],
        lineoffsets=list(range(len(rows))),
        linelengths=0.7,
        linewidths=0.8,
    )
    ax.set_yticks(list(range(len(rows))), [label for _, label, _ in rows], fontsize=7)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.invert_yaxis()
    ax = axes[3]
    bucket = 10.0
    n = int(max(s["t"] for s in samples) // bucket) + 1
    kinds = ("reply", "error", "disconnected", "client_error", "lost")
    counts = {k: [0] * n for k in kinds}
    for rec in result["turns"]:
        end = rec["ended"] if rec["ended"] is not None else rec["sent"]
        counts.setdefault(rec["outcome"], [0] * n)
        if rec["outcome"] in counts:
            counts[rec["outcome"]][min(n - 1, int(end // bucket))] += 1
    xs = [i * bucket / 60 for i in range(n)]
    bottom = [0] * n
    for k, color in zip(kinds, ("tab:green", "tab:red", "tab:gray", "gold", "black"), strict=True):
        ax.bar(xs, counts[k], width=bucket / 60, bottom=bottom, align="edge", color=color, label=k)
        bottom = [b + c for b, c in zip(bottom, counts[k], strict=True)]
    ax.set_ylim(0, max(bottom) * 1.3 + 1)  # room for the legend
    ax.set_ylabel("turns ended / 10 s")
    ax.set_xlabel("minutes")
    ax.legend(loc="upper right", fontsize=8, ncol=4)
    for a in axes:
        a.axvline(load_min, color="black", linestyle="--", linewidth=1)
        a.grid(alpha=0.3)
    axes[0].annotate(" load ends", (load_min, 0.05), xycoords=("data", "axes fraction"), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def plot_svg(result: dict[str, Any]) -> str:
    """RSS and fds over time as two polylines, for a machine without matplotlib."""
    samples = result["samples"]
    width, height, pad = 800, 200, 40
    tmax = max(s["t"] for s in samples) or 1.0
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{2 * height}">']
    for row, (key, label, scale) in enumerate((("rss_kib", "RSS MiB", 1024), ("fds", "fds", 1))):
        values = [s[key] / scale for s in samples]
        vmax = max(values) or 1.0
        top = row * height
        points = " ".join(
            f"{pad + (s['t'] / tmax) * (width - 2 * pad):.1f},"
            f"{top + height - pad - (v / vmax) * (height - 2 * pad):.1f}"
            for s, v in zip(samples, values, strict=True)
        )
        parts.append(f'<polyline fill="none" stroke="black" points="{points}"/>')
        parts.append(f'<text x="{pad}" y="{top + 20}">{label} (max {vmax:.0f})</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def print_summary(result: dict[str, Any], plot_path: str) -> None:
    s = result["summary"]
    sup = s["supervisor"]
    print(
        f"turns sent {s['turns_sent']}: replied {s['replied']}, "
        f"failed with a reason {s['failed_with_reason']}, "
        f"client closed mid-turn {s['disconnected']} "
        f"(supervisor's final seen for {s['disconnected_final_seen']}), "
        f"client errors {sum(s['client_errors'].values())}, LOST {s['lost']}"
    )
    print(f"  failed by code: {s['failed_by_code']}")
    if s["client_errors"]:
        print(f"  client errors: {s['client_errors']}")
    print(
        f"  watcher saw the final of {s['watch_saw_finals_of_started_turns']} started turns"
        + (f"; watch ended: {s['watch_error']}" if s["watch_error"] else "")
    )
    print(f"  faults: {s['faults']} ({s['sigkills_done']} workers SIGKILLed)")
    print(f"  by kind: {json.dumps(s['by_kind'])}")
    print(f"  reply seconds p50/p99 by kind: {s['reply_seconds_p50_p99_by_kind']}")
    if s["sends_before_second_half"] < s["resend_cache_entries"]:
        print(
            f"  note: {s['sends_before_second_half']} sends before the second half, fewer than "
            f"the {s['resend_cache_entries']} the supervisor remembers for resends: its memory "
            "is still filling that cache, so the RSS slope cannot show flat yet"
        )
    print(
        f"supervisor RSS {sup['rss_mib_start']:.1f} -> max {sup['rss_mib_max']:.1f} -> "
        f"end {sup['rss_mib_end']:.1f} MiB; slope over the second half "
        f"{sup['rss_slope_kib_per_min_second_half']:+.1f} KiB/min"
    )
    print(
        f"supervisor fds {sup['fds_start']} -> max {sup['fds_max']} -> end {sup['fds_end']}; "
        f"slope over the second half {sup['fds_slope_per_min_second_half']:+.2f}/min; "
        f"threads max {sup['threads_max']}; CPU {sup['cpu_percent_of_one_core']}% of a core"
    )
    if result["supervisor_log"].get("by_event"):
        print(f"  supervisor warnings/errors: {result['supervisor_log']['by_event']}")
    if result["supervisor_log"].get("tracebacks"):
        print(f"  supervisor tracebacks: {result['supervisor_log']['tracebacks']}")
    print(f"full results: {RESULTS / 'soak.json'}; plot: {plot_path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="length of the load (30)")
    parser.add_argument("--drivers", type=int, default=10, help="turns in flight at once (10)")
    parser.add_argument("--sessions", type=int, default=24, help="session keys used (24)")
    parser.add_argument("--clients", type=int, default=4, help="client connections shared (4)")
    parser.add_argument(
        "--grace",
        type=float,
        default=30.0,
        help="seconds past the longest turn for the last answers (30)",
    )
    parser.add_argument("--sample", type=float, default=3.0, help="seconds between samples (3)")
    parser.add_argument(
        "--settle",
        type=float,
        default=15.0,
        help="seconds sampled after the drain, with no load (15)",
    )
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--replot", action="store_true", help="only redraw soak.png from the last soak.json"
    )
    args = parser.parse_args()
    if args.replot:
        print(plot(json.loads((RESULTS / "soak.json").read_text()), RESULTS / "soak.png"))
        return 0
    if args.seed is None:
        args.seed = random.randrange(1 << 30)
    confdir = Path(tempfile.mkdtemp(prefix="hss-", dir=os.environ.get("HSB_DIR", "/tmp")))
    config = confdir / "soak.toml"
    write_config(config, "A")
    print(f"soak: {args.minutes:g} min, seed {args.seed}", flush=True)
    sup = Sup("--config", str(config))
    try:
        soak = asyncio.run(soak_run(args, sup, config))
        log = log_summary(sup.log)
        RESULTS.mkdir(exist_ok=True)
        shutil.copy(sup.log, RESULTS / "soak-supervisor.log")
    finally:
        sup.close()
        shutil.rmtree(confdir, ignore_errors=True)
    result = report(soak, args, log)
    (RESULTS / "soak.json").write_text(json.dumps(result, indent=1))
    plot_path = plot(result, RESULTS / "soak.png")
    print_summary(result, plot_path)
    return 1 if result["summary"]["lost"] else 0


if __name__ == "__main__":
    sys.exit(main())
