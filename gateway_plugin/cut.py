"""Turns whose answer a gateway restart cut: delivered when it is back, or their fate told.

A turn runs in its worker whether or not the gateway that started it still
reads it: a gateway that dies (a crash, a kill, a host restart) in the
middle of a turn leaves its run going on the endpoint, and the chat never
got the answer. Each run is written down here (`runs-in-flight.json` in the
plugin's folder of the gateway's HERMES_HOME) when it starts and struck out
once the gateway has its end (answered, stopped, superseded, failed). When
the gateway starts again, each run still written down is asked of the
endpoint: a finished one's answer is sent to its chat (found in Hermes's
session store, as notices are); one still running is followed to its end
first; one that failed, was cancelled or that the endpoint no longer knows
is told in the chat in a line that says so. Hermes's own restart
continuation of the session (resume.py) runs besides, as in process.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from .notices import origin_of

log = logging.getLogger("hermes_sup.gateway_plugin")

LEDGER = "runs-in-flight.json"
# This gateway process: its own runs in flight are not cut, whenever the
# recovery reads them (a turn may start while the gateway is starting).
INCARNATION = uuid.uuid4().hex
MAX_RUNS = 1000  # runs written down at most (the oldest forgotten, logged)
REQUEST_TIMEOUT = 30.0
LOST = (
    "⚠️ The answer to your last message was lost when the gateway restarted; please send it again."
)


def ledger_path() -> Path:
    """Where the runs in flight are written down (HERMES_HOME's hermes-sup folder)."""
    from hermes_constants import get_hermes_home

    return Path(get_hermes_home()) / "hermes-sup" / LEDGER


class InFlight:
    """The runs this gateway started and has not seen the end of, on disk."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> dict[str, dict[str, Any]]:
        """Run id -> {"session_key", "at", "gateway"}; empty when none (or
        unreadable, logged)."""
        try:
            runs = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning(
                "hermes-sup: %s unreadable (%s); its runs are not recovered", self.path, exc
            )
            return {}
        return runs if isinstance(runs, dict) else {}

    def add(self, run_id: str, session_key: str) -> None:
        """Write down a run just started for the gateway session `session_key`."""
        runs = self.read()
        runs[run_id] = {"session_key": session_key, "at": time.time(), "gateway": INCARNATION}
        while len(runs) > MAX_RUNS:
            oldest = min(runs, key=lambda r: float(runs[r].get("at") or 0))
            log.warning("hermes-sup: run %s forgotten (over %d in flight)", oldest, MAX_RUNS)
            del runs[oldest]
        self._write(runs)

    def remove(self, run_id: str) -> None:
        """Strike out a run whose end the gateway has."""
        runs = self.read()
        if runs.pop(run_id, None) is not None:
            self._write(runs)

    def _write(self, runs: dict[str, dict[str, Any]]) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            temp = self.path.with_suffix(".tmp")
            temp.write_text(json.dumps(runs))
            os.replace(temp, self.path)
        except OSError as exc:  # the run goes on; only its recovery is lost
            log.warning("hermes-sup: %s not written: %s", self.path, exc)


async def recover(runner: Any, url: str, headers: dict[str, str]) -> None:
    """Deliver, or tell the fate of, each run a restart of this gateway cut."""
    ledger = InFlight(ledger_path())
    async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT, read=None)) as http:
        for run_id, entry in ledger.read().items():
            if entry.get("gateway") == INCARNATION:
                continue  # a run of this gateway's, followed by its turn
            session_key = str(entry.get("session_key") or "")
            try:
                text = await _fate(http, f"{url}/v1/runs/{run_id}", headers)
            except (httpx.HTTPError, ValueError) as exc:
                log.warning("hermes-sup: run %s not recovered now: %s", run_id, exc)
                continue  # asked again at the next start
            if await _tell(runner, session_key, text):
                log.info("hermes-sup: run %s, cut by a gateway restart, told in its chat", run_id)
            ledger.remove(run_id)


async def _fate(http: httpx.AsyncClient, run_url: str, headers: dict[str, str]) -> str:
    """What to say in the run's chat: its answer once it ended, or its fate."""
    got = await http.get(run_url, headers=headers)
    if got.status_code == 404:
        return LOST
    got.raise_for_status()
    run = got.json()
    if run.get("status") in ("queued", "running"):
        run = await _follow(http, run_url, headers) or run
    status = run.get("status")
    if status == "completed":
        from gateway.platforms.base import BasePlatformAdapter

        # Its files' tags name paths of the worker's host: only the text is sent.
        _, text = BasePlatformAdapter.extract_media(str(run.get("output") or ""))
        return text.strip() or "(No response from remote agent)"
    if status == "failed":
        return f"⚠️ The turn of your last message failed: {run.get('error') or 'no reason given'}"
    if status == "cancelled":
        return "⚠️ The turn of your last message was cancelled while the gateway restarted."
    return LOST


async def _follow(
    http: httpx.AsyncClient, run_url: str, headers: dict[str, str]
) -> dict[str, Any] | None:
    """The run's end, read from its events; None if the stream ended first."""
    ends = {"run.completed": "completed", "run.failed": "failed", "run.cancelled": "cancelled"}
    async with http.stream("GET", f"{run_url}/events", headers=headers) as events:
        if events.status_code != 200:
            return None
        async for line in events.aiter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            status = ends.get(str(event.get("event")))
            if status is not None:
                return {**event, "status": status}
    return None


async def _tell(runner: Any, session_key: str, text: str) -> bool:
    """Send `text` to the chat of the gateway session `session_key`, found
    in Hermes's session store; whether it was sent."""
    source = origin_of(runner, session_key)
    adapter = None
    for platform, candidate in getattr(runner, "adapters", {}).items():
        if source is not None and platform == source.platform:
            adapter = candidate
    if adapter is None:
        log.warning("hermes-sup: no chat of this gateway for %s; a cut turn untold", session_key)
        return False
    try:
        metadata = runner._thread_metadata_for_source(source)
        await adapter.send(source.chat_id, text, metadata=metadata)
    except Exception as exc:  # the chat's loss, not the gateway's
        log.warning("hermes-sup: a cut turn's answer for %s not sent: %s", session_key, exc)
        return False
    return True


def start_recovery(runner: Any, url: str, headers: dict[str, str]) -> asyncio.Task[None]:
    """Recover the cut runs in a task of the gateway's loop."""
    return asyncio.get_running_loop().create_task(recover(runner, url, headers))
