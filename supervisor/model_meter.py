"""What a sealed session's model calls used, as the model endpoint
(model_gate.py) sees them pass: requests, bytes each way, and the tokens a
response says it used (a JSON body's `usage`, or a stream's events'),
counted per session and per HTTP key (the tenant whose namespace the
session's key is in); and the per-key token budgets an operator sets.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# How much of a JSON response is kept to read its usage from (a model's
# answer is far smaller; a bigger body is forwarded, not metered).
MAX_METERED_JSON = 4 * 1024 * 1024
MAX_SSE_LINE = 1024 * 1024
# A session key in an HTTP key's namespace: NAME+NAMESPACE+id (httpapi/keys.py).
_TENANT_KEY = re.compile(r"([A-Za-z0-9][A-Za-z0-9._@-]{0,63})\+[0-9a-f]{12}\+")
# Usage fields, OpenAI's and Anthropic's names.
INPUT_FIELDS = ("prompt_tokens", "input_tokens")
OUTPUT_FIELDS = ("completion_tokens", "output_tokens")


def tenant_of(session: str) -> str | None:
    """The HTTP key (its name) whose namespace the session is in, or None."""
    found = _TENANT_KEY.match(session)
    return found.group(1) if found else None


def parse_budgets(raw: Mapping[str, str]) -> dict[str, int]:
    """`model_budgets` (key name, or "*" for every other key -> tokens);
    ValueError naming the entry that is not a positive whole number."""
    out = {}
    for name, value in raw.items():
        text = str(value).strip().replace("_", "")
        if not text.isdigit() or int(text) <= 0:
            raise ValueError(
                f"model budget for {name!r}: {value!r} is not a positive number of tokens"
            )
        out[name] = int(text)
    return out


@dataclass
class Meter:
    """One session's or one key's model use since the supervisor started."""

    requests: int = 0
    refused: int = 0
    bytes_in: int = 0  # from the session (request heads and bodies)
    bytes_out: int = 0  # to the session (response heads and bodies)
    input_tokens: int = 0
    output_tokens: int = 0
    last: float | None = None  # wall time of the last request

    @property
    def tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def describe(self) -> dict[str, Any]:
        """For inspect, status and the runs API."""
        return {
            "requests": self.requests,
            "refused": self.refused,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "tokens": self.tokens,
            "last": self.last,
        }


@dataclass
class Usage:
    """What one response says it used (the largest of each count seen: an
    SSE stream may repeat a running total; Anthropic's splits input from
    output across events)."""

    input_tokens: int = 0
    output_tokens: int = 0

    def take(self, obj: Any) -> None:
        """Read a `usage` map from a parsed JSON body or SSE event."""
        if not isinstance(obj, dict):
            return
        for holder in (obj, obj.get("message"), obj.get("response")):
            usage = holder.get("usage") if isinstance(holder, dict) else None
            if not isinstance(usage, dict):
                continue
            self.input_tokens = max(self.input_tokens, _count(usage, INPUT_FIELDS))
            self.output_tokens = max(self.output_tokens, _count(usage, OUTPUT_FIELDS))


def _count(usage: dict[str, Any], names: tuple[str, ...]) -> int:
    for name in names:
        value = usage.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return 0


class UsageReader:
    """Reads a response body as it passes for the usage it reports: a JSON
    body whole (up to MAX_METERED_JSON), an event stream line by line."""

    def __init__(self, content_type: str) -> None:
        self.sse = content_type.startswith("text/event-stream")
        self.json = "json" in content_type
        self.usage = Usage()
        self._buf = bytearray()
        self._overflow = False

    def feed(self, data: bytes) -> None:
        if self._overflow or not (self.sse or self.json):
            return
        self._buf += data
        if self.sse:
            *lines, rest = bytes(self._buf).split(b"\n")
            self._buf = bytearray(rest)
            for line in lines:
                self._event_line(line)
            if len(self._buf) > MAX_SSE_LINE:
                self._buf.clear()  # a line no usage event is that long; skip it
        elif len(self._buf) > MAX_METERED_JSON:
            self._overflow = True
            self._buf.clear()

    def close(self) -> Usage:
        """The body is over: what it said it used."""
        if self.sse and self._buf:
            self._event_line(bytes(self._buf))
        elif self.json and not self._overflow:
            self.usage.take(_loads(bytes(self._buf)))
        self._buf.clear()
        return self.usage

    def _event_line(self, line: bytes) -> None:
        line = line.rstrip(b"\r")
        # Only events that mention usage are parsed: most chunks are tokens.
        if line.startswith(b"data:") and b'"usage"' in line:
            self.usage.take(_loads(line[5:].strip()))


def _loads(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return None
