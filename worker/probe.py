"""The probe runtime: a diagnostic agent that needs no model.

It lets tests and operators see a session's isolation for themselves:

    env NAME           the value of NAME in this worker's os.environ ("" if unset)
    setenv NAME VALUE  set NAME in this worker's os.environ (kept in the
                       session's home, so a hibernated session woken later
                       has it again)
    cwd                this worker's current directory
    pid                this worker's pid
    sh COMMAND         run COMMAND with /bin/sh in the workspace, streaming its
                       output lines as events; the reply is its exit status
    sleep SECONDS      sleep (cancellable)
    spin SECONDS       burn CPU for SECONDS without letting the worker's main
                       loop run, so no heartbeat is sent (a busy worker that
                       looks silent, as under a C extension that keeps the
                       GIL or a CPU-starved machine); not cancellable
    write PATH TEXT    write TEXT to PATH, relative to the workspace
    stream TEXT        stream TEXT back word by word as `token` events
    ask COMMAND        ask for approval (an `approval` event), then run COMMAND
                       as `sh` does if allowed; no answer in 60 s is a deny
    context            the turn's context from the front end, as sorted JSON
    media PATH [voice] send the file at PATH (relative to the workspace) to the
                       user as a `media` event, as a voice note with `voice`
    notice [N] JSON    send JSON as a notice (an event outside any turn), N times
    peers              the other live sessions on this session's repository (from
                       .hermes-sup/peers, which the supervisor rewrites each turn)
    anything else      echoed back
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from hermes_sup.seal import steps

from .media import media_event
from .runtime import Emit, SessionInfo, TurnReply

MAX_SLEEP = 24 * 3600.0
MAX_SPIN = 60.0
APPROVAL_TIMEOUT = 60.0
STREAM_DELAY = 0.02
# Where the supervisor lists a session's peers (supervisor/peers.py).
PEERS_PATH = ".hermes-sup/peers"
# What `setenv` set, in the session's home: what the probe keeps across a
# hibernation (a woken worker reads it back at start).
SETENV_FILE = ".probe-env.json"


class ProbeError(Exception):
    """A probe command was used wrongly; the message says how to use it."""


class ProbeRuntime:
    """Answers the probe commands for one session."""

    def __init__(self, session: SessionInfo) -> None:
        self.session = session
        self._cancelled = threading.Event()
        self._proc: subprocess.Popen[bytes] | None = None
        # Answers as (choice, the approval id they name, or None).
        self._answers: queue.Queue[tuple[str, str | None]] = queue.Queue()
        self._asked = 0  # approval requests made, for their ids
        self._context: dict[str, Any] | None = None
        self._notify: Any = None  # the worker's way to send notices
        os.environ.update(self._kept_env())  # a woken session's earlier setenv

    def run_turn(self, text: str, emit: Emit, context: dict[str, Any] | None = None) -> TurnReply:
        """Handle one probe command."""
        self._context = context
        self._cancelled.clear()
        command, _, rest = text.strip().partition(" ")
        handler = getattr(self, f"_do_{command}", None)
        if handler is None or command.startswith("_"):
            return TurnReply(text)
        return handler(rest, emit)

    def answer(self, choice: str, approval: str | None = None) -> None:
        """A person's answer to the pending approval (from the main thread);
        `approval` names the request it answers."""
        self._answers.put((choice, approval))

    def cancel(self) -> None:
        """Interrupt a running `sleep`, `sh` or `ask` (from the worker's main thread)."""
        self._cancelled.set()
        self._answers.put(("deny", None))
        proc = self._proc
        if proc is not None:
            try:
                tree = psutil.Process(proc.pid).children(recursive=True)
            except psutil.Error:
                tree = []
            for p in [proc, *tree]:
                try:
                    p.send_signal(signal.SIGKILL)
                except (psutil.Error, ProcessLookupError):
                    pass

    def set_notify(self, notify: Any) -> None:
        self._notify = notify

    def _do_notice(self, rest: str, emit: Emit) -> TurnReply:
        count, _, raw = rest.strip().partition(" ")
        if not count.isdigit():
            count, raw = "1", rest.strip()
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise ProbeError(f"usage: notice [N] JSON ({exc})") from None
        for _ in range(min(int(count), 10_000)):
            self._notify(data)
        return TurnReply(f"sent {count} notice(s)")

    def _do_media(self, rest: str, emit: Emit) -> TurnReply:
        path, _, voice = rest.strip().partition(" ")
        if not path or voice not in ("", "voice"):
            raise ProbeError("usage: media PATH [voice]")
        event = media_event(self.session.workspace / path, voice == "voice")
        emit("media", event)
        return TurnReply(event.get("error") or f"sent {event['name']}")

    def _do_context(self, rest: str, emit: Emit) -> TurnReply:
        return TurnReply(json.dumps(self._context, sort_keys=True))

    def _do_peers(self, rest: str, emit: Emit) -> TurnReply:
        # Read as an agent would find it: in the workspace, fresh this turn.
        path = self.session.workspace / PEERS_PATH
        try:
            text = path.read_text()
        except FileNotFoundError:
            return TurnReply(
                "this session works on no repository: it has no peers", {"peers": None}
            )
        peers = []
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, branch, state, label = (line.split("\t") + ["", "", "", ""])[:4]
                peers.append(
                    {
                        "session": key,
                        "branch": branch,
                        "state": state,
                        "label": None if label in ("", "-") else label,
                    }
                )
        if not peers:
            return TurnReply("no other session is live on this repository", {"peers": []})
        lines = [f"{p['session']} {p['branch']} {p['state']}" for p in peers]
        return TurnReply("\n".join(lines), {"peers": peers})

    def _do_env(self, rest: str, emit: Emit) -> TurnReply:
        name = rest.strip()
        if not name:
            raise ProbeError("usage: env NAME")
        return TurnReply(os.environ.get(name, ""), {"name": name, "set": name in os.environ})

    def _do_setenv(self, rest: str, emit: Emit) -> TurnReply:
        name, _, value = rest.strip().partition(" ")
        if not name or "=" in name or "\0" in name + value:
            raise ProbeError("usage: setenv NAME VALUE")
        os.environ[name] = value
        kept = self._kept_env()
        kept[name] = value
        path = self.session.home / SETENV_FILE
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(kept))
        tmp.replace(path)
        return TurnReply(f"{name}={value}")

    def _kept_env(self) -> dict[str, str]:
        """What `setenv` set in this session before (its home's file)."""
        try:
            kept = json.loads((self.session.home / SETENV_FILE).read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(kept, dict):
            return {}
        return {k: v for k, v in kept.items() if isinstance(k, str) and isinstance(v, str)}

    def _do_cwd(self, rest: str, emit: Emit) -> TurnReply:
        return TurnReply(os.getcwd())

    def _do_pid(self, rest: str, emit: Emit) -> TurnReply:
        # As the supervisor (and `list`) see it: a sealed worker is pid 1 of
        # its own namespace.
        return TurnReply(str(steps.outside_pid()))

    def _do_sleep(self, rest: str, emit: Emit) -> TurnReply:
        try:
            seconds = float(rest)
        except ValueError:
            raise ProbeError("usage: sleep SECONDS") from None
        if not 0 <= seconds <= MAX_SLEEP:
            raise ProbeError(f"sleep takes 0 to {MAX_SLEEP:.0f} seconds")
        if self._cancelled.wait(seconds):
            return TurnReply("cancelled", {"cancelled": True})
        return TurnReply(f"slept {seconds:g}")

    def _do_spin(self, rest: str, emit: Emit) -> TurnReply:
        try:
            seconds = float(rest)
        except ValueError:
            raise ProbeError("usage: spin SECONDS") from None
        if not 0 <= seconds <= MAX_SPIN:
            raise ProbeError(f"spin takes 0 to {MAX_SPIN:.0f} seconds")
        # A thread waiting for the GIL asks for it only after the switch
        # interval: raised past the spin, the main loop (which heartbeats)
        # gets no turn while this thread burns CPU in plain Python.
        before = sys.getswitchinterval()
        sys.setswitchinterval(seconds + 1.0)
        try:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                pass
        finally:
            sys.setswitchinterval(before)
        return TurnReply(f"spun {seconds:g}")

    def _do_write(self, rest: str, emit: Emit) -> TurnReply:
        name, _, content = rest.strip().partition(" ")
        if not name:
            raise ProbeError("usage: write PATH TEXT")
        workspace = Path.cwd().resolve()
        target = (workspace / name).resolve()
        if target != workspace and workspace not in target.parents:
            raise ProbeError(f"{name!r} is outside the workspace")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content)
        return TurnReply(f"wrote {len(content.encode())} bytes to {name}", {"path": str(target)})

    def _do_stream(self, rest: str, emit: Emit) -> TurnReply:
        words = rest.split(" ")
        for i, word in enumerate(words):
            if self._cancelled.wait(STREAM_DELAY):
                return TurnReply("cancelled", {"cancelled": True})
            emit("token", word if i == 0 else " " + word)
        return TurnReply(rest)

    def _do_ask(self, rest: str, emit: Emit) -> TurnReply:
        if not rest.strip():
            raise ProbeError("usage: ask COMMAND")
        while not self._answers.empty():  # an answer left over from an earlier turn
            self._answers.get_nowait()
        choices = ["once", "session", "deny"]
        self._asked += 1
        approval = f"probe-{self._asked}"
        emit(
            "approval",
            {
                "id": approval,
                "command": rest,
                "description": "the probe asks before running a shell command",
                "allow_permanent": False,
                "pattern_keys": [],
                "choices": choices,
            },
        )
        deadline = time.monotonic() + APPROVAL_TIMEOUT
        while True:
            try:
                choice, named = self._answers.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                emit("approval_timeout", {"id": approval, "command": rest, "outcome": "deny"})
                choice = "deny"
                break
            if named in (None, approval):
                break  # an answer meant for an earlier request is not this one's
        if self._cancelled.is_set():
            return TurnReply("cancelled", {"cancelled": True})
        if choice not in ("once", "session", "always"):
            return TurnReply(f"denied: {rest}", {"approved": False})
        return self._do_sh(rest, emit)

    def _do_sh(self, rest: str, emit: Emit) -> TurnReply:
        if not rest.strip():
            raise ProbeError("usage: sh COMMAND")
        proc = subprocess.Popen(
            ["/bin/sh", "-c", rest],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self._proc = proc
        try:
            assert proc.stdout is not None
            for raw in proc.stdout:
                emit("output", raw.decode("utf-8", "replace").rstrip("\n"))
            status = proc.wait()
        finally:
            self._proc = None
        if self._cancelled.is_set():
            return TurnReply("cancelled", {"cancelled": True, "exit": status})
        return TurnReply(f"exit {status}", {"exit": status})
