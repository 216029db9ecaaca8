"""Log lines as `event key=value ...`, with anything secret masked.

Operators and tests read these lines: event names and field names are an
interface, kept verbatim.
"""

from __future__ import annotations

import re
from typing import Any

SECRET_NAME = re.compile(r"key|token|secret|password|passwd|credential", re.IGNORECASE)
SECRET_VALUE = re.compile(r"\b(sk|pk|rk|xox[abp]|ghp|gho|AKIA)[-_A-Za-z0-9]{8,}")


def redact(text: str) -> str:
    """Mask anything shaped like an API key or token."""
    return SECRET_VALUE.sub(lambda m: m.group(1) + "-[redacted]", text)


def kv(event: str, **fields: Any) -> str:
    """A structured log line: `event key=value ...` (values quoted when needed).
    Values of secret-sounding fields, and anything shaped like a key, are masked."""
    parts = [event]
    for name, value in fields.items():
        text = "[redacted]" if SECRET_NAME.search(name) else redact(str(value))
        if not text or any(c in text for c in ' "='):
            text = '"' + text.replace('"', '\\"') + '"'
        parts.append(f"{name}={text}")
    return " ".join(parts)
