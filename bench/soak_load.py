"""The soak's load: the turns it sends, what it records of each, and the
watcher that learns every turn's final answer.

Each driver sends one turn after another by the mix in `pick_turn`: short
ones, `sleep`, `stream`, `sh`, approvals (answered, or left to time out)
and output floods; a turn sent from a client of its own that is closed
once the turn runs (`disconnect_turn`) and an unanswered ask run beside
the driver. bench/soak.py runs the drivers; bench/soak_faults.py the faults.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

from bench.common import Sup
from hermes_sup.client import (
    ApprovalRequest,
    ApprovalTimeout,
    AsyncClient,
    ClientError,
    Running,
    SupervisorError,
)

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
        """Seconds since the load started."""
        return time.monotonic() - self.started

    def loading(self) -> bool:
        """Whether the load is still on."""
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
