"""A small web front end for hermes-sup: each browser tab chats with its own
session, replies stream in as they are made, approvals show as buttons.

    .venv/bin/python examples/web/app.py       # this user's supervisor
    .venv/bin/python examples/web/app.py --state-dir DIR --port 8765

It needs the hermes_sup client installed (`make run` or `make install` put
it in .venv); run with another Python, it says so and how to run it.

Standard library only (plus hermes_sup.client). It listens on 127.0.0.1 and
has no login of its own: anyone who can reach the port can chat. Put it
behind your own authentication before it leaves the machine.

Each POST /api/turn streams newline-delimited JSON, one line per event; the
HTTP handler threads share one blocking `Client` (each thread gets its own
socket). The page keeps its session key in sessionStorage, which is per
tab: two tabs, two sessions, two worker processes.
"""

from __future__ import annotations

import argparse
import json
import sys
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

try:
    from hermes_sup.client import (
        ApprovalRequest,
        ApprovalTimeout,
        Client,
        ClientError,
        Event,
        Output,
        Queued,
        Reply,
        Running,
        SupervisorError,
        Token,
    )
except ModuleNotFoundError:
    sys.exit(
        "this example needs the hermes_sup client, which this Python does not have: "
        "run it with the project's venv (.venv/bin/python examples/web/app.py, after "
        "`make install`) or `pip install -e .` into this Python"
    )

PAGE = (Path(__file__).parent / "index.html").read_bytes()
MAX_BODY = 64 * 1024


def event_json(event: Event) -> dict[str, Any]:
    """What the page needs of one event."""
    if isinstance(event, Token):
        return {"type": "token", "text": event.text}
    if isinstance(event, Output):
        return {"type": "output", "line": event.line}
    if isinstance(event, ApprovalRequest):
        return {"type": "approval", "command": event.command, "choices": list(event.choices)}
    if isinstance(event, ApprovalTimeout):
        return {"type": "approval_timeout", "command": event.command}
    if isinstance(event, Running):
        return {"type": "running", "pid": event.pid}
    if isinstance(event, Queued):
        return {"type": "queued", "position": event.position}
    if isinstance(event, Reply):
        return {"type": "reply", "text": event.text, "ok": event.ok}
    return {"type": event.type}


class Handler(BaseHTTPRequestHandler):
    server: WebServer

    def log_message(self, format: str, *args: Any) -> None:  # quieter than the default
        sys.stderr.write(f"web: {format % args}\n")

    def do_GET(self) -> None:
        if self.path.split("?")[0] != "/":
            self.send_error(HTTPStatus.NOT_FOUND)
            return
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(PAGE)))
        self.send_header("Content-Security-Policy", "default-src 'self' 'unsafe-inline'")
        self.end_headers()
        self.wfile.write(PAGE)

    def do_POST(self) -> None:
        body = self._json_body()
        if body is None:
            return
        routes = {"/api/turn": self._turn, "/api/approve": self._approve}
        route = routes.get(self.path)
        if route is None:
            self.send_error(HTTPStatus.NOT_FOUND)
            return
        route(body)

    def _json_body(self) -> dict[str, Any] | None:
        # JSON only: a form post from another site cannot pass for one.
        if self.headers.get("Content-Type") != "application/json":
            self.send_error(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, "send application/json")
            return None
        length = int(self.headers.get("Content-Length") or 0)
        if not 0 < length <= MAX_BODY:
            self.send_error(HTTPStatus.BAD_REQUEST, "empty or too large")
            return None
        try:
            body = json.loads(self.rfile.read(length))
        except ValueError:
            body = None
        if not isinstance(body, dict) or not isinstance(body.get("session"), str):
            self.send_error(HTTPStatus.BAD_REQUEST, "expected a JSON object with a session")
            return None
        return body

    def _turn(self, body: dict[str, Any]) -> None:
        session, text = body["session"], str(body.get("text", ""))
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Cache-Control", "no-store")
        self.send_header("Connection", "close")
        self.end_headers()
        client = self.server.client
        try:
            client.open(session, session_env={"platform": "web", "chat_id": session})
            for event in client.send(session, text):
                self._line(event_json(event))
        except SupervisorError as exc:
            self._line({"type": "error", "code": exc.code, "message": exc.message})
        except ClientError as exc:
            self._line({"type": "error", "code": "unavailable", "message": str(exc)})
        except (BrokenPipeError, ConnectionResetError):
            pass  # the tab went away; the turn goes on in its session

    def _approve(self, body: dict[str, Any]) -> None:
        try:
            choice = self.server.client.approve(body["session"], str(body.get("choice", "deny")))
            answer: dict[str, Any] = {"ok": True, "choice": choice}
        except ClientError as exc:
            answer = {"ok": False, "message": str(exc)}
        data = json.dumps(answer).encode()
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _line(self, obj: dict[str, Any]) -> None:
        self.wfile.write(json.dumps(obj).encode() + b"\n")
        self.wfile.flush()


class WebServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], client: Client) -> None:
        super().__init__(address, Handler)
        self.client = client


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-dir", default=None, help="the supervisor's state directory")
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args()
    try:
        client = Client(args.state_dir, timeout=15)
    except ClientError as exc:
        sys.exit(f"web: {exc} (start it with: hermes-sup serve)")
    with client, WebServer(("127.0.0.1", args.port), client) as server:
        print(f"web: open http://127.0.0.1:{server.server_address[1]}/", flush=True)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
