"""A Responses API answer's output items, as Hermes's API server shapes
them: the assistant message with its text part, each tool call as a
`function_call` item with its `function_call_output`, and the usage
(responses.py streams and stores them).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from hermes_sup.client import Reply, ToolComplete, ToolStart

from .said import usage_of

KEPT_ARGUMENT = 500  # characters of a tool argument kept in a stored response
KEPT_OUTPUT = 1000  # characters of a tool's output kept in a stored response


def _result_text(result: Any) -> str:
    return result if isinstance(result, str) else json.dumps(result)


def shortened(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items with long tool arguments and outputs cut, as Hermes cuts
    them in `response.completed` (the events carried them whole)."""
    out = []
    for item in items:
        item = dict(item)
        if item.get("type") == "function_call":
            try:
                args = json.loads(item.get("arguments") or "{}")
            except ValueError:
                args = None
            if isinstance(args, dict):
                for name, value in args.items():
                    if isinstance(value, str) and len(value) > KEPT_ARGUMENT:
                        args[name] = f"[{len(value)} chars, cut in the stored response]"
                item["arguments"] = json.dumps(args)
        elif item.get("type") == "function_call_output":
            output = item.get("output")
            if isinstance(output, str) and len(output) > KEPT_OUTPUT:
                item["output"] = output[: KEPT_OUTPUT // 2] + f"...[{len(output)} chars]"
            elif isinstance(output, list):
                item["output"] = [
                    {**p, "text": p["text"][: KEPT_OUTPUT // 2] + f"...[{len(p['text'])} chars]"}
                    if isinstance(p, dict)
                    and isinstance(p.get("text"), str)
                    and len(p["text"]) > KEPT_OUTPUT
                    else p
                    for p in output
                ]
        out.append(item)
    return out


class ToolItems:
    """Tool calls as `function_call` / `function_call_output` output items,
    paired by call id; internal tools (a leading `_`) stay off the wire, as
    in Hermes."""

    def __init__(self) -> None:
        self.pending: dict[str, dict[str, Any]] = {}
        self.items: list[dict[str, Any]] = []  # as they will appear in `output`

    def start(self, event: ToolStart) -> dict[str, Any] | None:
        if event.name.startswith("_"):
            return None
        call_id = event.id or f"call_{uuid.uuid4().hex[:24]}"
        args = event.args if event.args is not None else {}
        item = {
            "id": f"fc_{uuid.uuid4().hex[:24]}",
            "type": "function_call",
            "status": "in_progress",
            "name": event.name,
            "call_id": call_id,
            "arguments": args if isinstance(args, str) else json.dumps(args),
        }
        self.pending[call_id] = item
        self.items.append(item)
        return item

    def complete(self, event: ToolComplete) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """The finished call's item and its output item; None when its start
        was not seen (an orphaned completion is dropped, as Hermes drops it)."""
        call = self.pending.pop(event.id, None)
        if call is None:
            return None
        call["status"] = "completed"
        output = {
            "id": f"fco_{uuid.uuid4().hex[:24]}",
            "type": "function_call_output",
            "call_id": call["call_id"],
            "output": _result_text(event.result),
            "status": "completed",
        }
        self.items.append(output)
        return call, output


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def message_item(
    text: str, item_id: str | None = None, status: str | None = None
) -> dict[str, Any]:
    item: dict[str, Any] = {"type": "message", "role": "assistant"}
    if item_id is not None:
        item["id"] = item_id
    if status is not None:
        item["status"] = status
    item["content"] = [text_part(text)]
    return item


def usage_in_responses(reply: Reply | None) -> dict[str, int]:
    u = usage_of(reply)
    return {
        "input_tokens": u["prompt_tokens"],
        "output_tokens": u["completion_tokens"],
        "total_tokens": u["total_tokens"],
    }
