"""The soak's faults: SIGKILLs of workers, `kill` and `kill --purge` of
sessions, and `reload` after rewriting the configuration file, each at
random intervals while the load runs, each recorded as a `Chaos` entry.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import psutil

from bench.common import Sup
from bench.soak_load import Chaos, Soak
from hermes_sup.client import AsyncClient, Client, ClientError, SupervisorError

# Two valid settings the configuration file alternates between. What differs
# takes effect at once for new sessions (docs/operations.md, "Reloading
# the configuration"); turn_timeout on each side of the probe's 60 s
# approval timeout makes an unanswered `ask` end both ways: turn_timeout (A) or an approval_timeout then a
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
