"""A fake OpenAI-compatible model server on 127.0.0.1 for tests (stdlib only).

Scripted by the user's message, so each session drives it independently:

  "run: COMMAND"   first answer: a `terminal` tool call running COMMAND;
                   once the tool result is in the conversation: "done: RESULT"
  "runs: A ;; B"   a `terminal` tool call for each command in turn, then "done: RESULT"
  "narrate: COMMAND"  as "run:", with a sentence to the user beside the tool call
  "ask: QUESTION ;; A | B"  a `clarify` tool call (choices A, B), then "done: RESULT"
  "think: THOUGHT ;; TEXT"  streams THOUGHT as `reasoning_content`, then "said: TEXT"
  "slow: N"        streams a reply token by token over about N seconds
  "speak: TEXT"    a `text_to_speech` tool call saying TEXT, then "done: RESULT"
  "bg: COMMAND"    a `terminal` tool call running COMMAND in the background with
                   notify_on_complete, then "done: RESULT"
  "cron: NAME ;; PROMPT"  a `cronjob` call creating job NAME (PROMPT, hourly),
                   then one running it now, then "done: RESULT"
  anything else    streams "echo: TEXT" (with the number of earlier user turns)

`POST /v1/audio/speech` (OpenAI's TTS) answers a few bytes that start as
the asked format does (`OggS` for opus, `ID3` for mp3) and records each
request (`speech`).

Streams SSE chunks (`data: {...}` then `data: [DONE]`) as the real API does,
and records every request it served (`requests`), and its Authorization
header (`auth`).
"""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FakeModel:
    """A running fake model server; `url` is its OpenAI base URL."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.auth: list[str | None] = []
        self.speech: list[dict[str, Any]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_port}/v1"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _json(self, code: int, obj: Any) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                if self.path.rstrip("/").endswith("/models"):
                    self._json(
                        200,
                        {
                            "object": "list",
                            "data": [
                                {
                                    "id": "fake-model",
                                    "object": "model",
                                    "owned_by": "tests",
                                    "context_length": 128000,
                                }
                            ],
                        },
                    )
                else:
                    self._json(404, {"error": {"message": "not found"}})

            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(length) or b"{}")
                if self.path.rstrip("/").endswith("/audio/speech"):
                    fake.speech.append(body)
                    opus = body.get("response_format") == "opus"
                    audio = (b"OggS" if opus else b"ID3") + b"\0fake " + body["input"].encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "audio/ogg" if opus else "audio/mpeg")
                    self.send_header("Content-Length", str(len(audio)))
                    self.end_headers()
                    self.wfile.write(audio)
                    return
                if not self.path.rstrip("/").endswith("/chat/completions"):
                    self._json(404, {"error": {"message": "not found"}})
                    return
                fake.requests.append(body)
                fake.auth.append(self.headers.get("Authorization"))
                chunks = fake.script(body.get("messages", []))
                if not body.get("stream"):
                    self._json(200, fake.non_streaming(chunks))
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
                try:
                    for chunk, pause in chunks:
                        if pause:
                            time.sleep(pause)
                        self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                        self.wfile.flush()
                    self.wfile.write(b"data: [DONE]\n\n")
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    pass
                self.close_connection = True

        return Handler

    @staticmethod
    def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {
            "id": "chatcmpl-fake",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": "fake-model",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }

    def script(self, messages: list[dict[str, Any]]) -> list[tuple[dict[str, Any], float]]:
        """The chunks (and pauses before each) answering one request."""
        users = [m for m in messages if m.get("role") == "user"]
        text = _text(users[-1]) if users else ""
        last = messages[-1] if messages else {}
        if text.startswith("runs: "):
            commands = text[len("runs: ") :].split(" ;; ")
            since = messages[max(i for i, m in enumerate(messages) if m.get("role") == "user") :]
            ran = sum(m.get("role") == "tool" for m in since)
            if ran < len(commands):
                return self._tool_call(commands[ran])
        if text.startswith("cron: "):
            name, _, prompt = text[len("cron: ") :].partition(" ;; ")
            since = messages[max(i for i, m in enumerate(messages) if m.get("role") == "user") :]
            ran = sum(m.get("role") == "tool" for m in since)
            calls = [
                {"action": "create", "name": name, "prompt": prompt, "schedule": "every 1h"},
                {"action": "run", "job_id": name},
            ]
            if ran < len(calls):
                return self._tool_call("", name="cronjob", args=calls[ran])
        if last.get("role") == "tool":
            return self._say(f"done: {_text(last)}")
        if text.startswith("run: "):
            return self._tool_call(text[len("run: ") :])
        if text.startswith("narrate: "):
            command = text[len("narrate: ") :]
            return self._tool_call(command, say=f"Running {command} for you.")
        if text.startswith("ask: "):
            question, _, choices = text[len("ask: ") :].partition(" ;; ")
            args = {"question": question, "choices": choices.split(" | ") if choices else []}
            return self._tool_call("", name="clarify", args=args)
        if text.startswith("bg: "):
            args = {"command": text[4:], "background": True, "notify_on_complete": True}
            return self._tool_call("", args=args)
        if text.startswith("speak: "):
            said = text[len("speak: ") :]
            return self._tool_call("", name="text_to_speech", args={"text": said})
        if text.startswith("think: "):
            thought, _, said = text[len("think: ") :].partition(" ;; ")
            pieces = [thought[i : i + 8] for i in range(0, len(thought), 8)]
            reasoning = [(self._chunk({"reasoning_content": p}), 0.0) for p in pieces]
            answer = self._say(f"said: {said}")
            return answer[:1] + reasoning + answer[1:]
        slow = re.fullmatch(r"slow: (\d+(?:\.\d+)?)", text)
        if slow:
            seconds = float(slow.group(1))
            words = [f"tick{i} " for i in range(20)]
            return self._say("".join(words), pause=seconds / 20)
        return self._say(f"echo: {text} (turn {len(users)})")

    def _tool_call(
        self,
        command: str,
        say: str = "",
        name: str = "terminal",
        args: dict[str, Any] | None = None,
    ) -> list[tuple[dict[str, Any], float]]:
        """An answer that calls the `terminal` tool to run `command` (or
        tool `name` with `args`), saying `say` first if given."""
        call = {
            "index": 0,
            "id": f"call_{len(self.requests)}",
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(args or {"command": command})},
        }
        said = [(self._chunk({"role": "assistant", "content": say}), 0.0)] if say else []
        return said + [
            (self._chunk({"role": "assistant", "tool_calls": [call]}), 0.0),
            (self._chunk({}, "tool_calls"), 0.0),
        ]

    def _say(self, text: str, pause: float = 0.0) -> list[tuple[dict[str, Any], float]]:
        pieces = [text[i : i + 8] for i in range(0, len(text), 8)] or [""]
        out = [(self._chunk({"role": "assistant", "content": ""}), 0.0)]
        out += [(self._chunk({"content": p}), pause) for p in pieces]
        out.append((self._chunk({}, "stop"), 0.0))
        return out

    def non_streaming(self, chunks: list[tuple[dict[str, Any], float]]) -> dict[str, Any]:
        """Fold streamed chunks into one non-streaming completion."""
        content, reasoning, calls, finish = "", "", [], "stop"
        for chunk, _ in chunks:
            choice = chunk["choices"][0]
            content += choice["delta"].get("content") or ""
            reasoning += choice["delta"].get("reasoning_content") or ""
            calls += choice["delta"].get("tool_calls") or []
            finish = choice["finish_reason"] or finish
        message: dict[str, Any] = {"role": "assistant", "content": content or None}
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
        return {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": "fake-model",
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20},
        }


def _text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content or "")
