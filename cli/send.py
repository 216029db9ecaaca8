"""`hermes-sup send`: one turn, everything it streams, then its reply.

Output lines, streamed text and the reply go to stdout; what the turn is
doing (queued, tools, approvals, retries) goes to stderr, so a pipe gets the
session's words and the person at the terminal sees the rest.

An approval request is never silent. With a terminal on stdin, send asks
for the choice (once, session, always where allowed, deny) and answers that
very request by its id, while it keeps showing what arrives. Without one,
it says how to answer from elsewhere (`hermes-sup approve`), and a turn
whose approval nobody answered in time ends with exit status 1. A turn that
reports its own exit status (the probe's `sh`) ends send with that status.

Ctrl-C cancels the turn (never the session), waits briefly for the turn to
end, and exits 130; a second Ctrl-C leaves at once.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import click
import zmq

from hermes_sup.client import (
    ApprovalRequest,
    ApprovalTimeout,
    Backoff,
    Client,
    Duplicate,
    Event,
    Output,
    Queued,
    Reply,
    Running,
    StateChange,
    Timeout,
    Token,
    ToolComplete,
    ToolStart,
)
from hermes_sup.client.core import check
from hermes_sup.client.events import to_event
from hermes_sup.protocol import Kind, Message

from . import tool_lines
from .common import Exit
from .terminal import Screen
from .tool_lines import one_line as short

# Silence on a terminal longer than this gets a line saying we still wait.
QUIET_NOTICE = 5.0
# After Ctrl-C: how long to wait for the cancelled turn's final answer.
CANCEL_WAIT = 10.0
SLICE = 0.2


def event_json(event: Event) -> dict[str, Any]:
    """An event as one JSON object: its wire type, data and turn."""
    out: dict[str, Any] = {"type": event.type, "data": event.data, "turn": event.turn}
    if isinstance(event, Reply):
        # A cancelled turn is not ok, whatever its runtime answered.
        out.update(text=event.text, ok=event.ok and not event.cancelled)
        if event.cancelled:
            out["cancelled"] = True
    if event.session is not None:
        out["session"] = event.session
    return out


@dataclass
class Approval:
    """An approval request this turn is waiting on."""

    id: str | None
    command: str
    choices: tuple[str, ...]
    asked: bool = False  # the prompt for it is on screen


@dataclass
class Sender:
    """One `send`: submit, stream, prompt, answer, cancel."""

    client: Client
    key: str
    body: dict[str, Any]
    screen: Screen
    interactive: bool  # a person can answer on stdin
    as_json: bool
    turn_timeout: float | None
    hint_prefix: str  # `hermes-sup [--state-dir D]`, for the commands we suggest
    turn_id: str | None = None  # the turn's id, if the caller chose one
    req: str = ""
    streamed: bool = False
    mid_line: bool = False
    timed_out_approvals: list[str] = field(default_factory=list)
    waiting: list[Approval] = field(default_factory=list)
    answers: dict[str, str] = field(default_factory=dict)  # approve request id -> choice
    shown_queued: bool = False

    # ------------------------------------------------------------ output

    def note(self, text: str, fg: str | None = None) -> None:
        """A line about the turn, on stderr (ending a token stream first)."""
        if self.as_json:
            return
        self._end_stream()
        styled = self.screen.safe(text, err=True)
        if self.screen.clean_err and not os.environ.get("NO_COLOR"):
            styled = click.style(styled, fg=fg, dim=fg is None)
        click.echo(styled, err=True, color=True)

    def _note_if(self, text: str | None) -> None:
        if text is not None:
            self.note(text)

    def _end_stream(self) -> None:
        if self.mid_line:
            click.echo()
            self.mid_line = False

    # -------------------------------------------------------------- run

    def run(self) -> int:
        """Send the turn and follow it to its end; the exit status."""
        self.req = self.client.submit(
            Kind.SEND, self.body, session=self.key, msg_id=self.turn_id, ttl=self.client.timeout
        )
        try:
            reply = self._follow()
        except KeyboardInterrupt:
            return self._interrupted()
        return self._finish(reply)

    def _follow(self) -> Reply:
        client = self.client
        # The supervisor acknowledges at once (queued or running).
        msg: Message | None = client.answer(self.req, timeout=client.timeout)
        deadline = None if self.turn_timeout is None else time.monotonic() + self.turn_timeout
        poller = zmq.Poller()
        poller.register(client.socket, zmq.POLLIN)
        stdin = sys.stdin.fileno() if self.interactive else None
        if stdin is not None:
            poller.register(stdin, zmq.POLLIN)
        last_heard = time.monotonic()
        quiet_said = 0
        while True:
            while msg is not None:  # everything that has arrived, before waiting
                last_heard = time.monotonic()
                quiet_said = 0
                reply = self._take(msg)
                if reply is not None:
                    return reply
                msg = self._next()
            if deadline is not None and time.monotonic() >= deadline:
                raise self._give_up()
            self._prompt_next()
            ready = dict(poller.poll(int(SLICE * 1000)))
            if stdin is not None and stdin in ready and self.interactive:
                self._typed()
                if not self.interactive:
                    poller.unregister(stdin)  # end of input
            msg = self._next()
            if self.waiting:
                # The turn waits on a person (the prompt, or the hint to
                # approve): no "still waiting" over it; silence counts after.
                last_heard = time.monotonic()
                quiet_said = 0
            silent = time.monotonic() - last_heard
            if msg is None and self.screen.clean_err and silent >= QUIET_NOTICE * (quiet_said + 1):
                quiet_said += 1
                self.note(
                    f"· still waiting for {self.key} ({silent:.0f}s without news; "
                    "Ctrl-C cancels the turn)"
                )

    def _next(self) -> Message | None:
        """The next message for us, if one has arrived (never waits long)."""
        while True:
            try:
                msg = self.client.next(timeout=0)
            except Timeout:
                return None
            if msg.re == self.req:
                return msg
            self._other(msg)

    def _other(self, msg: Message) -> None:
        """An answer to one of our approve requests."""
        choice = self.answers.pop(msg.re or "", None)
        if choice is None:
            return
        if msg.kind is Kind.ERROR:
            self.note(f"✗ {msg.body.get('message')} [{msg.body.get('code')}]", fg="red")
        else:
            self.note(f"? answered: {choice}", fg="magenta")

    def _take(self, msg: Message) -> Reply | None:
        """Show one message of the turn; the Reply when it is the last."""
        check(msg)  # an error answer raises its typed error
        event = to_event(msg)
        if self.as_json:
            click.echo(json.dumps(event_json(event), default=str), color=True)
        if isinstance(event, Reply):
            return event
        if isinstance(event, Token):
            if not self.as_json:
                self.screen.out(event.text, nl=False)
                self.mid_line = self.streamed = True
            return None
        if isinstance(event, Output):
            if not self.as_json:
                self._end_stream()
                self.screen.out(event.line)
            return None
        self._show(event)
        return None

    def _show(self, event: Event) -> None:
        if isinstance(event, Queued):
            self.shown_queued = True
            self.note(f"· queued (position {event.position})")
        elif isinstance(event, Running):
            if self.shown_queued:
                self.note(f"· running (worker pid {event.pid})")
        elif isinstance(event, Duplicate):
            self.note("· already sent: following the same turn")
        elif isinstance(event, Backoff):
            self.note(
                f"· the session's worker keeps failing ({event.reason}); "
                f"next try in {event.retry_in:.1f}s",
                fg="yellow",
            )
        elif isinstance(event, ToolStart):
            self.note(tool_lines.started(event.name, event.args, event.data))
        elif isinstance(event, ToolComplete):
            self._note_if(tool_lines.completed(event.name, event.data))
        elif event.type == "tool_progress":
            self._note_if(tool_lines.progress(event.data))
        elif isinstance(event, ApprovalRequest):
            self._approval(event)
        elif isinstance(event, ApprovalTimeout):
            self._approval_timeout(event)
        elif isinstance(event, StateChange):
            pass
        elif event.type == "status":
            data = event.data if isinstance(event.data, dict) else {}
            self.note(f"· {data.get('state', 'status')}: {short(data)}")
        elif event.type == "too_large":
            self.note(f"· an event too large to deliver was left out: {short(event.data)}")
        else:
            self.note(f"· {event.type}: {short(event.data)}")

    # ---------------------------------------------------------- approvals

    def _approval(self, event: ApprovalRequest) -> None:
        choices = list(event.choices)
        if event.allow_permanent and "always" not in choices:
            choices.insert(-1 if "deny" in choices else len(choices), "always")
        approval = Approval(event.id, event.command, tuple(choices))
        self.waiting.append(approval)
        about = f" ({event.description})" if event.description else ""
        self.note(f"? approval needed: {event.command}{about}", fg="magenta")
        if not self.interactive:
            named = f" --id {event.id}" if event.id else ""
            self.note(
                f"  answer with: {self.hint_prefix} approve {self.key} {'|'.join(choices)}{named}",
                fg="magenta",
            )

    def _approval_timeout(self, event: ApprovalTimeout) -> None:
        self.timed_out_approvals.append(event.command)
        gone = next((a for a in self.waiting if a.id == event.id), None)
        if gone is None and self.waiting and event.id is None:
            gone = self.waiting[0]
        if gone is not None:
            self.waiting.remove(gone)
            if gone.asked:
                click.echo(err=True)  # end the unanswered prompt's line
        self.note(
            f"? nobody answered in time: {event.command} was {event.outcome or 'denied'}",
            fg="magenta",
        )

    def _prompt_next(self) -> None:
        """Put up the prompt for the oldest unanswered request, if none is up."""
        if not self.interactive or not self.waiting or any(a.asked for a in self.waiting):
            return
        approval = self.waiting[0]
        approval.asked = True
        self._end_stream()
        click.echo(f"  allow it? [{'/'.join(approval.choices)}] ", nl=False, err=True)

    def _typed(self) -> None:
        """A line typed at the prompt (or stray input, ignored)."""
        data = os.read(sys.stdin.fileno(), 4096)
        asked = next((a for a in self.waiting if a.asked), None)
        if not data:
            # End of input: nobody will answer here; say how to, elsewhere.
            self.interactive = False
            if asked is not None:
                click.echo(err=True)
                asked.asked = False
                named = f" --id {asked.id}" if asked.id else ""
                self.note(
                    f"  answer with: {self.hint_prefix} approve {self.key} "
                    f"{'|'.join(asked.choices)}{named}",
                    fg="magenta",
                )
            return
        if asked is None:
            return
        word = data.decode("utf-8", "replace").strip().lower()
        matches = [c for c in asked.choices if word and c.startswith(word)]
        if len(matches) != 1:
            click.echo(f"  please type one of {', '.join(asked.choices)}: ", nl=False, err=True)
            return
        choice = matches[0]
        self.waiting.remove(asked)
        body = {"choice": choice}
        if asked.id is not None:
            body["approval"] = asked.id  # this request, never a later one
        sent = self.client.submit(Kind.APPROVE, body, session=self.key, ttl=self.client.timeout)
        self.answers[sent] = choice

    # ---------------------------------------------------------- the end

    def _give_up(self) -> click.ClickException:
        self._cancel()
        return click.ClickException(
            f"the turn did not finish within {self.turn_timeout:g}s; it was cancelled"
        )

    def _cancel(self) -> None:
        self.client.submit(Kind.CANCEL, {"turn": self.req}, session=self.key)

    def _interrupted(self) -> int:
        """Ctrl-C: cancel the turn, show how it ended (briefly), exit 130."""
        self._end_stream()
        try:
            self._cancel()
            self.note("cancelling the turn (the session keeps running; Ctrl-C again to leave)")
            deadline = time.monotonic() + CANCEL_WAIT
            while time.monotonic() < deadline:
                msg = self._next()
                if msg is None:
                    time.sleep(0.05)
                    continue
                if msg.kind is Kind.ERROR:
                    self.note(f"✗ {msg.body.get('message')} [{msg.body.get('code')}]")
                    break
                if msg.kind is Kind.REPLY:
                    self.note(f"turn ended: {short(msg.body.get('text', ''))}")
                    break
        except KeyboardInterrupt:
            pass
        except Exception as exc:  # the supervisor went away, say: we leave anyway
            self.note(f"could not cancel the turn: {exc}", fg="red")
        return Exit.INTERRUPTED

    def _finish(self, reply: Reply) -> int:
        if any(a.asked for a in self.waiting):
            click.echo(err=True)  # the turn ended under an unanswered prompt
        if not self.as_json:
            if self.streamed:
                self._end_stream()  # its text is on screen already
            elif not reply.cancelled:  # "cancelled" is no answer to print
                self.screen.out(reply.text)
        if reply.cancelled:
            click.echo(
                f"Error: the turn was cancelled before it finished "
                f"({self.hint_prefix} cancel {self.key}, or the session was stopped)",
                err=True,
            )
            return 1
        if self.timed_out_approvals:
            what = ", ".join(self.timed_out_approvals)
            hint = "answer at the prompt" if self.interactive else "answer with "
            if not self.interactive:
                hint += f"`{self.hint_prefix} approve {self.key} CHOICE`"
            click.echo(
                f"Error: nobody answered the approval for {self.screen.safe(what, err=True)} "
                f"in time, so it was denied; next time {hint} before it times out",
                err=True,
            )
            return 1
        return turn_status(reply)


def turn_status(reply: Reply) -> int:
    """send's exit status for a turn that ended: the turn's own where its
    runtime reports one (the probe's `sh` gives its command's status, as ssh
    passes on the remote command's), 1 for a reply that says it failed, else 0."""
    data = reply.data if isinstance(reply.data, dict) else {}
    status = data.get("exit")
    if isinstance(status, int) and not isinstance(status, bool) and 0 <= status <= 255:
        return status
    return 0 if reply.ok else 1
