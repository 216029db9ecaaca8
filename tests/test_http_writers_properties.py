"""Property tests of the gap rule over event sequences (said.py): for any
turn, and any stretch of its events dropped on the way, every API ends
with the whole text (the output lines that arrived, then the reply, which
is never lost), and states a gap exactly when events went missing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from hermes_sup.client import Dropped, Event, Output, Reply, Token
from hermes_sup.httpapi.said import GAP_EVENT, Said
from hermes_sup.httpapi.writers import ChatChunks, ResponsesEvents, RunEvents
from tests.test_http_writers import chat_text, last_chunk, tool_complete, tool_start

TEXT = st.text(alphabet="ab \n", max_size=12)


@dataclass
class Turn:
    """A turn as its worker sent it, and as the endpoint received it."""

    received: list[Event]
    dropped: int  # events lost on the way (0: none)

    @property
    def whole(self) -> str:
        """The answer's whole text, from what could reach the endpoint: its
        output lines that arrived, then the reply."""
        lines = "".join(f"{e.line}\n" for e in self.received if isinstance(e, Output))
        reply = self.received[-1]
        assert isinstance(reply, Reply)
        return lines + reply.text


@st.composite
def turns(draw: st.DrawFn) -> Turn:
    lines = draw(st.lists(TEXT.filter(lambda s: "\n" not in s), max_size=3))
    text = draw(TEXT)
    # A streaming runtime streams its reply's start, or all of it, in pieces.
    streamed = text[: draw(st.integers(0, len(text)))]
    cuts = sorted(draw(st.lists(st.integers(0, len(streamed)), max_size=4)))
    pieces = [streamed[a:b] for a, b in zip([0, *cuts], [*cuts, len(streamed)], strict=True)]
    sent: list[Event] = [Output("output", line=line) for line in lines]
    sent += [Token("token", text=piece) for piece in pieces if piece]
    for n in range(draw(st.integers(0, 2))):  # tool calls anywhere among them
        at = draw(st.integers(0, len(sent)))
        sent[at:at] = [tool_start(f"c{n}"), tool_complete(f"c{n}")]
    # The supervisor drops a stretch of the stream for a lagging reader,
    # and says how many; never the reply (the client asks for it again).
    lost = 0
    if sent and draw(st.booleans()):
        start = draw(st.integers(0, len(sent) - 1))
        lost = draw(st.integers(1, len(sent) - start))
        sent[start : start + lost] = [Dropped("dropped", count=lost, reason="slow_consumer")]
    return Turn([*sent, Reply("reply", text=text)], lost)


@given(turns())
def test_chat_ends_with_the_whole_text_and_states_a_gap_iff_one_happened(turn: Turn) -> None:
    writer = ChatChunks(Said(), "c", 1, "m")
    events = writer.start()
    for item in turn.received:
        events += writer(item)
    last = last_chunk(events)
    assert last["choices"][0]["finish_reason"] == "stop"
    stated = [e.data["count"] for e in events if e.event == GAP_EVENT]
    assert sum(stated) == turn.dropped
    assert ("hermes" in last) == bool(turn.dropped)
    said = last["hermes"]["text"] if turn.dropped else chat_text(events)
    assert said == turn.whole


@given(turns())
def test_responses_end_with_the_whole_text_and_state_a_gap_iff_one_happened(turn: Turn) -> None:
    base: dict[str, Any] = {"id": "r", "object": "response", "output": []}
    writer = ResponsesEvents(Said(), base, "msg")
    events = [e.data for e in writer.start()]
    for item in turn.received:
        events += [e.data for e in writer(item)]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and final["status"] == "completed"
    assert final["output"][-1]["content"][0]["text"] == turn.whole
    for done in (e for e in events if e["type"] == "response.output_text.done"):
        assert done["text"] == turn.whole
    stated = [e["count"] for e in events if e["type"] == GAP_EVENT]
    assert sum(stated) == turn.dropped
    assert final.get("hermes") == ({"dropped": turn.dropped} if turn.dropped else None)


@given(turns())
def test_runs_end_with_the_whole_text_and_state_a_gap_iff_one_happened(turn: Turn) -> None:
    writer = RunEvents()
    events = [event for item in turn.received for event in writer(item)]
    last = events[-1]
    assert last["event"] == "run.completed" and last["output"] == turn.whole
    stated = [e["count"] for e in events if e["event"] == "events.dropped"]
    assert sum(stated) == turn.dropped
    assert last.get("dropped") == (turn.dropped or None)
