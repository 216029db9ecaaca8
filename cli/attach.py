"""`hermes-sup attach`: watch a session live and talk to it, like `tmux attach`.

It replays the session's recent events, then shows everything the session
produces (turns started by any client, output, tokens, replies, errors,
state changes such as a worker restarting) and sends each line typed as a
turn. Ctrl-D detaches and never touches the session; Ctrl-C cancels the
running turn, never the session. Several clients may attach at once.

A read-only attach changes nothing: it sends no turn, no approval answer
and no cancel; its Ctrl-C detaches. What the session produced is shown
with its control sequences made visible on a terminal (terminal.py).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import click
import zmq

from hermes_sup.client import Client, NotRunning, Timeout
from hermes_sup.protocol import Kind, Message

from . import tool_lines
from .terminal import Screen

# How often to check that the supervisor still holds its lock.
LIVENESS_EVERY = 1.0
QUIET_STATUS = {"queued", "running", "duplicate"}


class Attached:
    """One attach session: a watch on the supervisor, a terminal on the other side."""

    def __init__(
        self, client: Client, key: str, read_only: bool, color: bool, screen: Screen | None = None
    ) -> None:
        self.client = client
        self.key = key
        self.read_only = read_only
        self.color = color
        self.screen = screen or Screen()
        # Approval requests waiting, oldest first, by id (None: no id given):
        # /approve names the oldest, so it never answers a later one.
        self.approvals: list[str | None] = []
        self.watch_id = ""
        self.mine: set[str] = set()  # turns this terminal sent
        self.seen_turns: set[str] = set()
        self.running: str | None = None
        self.mid_line = False  # a token stream left the cursor mid-line
        self.streamed: set[str | None] = set()  # turns whose reply came as tokens

    def say(self, text: str, fg: str | None = None, dim: bool = False) -> None:
        """Print one line (ending any token stream first); what the session
        sent in it is shown, never obeyed, by the terminal."""
        if self.mid_line:
            click.echo()
            self.mid_line = False
        text = self.screen.safe(text)
        click.echo(click.style(text, fg=fg, dim=dim) if self.color else text, color=True)

    def run(self, replay: int) -> int:
        """Attach until detached; returns the exit status."""
        self.watch_id = self.client.submit(Kind.WATCH, {"replay": replay}, session=self.key)
        first = self.client.answer(self.watch_id)
        assert first.body["type"] == "watching"
        if self.read_only:
            how = "read-only: you can watch, not send, approve or cancel; Ctrl-C or Ctrl-D detaches"
        else:
            how = "type a message and press Enter; Ctrl-D detaches, Ctrl-C cancels a turn"
        self.say(f"attached to {self.key} ({how})", fg="cyan")
        previous = signal.signal(signal.SIGINT, self._on_sigint)
        try:
            return self._loop()
        finally:
            signal.signal(signal.SIGINT, previous)
            try:
                self.client.submit(Kind.UNWATCH, {"watch": self.watch_id})
            except zmq.ZMQError:
                pass

    def _on_sigint(self, signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    def _loop(self) -> int:
        poller = zmq.Poller()
        poller.register(self.client.socket, zmq.POLLIN)
        stdin = sys.stdin.fileno()
        poller.register(stdin, zmq.POLLIN)
        next_check = time.monotonic() + LIVENESS_EVERY
        while True:
            try:
                ready = dict(poller.poll(200))
                self._show_waiting()
                if stdin in ready:
                    data = os.read(stdin, 65536)
                    if not data:
                        self.say("detached; the session keeps running", fg="cyan")
                        return 0
                    for line in data.decode("utf-8", "replace").splitlines():
                        self._typed(line)
                if time.monotonic() >= next_check:
                    next_check = time.monotonic() + LIVENESS_EVERY
                    if self.client.connection.alive() is False:
                        self.say("the supervisor went away; detaching", fg="red")
                        return 3
            except KeyboardInterrupt:
                if self.read_only:
                    return self._detach()  # a read-only client cancels nothing
                self._interrupt()
            except NotRunning:
                self.say("the supervisor went away; detaching", fg="red")
                return 3

    def _show_waiting(self) -> None:
        """Show every answer that has arrived, without waiting."""
        while True:
            try:
                msg = self.client.next(timeout=0)
            except Timeout:
                return
            self._show(msg)

    def _interrupt(self) -> None:
        if self.running is None:
            self.say("no turn is running (Ctrl-D detaches)", fg="cyan")
            return
        self.client.submit(Kind.CANCEL, {"turn": self.running}, session=self.key)
        self.say("cancelling the running turn (the session keeps running)", fg="yellow")

    def _typed(self, line: str) -> None:
        if "\x1d" in line:  # Ctrl-] typed then Enter: detach too, as documented
            raise SystemExit(self._detach())
        if not line.strip():
            return
        if self.read_only:
            self.say("read-only: input ignored", fg="yellow")
            return
        words = line.split()
        if words[0] in ("/approve", "/deny"):
            choice = "deny" if words[0] == "/deny" else (words[1] if len(words) > 1 else "once")
            body = {"choice": choice}
            oldest = self.approvals[0] if self.approvals else None
            if oldest is not None:
                body["approval"] = oldest  # the request on screen, never a later one
            # Kept with our sends so that a refusal (nothing to approve) shows.
            self.mine.add(self.client.submit(Kind.APPROVE, body, session=self.key))
            self.say(f"approval answer sent: {choice}", fg="magenta")
            return
        self.mine.add(self.client.submit(Kind.SEND, {"text": line}, session=self.key))

    def _detach(self) -> int:
        self.say("detached; the session keeps running", fg="cyan")
        return 0

    def _show(self, msg: Message) -> None:
        if msg.re in self.mine and msg.re not in self.seen_turns:
            # The direct answer to our own send: only refusals matter here,
            # everything else arrives through the watch.
            if msg.kind is Kind.ERROR:
                self.say(f"✗ {msg.body['message']} [{msg.body['code']}]", fg="red")
            return
        if msg.re != self.watch_id or msg.kind is not Kind.EVENT:
            return
        body = msg.body
        kind, turn = body["type"], body.get("turn")
        # What an event carries: a map for most kinds (`data`), a string for
        # output and tokens (`raw`).
        raw = body.get("data")
        data: dict[str, Any] = raw if isinstance(raw, dict) else {}
        dim = bool(body.get("replayed"))
        if kind == "turn":
            if turn is not None:
                self.seen_turns.add(turn)
                if not dim:
                    self.running = turn
            who = "you" if turn in self.mine else "turn"
            self.say(f"» [{who}] {data['text']}", fg="blue", dim=dim)
        elif kind == "output":
            self.say(str(raw), dim=dim)
        elif kind == "token":
            self.screen.out(str(raw), nl=False)
            self.mid_line = True
            self.streamed.add(turn)
        elif kind == "reply":
            self._turn_over(turn)
            if turn in self.streamed:  # its text is on screen already, token by token
                self.streamed.discard(turn)
                self.say("◂ (end of reply)", fg="green", dim=True)
            else:
                self.say(f"◂ {data.get('text', '')}", fg="green", dim=dim)
        elif kind == "error":
            self._turn_over(turn)
            self.say(f"✗ {data.get('message')} [{data.get('code')}]", fg="red", dim=dim)
        elif kind == "state":
            self._show_state(data, dim)
        elif kind == "status":
            if isinstance(raw, dict) and data.get("state") not in QUIET_STATUS:
                self.say(f"· {raw}", dim=True)
        elif kind == "approval":
            self.approvals.append(data.get("id"))
            how = (
                "watching only"
                if self.read_only
                else "answer /approve once|session|always or /deny"
            )
            self.say(
                f"? approval requested: {data.get('command')} ({data.get('description')}) - {how}",
                fg="magenta",
                dim=dim,
            )
        elif kind == "approval_timeout":
            self._approval_done(data.get("id"))
            self.say(f"? no answer in time: {data.get('outcome')}", fg="magenta", dim=dim)
        elif kind == "approval_answer":
            self._approval_done(data.get("approval"))
            self.say(f"· approval answered: {data.get('choice')}", dim=True)
        elif kind in ("tool_start", "tool_complete", "tool_progress"):
            line = _tool_line(kind, data)
            if line is not None:
                self.say(line, dim=True)
        else:
            self.say(f"· {kind}: {raw}", dim=True)

    def _approval_done(self, approval: str | None) -> None:
        """A request was answered or timed out: it no longer waits."""
        if approval in self.approvals:
            self.approvals.remove(approval)
        elif self.approvals:
            self.approvals.pop(0)  # no id: requests are answered oldest first

    def _turn_over(self, turn: str | None) -> None:
        if turn is not None and turn == self.running:
            self.running = None
            self.approvals.clear()  # a turn's requests end with it

    def _show_state(self, data: dict[str, Any], dim: bool) -> None:
        state, previous, reason = data["state"], data["previous"], data.get("reason")
        if state == "idle" and previous == "starting":
            self.say(f"· worker ready (pid {data.get('pid')})", fg="cyan", dim=dim)
        elif state == "exited" or state in ("backoff", "failed"):
            why = f": {reason}" if reason else ""
            self.say(f"· worker {state}{why}", fg="yellow", dim=dim)
        elif state == "stopping":
            self.say(f"· stopping: {reason}", fg="yellow", dim=dim)


def _tool_line(kind: str, data: dict[str, Any]) -> str | None:
    """One readable line per tool call, as `send` shows it (tool_lines.py)."""
    name = str(data.get("name") or data.get("tool") or "")
    if kind == "tool_start":
        return tool_lines.started(name, data.get("args"), data)
    if kind == "tool_complete":
        return tool_lines.completed(name, data)
    return tool_lines.progress(data)
