"""A request body as JSON, refused (400) before it can hurt anything later.

`json.loads` alone takes too much: a body nested 100,000 deep raises
RecursionError (a 500 with a traceback), one nested a few hundred deep
parses but breaks whatever walks it next (a fingerprint, msgpack to the
supervisor), and a lone surrogate (`"\\ud800"`) parses into a string that
cannot be encoded as UTF-8 anywhere after. So a body must be UTF-8, nested
at most MAX_DEPTH deep, and hold no lone surrogate, in its keys or values.

The checks cost nothing for the usual body: the tree is walked only when
the text has more brackets than MAX_DEPTH, or a `\\uD8..`-`\\uDF..` escape.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .errors import ApiError

MAX_DEPTH = 64  # Hermes's own request bodies nest 6 deep at most
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def parse_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; ApiError 400 naming what is wrong."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError(400, "The request body is not UTF-8", "invalid_json") from None
    try:
        data = json.loads(text)
    except RecursionError:
        raise _too_deep() from None
    except ValueError:
        raise ApiError(400, "Invalid JSON in request body", "invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "The request body must be a JSON object", "invalid_json")
    deep = text.count("[") + text.count("{") > MAX_DEPTH
    escaped = "\\u" in text and _SURROGATE_ESCAPE.search(text) is not None
    if deep or escaped:
        _walk(data)
    return data


def _too_deep() -> ApiError:
    return ApiError(
        400, f"The request body is nested too deeply (at most {MAX_DEPTH} levels)", "invalid_json"
    )


def _walk(data: Any) -> None:
    """Refuse a tree deeper than MAX_DEPTH or holding a lone surrogate
    (iteratively: the tree may be as deep as the parser allowed)."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            if _SURROGATE.search(node):
                raise ApiError(
                    400,
                    "The request body holds a lone surrogate (\\ud800-\\udfff), "
                    "which is not a character",
                    "invalid_json",
                )
        elif isinstance(node, (dict, list)):
            if depth > MAX_DEPTH:
                raise _too_deep()
            if isinstance(node, dict):
                stack.extend((key, depth) for key in node)
                stack.extend((value, depth + 1) for value in node.values())
            else:
                stack.extend((value, depth + 1) for value in node)
