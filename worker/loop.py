"""A session's worker once it has its session: the main loop (`WorkerLoop`),
its one socket to the supervisor (`Link`) and the one thread that runs turns
(`TurnThread`).

The main loop never runs agent code. It polls the supervisor socket and a
wake-up pipe, forwards what the turn thread produced (stream deltas merged
within a short window: worker/coalesce.py), and watches for the
supervisor's death. The turn runs in one thread at a time, so the main loop
stays responsive for cancel and stop while an agent thinks. How the process
got here (fork, its own process group, directories, environment) is
worker/main.py's business.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any, cast

import psutil
import zmq

from hermes_sup.protocol import (
    DEFAULT_MAX_FRAME_SIZE,
    ErrorCode,
    Kind,
    Limits,
    Message,
    RemoteProtocolError,
    WorkerExit,
    decode,
    encode,
    error_message,
)
from hermes_sup.seal import steps

from . import parent
from . import runtime as runtime_mod
from .coalesce import MAX_MERGED_BYTES, Coalescer, delta_type
from .identity import apply_chat_identity, fixed_identity

# The longest the main loop sleeps. An idle worker wakes only to heartbeat;
# the supervisor's death wakes it at once (parent-death signal -> wake pipe).
MAX_POLL_MS = 60_000
SNDMORE, NOBLOCK = int(zmq.SNDMORE), int(zmq.NOBLOCK)
EVENTS, POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
# The backend's send and recv, unbound: pyzmq's wrappers cost a Python frame
# per zmq frame, and getsockopt(RCVMORE) an enum conversion.
_send, _recv = zmq.backend.Socket.send, zmq.backend.Socket.recv
# A cancel is repeated this often until its turn ends: a runtime that resets
# its cancel flag as the turn begins cannot lose one that came just before.
CANCEL_REPEAT_MS = 50
# What the supervisor may send us: a client's text of up to the frame limit,
# in a turn's envelope (as supervisor/endpoints.py's worker_limits).
ENVELOPE_ROOM = 64 * 1024
UNBOUNDED = Limits(max_frame_size=sys.maxsize)

log = logging.getLogger("hermes_sup.worker")


def kill_tree() -> int:
    """SIGKILL every descendant of this process; returns how many."""
    try:
        procs = psutil.Process().children(recursive=True)
    except psutil.Error:
        return 0
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    return len(procs)


class TurnThread:
    """The one thread that runs a worker's turns, fed one at a time:
    starting a thread per turn cost more than a small turn's routing."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="turn", daemon=True)
        self.thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        self.jobs.put(job)  # first: a new thread finds it waiting
        if self.thread is None:
            self.start()

    def stop(self) -> None:
        self.jobs.put(None)

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            job()


class Link:
    """The worker's zmq context and its one socket to the supervisor.
    `endpoint`: where to connect instead of the request's (a sealed worker's
    descriptor of the socket: see `wait_connected`)."""

    def __init__(self, req: dict[str, Any], endpoint: str | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # The supervisor chose this routing id; our token signs every frame.
        self.sock.setsockopt(zmq.ROUTING_ID, bytes(req["worker_id"]))
        if endpoint is not None:
            # Writable only once connected, so wait_connected can tell.
            self.sock.setsockopt(zmq.IMMEDIATE, 1)
        self.sock.connect(endpoint or req["endpoint"])
        self.token = bytes(req["token"])
        self.set_limit(req)
        # Signals (the supervisor's death: PR_SET_PDEATHSIG, whose handler
        # does nothing) and the turn thread wake whoever waits on the socket
        # through this pipe: a zmq poll alone would resume after a signal.
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)

    def wait_connected(self, supervisor_pid: int) -> bool:
        """Wait until the connection to the supervisor is made (a sealed
        worker then closes the descriptor it connected through); False if
        the supervisor is gone first."""
        while parent.alive(supervisor_pid):
            if self.sock.poll(100, zmq.POLLOUT):
                return True
        return False

    def drain_wake(self) -> None:
        """Empty the wake pipe (what woke us has been seen)."""
        try:
            while len(os.read(self.wake_r, 4096)) == 4096:
                pass
        except BlockingIOError:
            pass

    def set_limit(self, req: dict[str, Any]) -> None:
        """Take the supervisor's frame limit from a spawn request (a spare
        learns it with its session)."""
        self.limit = int(req.get("max_frame_size") or DEFAULT_MAX_FRAME_SIZE)
        self.receive_limits = Limits(
            max_frame_size=max(self.limit, DEFAULT_MAX_FRAME_SIZE) + ENVELOPE_ROOM
        )

    def send(self, msg: Message) -> None:
        """Sign and send. Frame by frame with int flags: pyzmq's
        send_multipart does enum arithmetic per frame, a noticeable share
        of a small turn. A message over the supervisor's frame limit would
        never reach the turn's client: a short one saying so goes instead."""
        *more, last = encode(msg, self.token, UNBOUNDED)
        if len(last) > self.limit:
            log.warning(
                "a %s of %d bytes is over the %d-byte frame limit; sent a too_large notice instead",
                msg.kind.value,
                len(last),
                self.limit,
            )
            *more, last = encode(too_large_stand_in(msg, len(last), self.limit), self.token)
        for frame in more:
            _send(self.sock, frame, SNDMORE)
        _send(self.sock, last, 0)

    def wait_for_session(self, supervisor_pid: int) -> dict[str, Any] | None:
        """A spare worker's life before its session: say it is ready, then
        wait for the supervisor to assign it one (the spawn request it would
        have been forked with). None: told to stop, or the supervisor is gone."""
        self.send(Message(Kind.SPARE, {"pid": steps.outside_pid()}))
        # The supervisor's death wakes this wait through the wake pipe: a
        # spare of a supervisor killed with its zygote must not sleep on.
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.wake_r, zmq.POLLIN)
        while parent.alive(supervisor_pid):
            ready = dict(poller.poll(MAX_POLL_MS))
            if self.wake_r in ready:
                self.drain_wake()
            if self.sock not in ready:
                continue
            try:
                msg = decode(self.sock.recv_multipart(), self.token, self.receive_limits)
            except RemoteProtocolError as exc:
                log.warning("dropped a bad frame from the supervisor: %s", exc)
                continue
            if msg.kind is Kind.ASSIGN:
                return {**msg.body["request"], "token": self.token}
            if msg.kind is Kind.STOP:
                return None
        return None


def too_large_stand_in(msg: Message, size: int, limit: int) -> Message:
    """What is sent instead of `msg`, `size` bytes encoded, over the
    supervisor's frame limit: for an event, a `too_large` event naming its
    type and size; for a turn's final answer, a `too_large` error (the turn
    ends, the worker goes on). The supervisor says the same for a worker
    that did not keep to the limit (supervisor/back.py)."""
    if msg.kind is Kind.EVENT:
        data = {"event": str(msg.body.get("type")), "bytes": size, "limit": limit}
        return Message(
            Kind.EVENT, {"type": "too_large", "data": data}, session=msg.session, re=msg.re
        )
    return error_message(
        ErrorCode.TOO_LARGE.value,
        f"the turn's {msg.kind.value} is {size} bytes, over the {limit}-byte frame limit "
        "(max_frame_size); it was not delivered",
        re=msg.re,
        session=msg.session,
    )


class WorkerLoop:
    """The worker's main loop: one socket to the supervisor, one turn thread."""

    def __init__(
        self,
        req: dict[str, Any],
        agent: runtime_mod.Runtime,
        link: Link | None = None,
        turns: TurnThread | None = None,
    ) -> None:
        self.key: str = req["key"]
        self.token: bytes = bytes(req["token"])
        self.supervisor_pid = int(req["supervisor_pid"])
        self.agent = agent
        # The chat identity the session was opened with: no turn changes it.
        self.fixed_identity = fixed_identity(os.environ)
        self.link = link or Link(req)
        self.link.set_limit(req)
        self.ctx, self.sock = self.link.ctx, self.link.sock
        self.outbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        # Stream deltas merged within a window: the spawn request's
        # `coalesce_ms` (the supervisor's stream_coalesce_ms); a request
        # without one, from a supervisor that does not know it, keeps one
        # event per delta. A merged event stays a small fraction of the
        # frame limit (a character may take 4 bytes, the envelope some more).
        self.coalescer = Coalescer(
            self._deliver,
            float(req.get("coalesce_ms") or 0.0),
            min(MAX_MERGED_BYTES, max(1024, self.link.limit // 8)),
        )
        # True while the main loop holds a delta and so wakes by its window's
        # end anyway: the turn thread then posts deltas without waking it.
        self._quiet = False
        self._wake_r, self._wake_w = self.link.wake_r, self.link.wake_w
        self.turns = turns or TurnThread()  # a spare started its own already
        self.turn: str | None = None  # the running turn's id
        self.cancelling: str | None = None  # the turn a cancel is repeated for
        self.stopping = False
        self.heartbeat = float(req.get("heartbeat", 1.0))
        # Idle, it beats less often: the supervisor allows an idle worker a
        # longer silence, and thousands of idle sessions cost little.
        self.idle_heartbeat = max(self.heartbeat, float(req.get("idle_heartbeat", 0.0)))
        self._next_beat = 0.0
        # The session's first turn, when it came with the spawn request.
        self.first_turn: dict[str, Any] | None = req.get("turn")
        # A runtime that speaks outside turns (a background process ended)
        # is given the way to (PROTOCOL.md, "Notices").
        set_notify = getattr(agent, "set_notify", None)
        if callable(set_notify):
            set_notify(self.notify)

    def run(self) -> int:
        """Serve turns until asked to stop or the supervisor goes away."""
        self._send(Message(Kind.HELLO, {"pid": steps.outside_pid()}, session=self.key))
        if self.first_turn is not None:
            # Hello first, then the turn: the supervisor counts the turn as
            # started when it reads the hello.
            self._start_turn(str(self.first_turn["id"]), str(self.first_turn["text"]))
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        code = WorkerExit.OK
        while True:
            until_beat = max(0.0, self._next_beat - time.monotonic())
            wait_ms = min(MAX_POLL_MS, int(until_beat * 1000) + 1)
            if self.cancelling is not None:
                wait_ms = min(wait_ms, CANCEL_REPEAT_MS)
            held_until = self.coalescer.deadline
            if held_until is not None:
                wait_ms = min(wait_ms, max(0, int((held_until - time.monotonic()) * 1000) + 1))
            ready = dict(poller.poll(wait_ms))
            if not parent.alive(self.supervisor_pid):
                log.error("supervisor (pid %d) is gone; stopping", self.supervisor_pid)
                code = WorkerExit.SUPERVISOR_GONE
                break
            if self._wake_r in ready:
                self.link.drain_wake()
            if self.sock in ready:
                self._recv_all()
            self._flush_outbox()
            if self.cancelling is not None:
                if self.cancelling == self.turn:
                    self._cancel()
                else:
                    self.cancelling = None  # that turn is over
            if self.stopping and self.turn is None:
                break
            now = time.monotonic()
            if now >= self._next_beat:
                # From the main loop, never the turn thread: a long turn is
                # busy, a silent main loop is hung.
                self._send(
                    Message(Kind.HEARTBEAT, {"busy": self.turn is not None}, session=self.key)
                )
                busy = self.turn is not None
                self._next_beat = now + (self.heartbeat if busy else self.idle_heartbeat)
        self.turns.stop()
        killed = kill_tree()
        if killed:
            log.info("killed %d leftover process(es) of this session", killed)
        self.sock.close(0)
        self.ctx.term()
        return code

    def _send(self, msg: Message) -> None:
        self.link.send(msg)

    def _recv_all(self) -> None:
        more = True
        while more:
            frames = []
            try:
                while True:
                    frame = _recv(self.sock, NOBLOCK, copy=False)
                    frames.append(frame.bytes)
                    if not frame.more:
                        break
            except zmq.Again:
                return
            more = bool(int(self.sock.getsockopt(EVENTS)) & POLLIN)  # not one recv too many
            try:
                msg = decode(frames, self.token, self.link.receive_limits)
            except RemoteProtocolError as exc:
                log.warning("dropped a bad frame from the supervisor: %s", exc)
                continue
            self._dispatch(msg)

    def _dispatch(self, msg: Message) -> None:
        if msg.kind is Kind.TURN:
            if self.turn is not None:
                # The supervisor sends one turn at a time; this is its bug, say so.
                self._send(
                    error_message(
                        ErrorCode.INTERNAL.value,
                        "a turn is already running",
                        re=msg.id,
                        session=self.key,
                    )
                )
                return
            self._start_turn(msg.id, msg.body["text"], msg.body.get("context"))
        elif msg.kind is Kind.CANCEL:
            self._cancel()
        elif msg.kind is Kind.STOP:
            self.stopping = True
            self._cancel()
        elif msg.kind is Kind.APPROVE:
            answer = getattr(self.agent, "answer", None)
            if callable(answer):
                try:
                    named = msg.body.get("approval")
                    if named:  # the request it answers, for runtimes that give ids
                        answer(msg.body["choice"], named)
                    else:
                        answer(msg.body["choice"])
                except Exception:
                    log.exception("approval answer failed")
        else:
            log.warning("ignored a %s message from the supervisor", msg.kind.value)

    def _start_turn(self, turn_id: str, text: str, context: dict[str, Any] | None = None) -> None:
        self.turn = turn_id
        # Busy now: the next beat comes at the busy pace, not the idle one.
        self._next_beat = min(self._next_beat, time.monotonic() + self.heartbeat)
        self.turns.submit(partial(self._run_turn, turn_id, text, context))

    def _cancel(self) -> None:
        self.cancelling = self.turn
        cancel = getattr(self.agent, "cancel", None)
        if self.turn is not None and callable(cancel):
            try:
                cancel()
            except Exception:
                log.exception("runtime cancel failed")

    def _run_turn(self, turn_id: str, text: str, context: dict[str, Any] | None = None) -> None:
        """Run the agent for one turn; queue its events and its answer. A
        turn's `context` goes to a runtime whose run_turn takes one; another
        runtime gets the text alone (and the context is logged as unused)."""

        def emit(event_type: str, data: Any = None) -> None:
            self._post(
                Message(
                    Kind.EVENT,
                    {"type": str(event_type), "data": data},
                    session=self.key,
                    re=turn_id,
                )
            )

        try:
            apply_chat_identity(context, self.fixed_identity)
            if context and "session_env" in context:  # the worker's, now in os.environ
                context = {k: v for k, v in context.items() if k != "session_env"} or None
            if context and runtime_mod.takes_context(self.agent):
                agent = cast(runtime_mod.TakesContext, self.agent)
                result = agent.run_turn(text, emit, context=context)
            else:
                if context:
                    log.warning("the runtime takes no turn context; ignored: %s", sorted(context))
                result = self.agent.run_turn(text, emit)
            if isinstance(result, str):
                result = runtime_mod.TurnReply(result)
            final = Message(
                Kind.REPLY,
                {"text": result.text, "ok": True, "data": result.data},
                session=self.key,
                re=turn_id,
            )
        except Exception as exc:
            log.exception("turn failed")
            final = error_message(
                ErrorCode.TURN_FAILED.value,
                f"{type(exc).__name__}: {exc}",
                re=turn_id,
                session=self.key,
            )
        self._post(final)  # the last thing this thread does

    def notify(self, data: Any) -> None:
        """Send a notice: an event outside any turn (from any thread)."""
        self._post(Message(Kind.EVENT, {"type": "notice", "data": data}, session=self.key))

    def _post(self, msg: Message) -> None:
        self.outbox.put(msg)
        # Put first, then read the flag: the main loop clears it before it
        # drains the outbox, so a delta posted unwoken is drained all the same.
        if self._quiet and delta_type(msg) is not None:
            return  # the main loop wakes at its window's end and takes it then
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full, so the main loop is awake anyway

    def _flush_outbox(self) -> None:
        """Send what the turn thread produced, through the coalescer."""
        self._quiet = False
        coalescer = self.coalescer
        now = time.monotonic()
        coalescer.tick(now)
        while not self.outbox.empty():  # this thread alone takes from it
            coalescer.offer(self.outbox.get_nowait(), now)
        self._quiet = coalescer.holding

    def _deliver(self, msg: Message) -> None:
        """Send one of the turn's messages (the coalescer's way out)."""
        final = msg.kind is not Kind.EVENT
        if final and self.turn is not None:
            # The final answer is the turn's last act: mark it over
            # before the supervisor, seeing it, sends the next one.
            self.turn = None
        try:
            self._send(msg)
        except Exception as exc:  # e.g. an event whose data msgpack cannot carry
            log.error("cannot send %s: %s", msg.kind.value, exc)
            if final:
                self._send(
                    error_message(
                        ErrorCode.TURN_FAILED.value,
                        f"the reply could not be sent: {exc}",
                        re=msg.re,
                        session=self.key,
                    )
                )
