"""The static files of `--web` (a page served at /): no dotfile, nothing
outside the directory, and headers that keep the page to this endpoint."""

from __future__ import annotations

import os
from pathlib import Path

from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# A page served from web_dir talks only to this endpoint, runs only its own
# scripts, and is never framed by another site.
WEB_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
        b"img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; "
        b"base-uri 'none'; form-action 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]


class WebFiles(StaticFiles):
    """StaticFiles that serves no dotfile (`.env`, `.git/...`), by the path
    asked for or by where a symlink leads, and nothing outside the
    directory (StaticFiles itself resolves symlinks and `..` for that)."""

    def lookup_path(self, path: str) -> tuple[str, os.stat_result | None]:
        full_path, stat = super().lookup_path(path)
        if stat is None:
            return full_path, stat
        for directory in self.all_directories:
            try:
                parts = Path(full_path).relative_to(os.path.realpath(directory)).parts
            except ValueError:
                continue
            if any(part.startswith(".") for part in parts):
                return "", None
            return full_path, stat
        return "", None


def web_app(directory: Path) -> ASGIApp:
    """The static files of `directory` (index.html at /), with WEB_HEADERS.
    They need no key: a page holds none; the person using it gives one."""
    files = WebFiles(directory=directory, html=True)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *WEB_HEADERS]}
            await send(message)

        await files(scope, receive, send_with_headers)

    return app
