"""Floors for the HTTP endpoint's figures (bench/http_bench.py): the least an
HTTP server in front of chat turns can cost, served by uvicorn exactly as
the endpoint is (httpapi/serve.py: the same `bind`, the same
`uvicorn.Config`), so that what the endpoint adds on top is ours.

    python -m bench.http_floor --listen 127.0.0.1:PORT                     # echo
    python -m bench.http_floor --listen 127.0.0.1:PORT --state-dir DIR     # bridge
    python -m bench.http_floor --uvloop ...                                # either, on uvloop
    python -m bench.http_floor --endpoint-on-uvloop ARGS                   # see below

- echo: a bare ASGI app that answers `POST /v1/chat/completions` with the
  `chat.completion` (or, with `stream`, the SSE chunks) Hermes's API server
  would send, echoing the last user message, with no supervisor at all.
- bridge (with --state-dir): the same app, but the reply comes from the
  supervisor through `AsyncClient.run` to the session named by
  X-Hermes-Session-Key: the least an HTTP front of the supervisor can do
  (no auth, no session mapping, no pump task, no Starlette).
- --endpoint-on-uvloop: the endpoint itself (`python -m hermes_sup.httpapi
  ARGS`, unchanged), on uvloop's event loop instead of asyncio's. The
  endpoint calls `asyncio.run` itself, so uvicorn's `loop="auto"` never
  installs uvloop there; this shows what installing it would change.

bench/http_stack.py starts them, with `-m` from the repository root.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from starlette.types import Receive, Scope, Send

from hermes_sup.client import AsyncClient
from hermes_sup.httpapi.app import ApiSettings
from hermes_sup.httpapi.serve import bind, parse_listen, uvicorn_config

JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
KEY_HEADER = b"x-hermes-session-key"


def completion(text: str, model: str) -> dict[str, Any]:
    """A chat.completion shaped as the endpoint's (httpapi/chat.py)."""
    return {
        "id": "chatcmpl-floor",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
    }


def chunks(text: str, model: str) -> list[bytes]:
    """The SSE body the endpoint streams for a reply of `text`, word by word."""

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        obj = {
            "id": "chatcmpl-floor",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        return f"data: {json.dumps(obj)}\n\n".encode()

    words = text.split(" ")
    out = [chunk({"role": "assistant"})]
    out += [chunk({"content": w if i == 0 else " " + w}) for i, w in enumerate(words)]
    return [*out, chunk({}, "stop"), b"data: [DONE]\n\n"]


class FloorApp:
    """The echo (no client) or bridge (an AsyncClient) app."""

    def __init__(self, state_dir: Path | None) -> None:
        self.state_dir = state_dir
        self.client: AsyncClient | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http" or scope["path"] != "/v1/chat/completions":
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        request = json.loads(body)
        text = str(request["messages"][-1]["content"])
        model = str(request.get("model") or "hermes-agent")
        if self.state_dir is not None:
            key = dict(scope["headers"]).get(KEY_HEADER, b"floor").decode()
            if self.client is None:
                self.client = AsyncClient(self.state_dir)
            text = (await self.client.run(key, text)).text
        if request.get("stream"):
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            for piece in chunks(text, model):
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        payload = json.dumps(completion(text, model)).encode()
        # With its length, as Starlette's JSONResponse sends it (not chunked).
        headers = [*JSON_HEADERS, (b"content-length", str(len(payload)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": payload})

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.client is not None:
                    await self.client.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


def main() -> None:
    """Serve the echo or bridge app, or the endpoint itself on uvloop."""
    if sys.argv[1:2] == ["--endpoint-on-uvloop"]:
        import uvloop

        from hermes_sup.httpapi.serve import main as endpoint

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())  # asyncio.run takes it
        endpoint(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(prog="python -m bench.http_floor")
    parser.add_argument("--listen", required=True, help="HOST:PORT")
    parser.add_argument("--state-dir", type=Path, help="bridge to this supervisor")
    parser.add_argument("--uvloop", action="store_true", help="on uvloop's event loop")
    args = parser.parse_args()
    import uvicorn

    if args.uvloop:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())

    sock = bind(*parse_listen(args.listen))
    # The endpoint's settings (httpapi/serve.py `run`), so only the app differs.
    config = uvicorn_config(FloorApp(args.state_dir), ApiSettings(), "warning")
    asyncio.run(uvicorn.Server(config).serve(sockets=[sock]))


if __name__ == "__main__":
    main()
