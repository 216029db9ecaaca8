"""What a turn said, folded once for every API (no I/O, no clock).

A turn's client events come in order: tokens of the reply, output lines
of commands, tool calls, `Dropped` notices when this endpoint lagged and
the supervisor dropped some of them (PROTOCOL.md, "Slow consumers"), then
its Reply or an error. `Said` keeps what a stream has shown of them, and
`Said.end` turns the last one into an `Ending`: what is still to stream,
the text said, the whole text, and how many events went missing.

The gap rule, the same on every API (docs/http-api.md, "Nothing missing
goes unsaid"): a gap is stated where it happened, in the API's own idiom
(`gap_notice`); the stream ends as its turn ended (a completed turn is not
an error for a gap); and the final event carries the whole text and the
count of events dropped. A stream without a gap is sent as it always was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hermes_sup.client import ClientError, Dropped, Output, Reply, SupervisorError, Token

from .errors import ApiError, from_client_error

END = object()  # closes a QueueSink's reader when the sink gives up (turns.py)

MAX_OUTPUT = 1 << 20  # characters of output lines an answer carries at most
# The SSE event name of a gap on the OpenAI-shaped streams (chat, Responses).
GAP_EVENT = "hermes.stream.gap"


def usage_of(reply: Reply | None) -> dict[str, int]:
    """OpenAI `usage` from the reply's data (zeros when the runtime has none)."""
    data = reply.data if reply is not None and isinstance(reply.data, dict) else {}
    nested = data.get("usage")
    raw: dict[str, Any] = nested if isinstance(nested, dict) else data

    def count(*names: str) -> int:
        for name in names:
            value = raw.get(name)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return 0

    prompt = count("input_tokens", "prompt_tokens")
    completion = count("output_tokens", "completion_tokens")
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": count("total_tokens") or prompt + completion,
    }


def rest_of_reply(streamed: str, reply: Reply) -> str:
    """Text of the reply the client has not seen: all of it if nothing was
    streamed (a runtime that does not stream), the tail if the stream was
    its start; nothing if the stream already showed something else (Hermes
    streams interim text around tool calls, then answers with the last part)."""
    if not streamed:
        return reply.text
    if reply.text.startswith(streamed):
        return reply.text[len(streamed) :]
    return ""


class Outputs:
    """A turn's output lines (a command's, such as the probe's `sh`) as the
    text they make before the reply's: each with its newline, at most
    MAX_OUTPUT characters of them (a command may print without end), then
    one line saying how much was left out."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.size = 0
        self.left_out = 0

    def add(self, item: Output) -> str | None:
        """The text this line adds to the answer; None once it is full."""
        piece = f"{item.line}\n"
        if self.size + len(piece) > MAX_OUTPUT:
            self.left_out += len(piece)
            return None
        self.parts.append(piece)
        self.size += len(piece)
        return piece

    def end(self) -> str:
        """The line that closes the output, if any was left out."""
        return f"[{self.left_out} more characters of output left out]\n" if self.left_out else ""

    @property
    def text(self) -> str:
        return "".join(self.parts) + self.end()


def outputs_of(items: list[Any]) -> str:
    """The output lines among a turn's events as the answer's text (`Outputs`)."""
    lines = [item for item in items if isinstance(item, Output)]
    if not lines:
        return ""  # the usual turn: no command ran
    outputs = Outputs()
    for line in lines:
        outputs.add(line)
    return outputs.text


def failure_of(item: Any) -> tuple[str, str]:
    """The message and code of what ended a stream without a reply: the
    turn's error, or END (the reader fell behind and the turn was cancelled)."""
    if item is END:
        return "the stream fell behind and its turn was cancelled", "stalled"
    if isinstance(item, SupervisorError):
        return item.message, item.code or "error"
    return str(item), type(item).__name__


def reply_of(items: list[Any]) -> Reply:
    """The turn's successful Reply from a whole turn's items (turns.collect);
    an OpenAI-style error for a failure."""
    end = items[-1] if items else None
    if isinstance(end, ClientError):
        raise from_client_error(end)
    if not isinstance(end, Reply):
        raise ApiError(502, "the turn ended without a reply", "agent_incomplete", "server_error")
    if not end.ok:
        raise ApiError(502, end.text or "the agent failed", "agent_error", "server_error")
    return end


def gap_notice(item: Dropped, what: str) -> dict[str, Any]:
    """What every API says where a gap is: how many events of `what` (a
    stream, a run) went missing, why, and that the end carries the whole."""
    return {
        "count": item.count,
        "reason": item.reason,
        "message": f"{item.count} event(s) of this {what} were dropped (this endpoint read "
        "too slowly from the supervisor): the streamed text has a gap here; the final "
        "event carries the whole text",
    }


@dataclass(frozen=True)
class Ending:
    """How a turn's stream ends, as every API needs it."""

    reply: Reply | None  # the turn's Reply (ok or not); None: an error, or END
    failure: tuple[str, str] | None  # message and code when it ended without a reply
    left_out: str  # the line closing the output lines, when some were left out
    rest: str  # what the reply adds to the tokens streamed
    said: str  # the text the stream carried, `left_out` and, for a success, `rest` with it
    whole: str  # the answer's whole text: output lines, then the reply's
    dropped: int  # events of the stream that went missing (0: no gap)

    @property
    def ok(self) -> bool:
        return self.reply is not None and self.reply.ok

    @property
    def text(self) -> str:
        """The text the final event carries: what was said, or, when events
        went missing from a successful turn's stream, the whole of it."""
        return self.whole if self.dropped and self.ok else self.said


class Said:
    """What a turn's stream has shown so far. `resumed`: a retry that
    joined its turn late streams none of it; its text is the reply, at the
    end (chat.py's docstring)."""

    def __init__(self, resumed: bool = False) -> None:
        self.resumed = resumed
        self.tokens: list[str] = []  # the reply's own
        self.parts: list[str] = []  # all the text streamed: output lines and tokens
        self.outputs = Outputs()
        self.dropped = 0

    def add(self, item: Token | Output) -> str:
        """The text this event adds to the stream; "" for none."""
        if self.resumed:
            return ""
        if isinstance(item, Token):
            piece = item.text
            if piece:
                self.tokens.append(piece)
        else:
            piece = self.outputs.add(item) or ""
        if piece:
            self.parts.append(piece)
        return piece

    def drop(self, item: Dropped) -> None:
        self.dropped += item.count

    def end(self, item: Any) -> Ending:
        """The Ending of a stream by its Reply, its error or END."""
        reply = item if isinstance(item, Reply) else None
        rest = rest_of_reply("".join(self.tokens), reply) if reply is not None else ""
        left_out = self.outputs.end()
        said = "".join(self.parts) + left_out + (rest if reply is not None and reply.ok else "")
        whole = self.outputs.text + reply.text if reply is not None else said
        return Ending(
            reply=reply,
            failure=None if reply is not None else failure_of(item),
            left_out=left_out,
            rest=rest,
            said=said,
            whole=whole,
            dropped=self.dropped,
        )
