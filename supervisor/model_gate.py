"""The model endpoint: requests a session sends to SESSION_MODEL_PATH on its
egress proxy (supervisor/proxy.py routes them here).

This is where the operator's model credentials are added outside the
session, so that no worker ever holds them. Until a model endpoint is
configured every such request is answered 404, and the session learns no
more than that.
"""

from __future__ import annotations

import asyncio

NOT_CONFIGURED = b"no model endpoint configured\n"


async def handle(
    session: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes
) -> None:
    """Answer one request of `session`. `head` is its request line and
    headers as read, up to and including the blank line; its body, if any,
    is still in `reader`. The caller closes `writer` afterwards."""
    writer.write(
        b"HTTP/1.1 404 Not Found\r\nContent-Type: text/plain\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(NOT_CONFIGURED), NOT_CONFIGURED)
    )
    await writer.drain()
