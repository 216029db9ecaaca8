"""The model endpoint a sealed session reaches: the operator's key added
here, outside the worker, and each session's and each HTTP key's model use
metered.

Theory of operation
-------------------
A sealed worker with a network namespace of its own (network "egress" or
"none") is told a base URL on the session's proxy listener,
`http://127.0.0.1:3128/model/<the real base URL's path>`, and a placeholder
key (`worker_agent_config`). The real base URL and key stay in the
supervisor's settings. The session's proxy hands each origin-form request
under SESSION_MODEL_PATH to `handle`, which:

1. parses the request head (bounded; a bad head gets 400 naming the fault),
   maps `/model/<path>` onto the configured base URL (only paths under its
   own path; no `..`, no absolute URL, no other host: 403 otherwise);
2. refuses with 429 (an OpenAI-shaped error) when the session's HTTP key has
   spent its token budget;
3. drops every credential header the session sent, adds the operator's,
   forwards the body with its own framing (Content-Length or chunked) over
   TLS when the base URL is https;
4. streams the response back as it comes (SSE included) while reading the
   `usage` it reports (a JSON body's, or the largest an SSE stream's events
   carry) into the session's and the key's meters (model_meter.py).

A connection may carry several requests (keep-alive), each one checked as
the first. Upstream connections are not pooled: one per request.

The supervisor installs its `Gate` with `install` at start; until then (and
where no base URL is configured) every request is answered 404.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import ssl
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from hermes_sup.local.addresses import SESSION_MODEL_PATH, SESSION_PROXY_HOST, SESSION_PROXY_PORT
from hermes_sup.local.logfmt import kv

from .model_meter import Meter, Usage, UsageReader, tenant_of

log = logging.getLogger("hermes_sup.supervisor.model_gate")

# What the worker holds instead of the key: harmless if read, and plain in
# a log that it is no key at all.
PLACEHOLDER_KEY = "hermes-sup-proxied"
# Networks whose worker reaches the supervisor's model endpoint (the plan's
# "network"; "host" keeps today's direct calls, key included).
PROXIED_NETWORKS = ("egress", "none")
DEFAULT_NETWORK = "egress"

MAX_HEAD = 64 * 1024  # the request line and headers
MAX_HEADERS = 100
MAX_BODY = 64 * 1024 * 1024  # a request's body: images ride in it, base64
MAX_CHUNK_LINE = 4096
READ_SIZE = 64 * 1024
UPSTREAM_CONNECT_TIMEOUT = 30.0
# Between requests on one kept-alive connection from a session.
IDLE_TIMEOUT = 120.0

# Headers that carry a credential, in any case: never forwarded as the
# session sent them.
CREDENTIAL_HEADERS = frozenset(
    {"authorization", "proxy-authorization", "x-api-key", "api-key", "x-goog-api-key", "cookie"}
)
# Hop-by-hop (RFC 9110 7.6.1) and those this gate sets itself.
HOP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "host",
        "accept-encoding",  # identity upstream: usage is read from the body
        "expect",  # the body is sent at once; no 100 Continue to relay
    }
)
_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_VERSION = re.compile(rb"HTTP/1\.[01]")


class Refused(Exception):
    """A request answered by the gate itself: its status and a sentence."""

    def __init__(self, status: int, message: str, code: str = "bad_request") -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


# ---------------------------------------------------------------- config


@dataclass(frozen=True)
class Upstream:
    """The operator's model endpoint: where requests go, with which key."""

    scheme: str
    host: str
    port: int
    path: str  # the base URL's path, without a trailing "/" ("" for the root)
    key: str | None
    # "authorization" (sent as `Bearer <key>`) or the name of a header the
    # key is sent in as it is (`x-api-key` for Anthropic's own API).
    key_header: str = "authorization"

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Upstream | None:
        """The endpoint of an agent config, or None without a usable base_url."""
        base_url = config.get("base_url")
        if not isinstance(base_url, str) or not base_url:
            return None
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return None
        key = config.get("api_key")
        header = str(config.get("api_key_header") or "authorization").lower()
        return cls(
            scheme=parts.scheme,
            host=parts.hostname,
            port=parts.port or (443 if parts.scheme == "https" else 80),
            path=parts.path.rstrip("/"),
            key=key if isinstance(key, str) and key else None,
            key_header=header,
        )

    @property
    def authority(self) -> str:
        """The Host header's value."""
        default = 443 if self.scheme == "https" else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == default else f"{host}:{self.port}"

    def credential(self) -> tuple[str, str] | None:
        """The header the operator's key goes in, or None without a key."""
        if self.key is None:
            return None
        if self.key_header == "authorization":
            return ("Authorization", f"Bearer {self.key}")
        return (self.key_header, self.key)


def worker_agent_config(
    operator: Mapping[str, Any], session: Mapping[str, Any], seal: Mapping[str, Any] | None
) -> dict[str, Any]:
    """What a worker is told of its agent config: the operator's, with the
    session's own options over it. With a network namespace of its own, the
    model endpoint is the session's proxy listener and the key a
    placeholder; otherwise (unsealed, network "host", or no base_url for the
    supervisor to forward to) the operator's key as it is. A session that
    names another base_url gets no key of the operator's at all: the key is
    for the operator's endpoint only."""
    out = {**operator, **session}
    out.pop("api_key_header", None)  # the gate's business, not the runtime's
    own_url = session.get("base_url")
    if own_url is not None and own_url != operator.get("base_url"):
        out.pop("api_key", None)
        return out
    if seal is None or seal.get("network", DEFAULT_NETWORK) not in PROXIED_NETWORKS:
        return out
    upstream = Upstream.from_config(operator)
    if upstream is None:
        return out
    out["base_url"] = (
        f"http://{SESSION_PROXY_HOST}:{SESSION_PROXY_PORT}{SESSION_MODEL_PATH}{upstream.path}"
    )
    out["api_key"] = PLACEHOLDER_KEY
    return out


# Names of variables that usually hold a credential (OPENAI_API_KEY,
# ANTHROPIC_API_KEY, GITHUB_TOKEN, AWS_SECRET_ACCESS_KEY, ...).
_SECRET_NAME = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD)", re.IGNORECASE)


def exposure_warnings(
    config: Mapping[str, Any],
    passed: Iterable[str],
    template_home: str | None,
) -> list[str]:
    """Where a model credential would still reach every worker: said at
    start. `passed`: names of variables workers get (pass_env beyond the
    default, and `env`)."""
    out = []
    if config.get("api_key") and Upstream.from_config(config) is None:
        out.append(
            "the agent config has an api key but no base_url: the supervisor cannot "
            "forward model calls, so the key is handed to every worker; set base_url"
        )
    for name in sorted(set(passed)):
        if _SECRET_NAME.search(name):
            out.append(
                f"variable {name} is given to every worker (pass_env or env): a session's "
                "shell can read it; put a model key in api_key_env or api_key_file instead"
            )
    if template_home:
        for name in (".env", "auth.json"):
            if (Path(template_home) / name).exists():
                out.append(
                    f"template_home holds {name}, copied into every session's home: a "
                    "provider key in it is readable by every session"
                )
    return out


# ---------------------------------------------------------------- HTTP


@dataclass
class Request:
    """A parsed request head."""

    method: str
    path: str  # the upstream path, query included
    version: bytes
    headers: list[tuple[str, str]] = field(default_factory=list)
    length: int | None = None  # Content-Length
    chunked: bool = False
    close: bool = False  # the session said Connection: close (or HTTP/1.0)


def parse_head(head: bytes, upstream: Upstream) -> Request:
    """The request in `head`, its path mapped under the upstream's; Refused
    (400 for a malformed head, 403 for a path outside the endpoint)."""
    if len(head) > MAX_HEAD:
        raise Refused(400, f"request head over {MAX_HEAD} bytes")
    if not head.endswith(b"\r\n\r\n") and not head.endswith(b"\n\n"):
        raise Refused(400, "request head does not end with a blank line")
    lines = head.replace(b"\r\n", b"\n").split(b"\n")[:-2]
    if not lines:
        raise Refused(400, "empty request head")
    parts = lines[0].split(b" ")
    if len(parts) != 3:
        raise Refused(400, "request line is not METHOD TARGET HTTP/1.1")
    method, target, version = parts
    if not _TOKEN.fullmatch(method):
        raise Refused(400, "request method is not a token")
    if not _VERSION.fullmatch(version):
        raise Refused(400, "request version is not HTTP/1.0 or HTTP/1.1")
    if len(lines) - 1 > MAX_HEADERS:
        raise Refused(400, f"more than {MAX_HEADERS} headers")
    request = Request(method.decode(), _map_path(target, upstream), version)
    seen: dict[str, str] = {}
    for raw in lines[1:]:
        name, sep, value = raw.partition(b":")
        if not sep or not _TOKEN.fullmatch(name):
            raise Refused(400, f"malformed header line {raw[:40]!r}")
        text = value.strip().decode("latin-1")
        if any(c in text for c in "\r\n\0"):
            raise Refused(400, f"header {name.decode()} holds a control character")
        lower = name.decode().lower()
        if lower in ("content-length", "transfer-encoding", "host") and lower in seen:
            raise Refused(400, f"header {lower} given twice")
        seen[lower] = text
        if lower not in CREDENTIAL_HEADERS and lower not in HOP_HEADERS:
            request.headers.append((name.decode(), text))
    _framing(request, seen)
    return request


def _framing(request: Request, seen: dict[str, str]) -> None:
    """Content-Length or chunked, never both (a smuggling vector)."""
    te, cl = seen.get("transfer-encoding"), seen.get("content-length")
    if te is not None and cl is not None:
        raise Refused(400, "both Content-Length and Transfer-Encoding given")
    if te is not None:
        if te.lower() != "chunked":
            raise Refused(400, f"transfer-encoding {te!r} is not supported (only chunked)")
        request.chunked = True
    elif cl is not None:
        if not cl.isdigit():
            raise Refused(400, f"content-length {cl[:20]!r} is not a number")
        request.length = int(cl)
        if request.length > MAX_BODY:
            raise Refused(413, f"request body over {MAX_BODY} bytes", "too_large")
    tokens = {t.strip().lower() for t in seen.get("connection", "").split(",")}
    request.close = "close" in tokens or (
        request.version == b"HTTP/1.0" and "keep-alive" not in tokens
    )


def _map_path(target: bytes, upstream: Upstream) -> str:
    """`/model/<path>` as the upstream path; Refused unless it lies under
    the base URL's path, after percent-decoding, with no dot segments."""
    try:
        text = target.decode("ascii")
    except UnicodeDecodeError:
        raise Refused(400, "request target is not ASCII") from None
    if not text.startswith("/"):
        raise Refused(
            403, "only paths under the model endpoint are served, not an absolute URL", "forbidden"
        )
    path, sep, query = text.partition("?")
    prefix = SESSION_MODEL_PATH + "/"
    if not path.startswith(prefix):
        raise Refused(403, f"path is not under {prefix}", "forbidden")
    rest = path[len(SESSION_MODEL_PATH) :]
    decoded = unquote(rest)
    # Refused whatever their encoding: a dot segment or a backslash could
    # climb out of the base path at the upstream (or a server between).
    segments = decoded.split("/")
    if any(s in (".", "..") for s in segments) or "\\" in decoded or "%" in decoded:
        raise Refused(403, "path holds a dot segment or an encoded separator", "forbidden")
    if any(ord(c) < 0x21 or ord(c) == 0x7F for c in decoded):
        raise Refused(400, "path holds a control character or space")
    base = upstream.path
    if base and not (rest == base or rest.startswith(base + "/")):
        raise Refused(403, f"path is outside the model endpoint's {base}/", "forbidden")
    return rest + (sep + query if sep else "")


def error_response(status: int, message: str, code: str, close: bool = True) -> bytes:
    """An OpenAI-shaped JSON error, which the openai client shows as is."""
    kind = "insufficient_quota" if status == 429 else "invalid_request_error"
    body = json.dumps({"error": {"message": message, "type": kind, "code": code}}).encode()
    reason = {
        400: "Bad Request",
        403: "Forbidden",
        404: "Not Found",
        413: "Payload Too Large",
        429: "Too Many Requests",
        502: "Bad Gateway",
    }.get(status, "Error")
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: {'close' if close else 'keep-alive'}\r\n\r\n"
    )
    return head.encode() + body


async def _read_head(reader: asyncio.StreamReader) -> bytes | None:
    """The next request head on a kept-alive connection, None at its end."""
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), IDLE_TIMEOUT)
    except asyncio.IncompleteReadError as exc:
        if exc.partial.strip():
            raise Refused(400, "connection ended inside a request head") from None
        return None
    except asyncio.LimitOverrunError:
        raise Refused(400, f"request head over {MAX_HEAD} bytes") from None
    except TimeoutError:
        return None
    if len(head) > MAX_HEAD:
        raise Refused(400, f"request head over {MAX_HEAD} bytes")
    return head


async def _copy_exact(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    length: int,
    seen: Callable[[bytes], None],
) -> None:
    """Copy `length` bytes; IncompleteReadError if the sender stops short."""
    left = length
    while left:
        data = await reader.read(min(left, READ_SIZE))
        if not data:
            raise asyncio.IncompleteReadError(b"", left)
        left -= len(data)
        seen(data)
        writer.write(data)
        await writer.drain()


async def _copy_chunked(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    seen: Callable[[bytes], None],
    limit: int | None,
) -> int:
    """Copy a chunked body as it is framed, trailers included; `seen` gets
    the payload. Returns the payload's size; Refused past `limit`."""
    total = 0
    while True:
        line = await reader.readuntil(b"\n")
        if len(line) > MAX_CHUNK_LINE:
            raise Refused(400, "chunk size line too long")
        size_text = line.split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise Refused(400, f"bad chunk size {size_text[:20]!r}") from None
        total += size
        if limit is not None and total > limit:
            raise Refused(413, f"request body over {limit} bytes", "too_large")
        writer.write(line)
        if size == 0:
            # Trailers, then the blank line that ends the body.
            while True:
                trailer = await reader.readuntil(b"\n")
                writer.write(trailer)
                if trailer.strip() == b"":
                    break
            await writer.drain()
            return total
        await _copy_exact(reader, writer, size, seen)
        crlf = await reader.readuntil(b"\n")
        if crlf.strip():
            raise Refused(400, "chunk not followed by CRLF")
        writer.write(crlf)


# ---------------------------------------------------------------- gate


class Gate:
    """The supervisor's model endpoint. `upstream_for(session)` is the
    endpoint in force for a session (None: not configured); budgets are
    tokens per HTTP key name ("*": every key not named)."""

    def __init__(
        self,
        upstream_for: Callable[[str], Upstream | None],
        budgets: Callable[[], Mapping[str, int]] = dict,
        on_call: Callable[[str | None, str, Usage, int, int], None] | None = None,
    ) -> None:
        self.upstream_for = upstream_for
        self.budgets = budgets
        # (HTTP key, "ok" or "refused", usage, bytes in, bytes out): metrics.
        self.on_call = on_call
        self.sessions: dict[str, Meter] = {}
        self.keys: dict[str, Meter] = {}
        self._tls: ssl.SSLContext | None = None
        self.active = 0  # calls being forwarded now

    def idle(self) -> bool:
        """No call is being forwarded (every meter is up to date)."""
        return self.active == 0

    def meter(self, session: str) -> Meter | None:
        """The session's meter, if it has used the model."""
        return self.sessions.get(session)

    def forget(self, session: str) -> None:
        """A session purged: its meter goes (its key's stays)."""
        self.sessions.pop(session, None)

    def describe(self) -> dict[str, Any]:
        """Every key's use and budget, for status."""
        budgets = self.budgets()
        return {
            name: {**m.describe(), "budget": budgets.get(name, budgets.get("*"))}
            for name, m in sorted(self.keys.items())
        }

    def budget_left(self, key: str | None) -> int | None:
        """Tokens the key may still spend; None: no budget applies."""
        if key is None:
            return None
        budgets = self.budgets()
        budget = budgets.get(key, budgets.get("*"))
        if budget is None:
            return None
        used = self.keys[key].tokens if key in self.keys else 0
        return budget - used

    async def handle(
        self,
        session: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        head: bytes,
    ) -> None:
        """Serve the requests of one session's connection, the first of
        which is `head`; closes the connection when done."""
        try:
            current: bytes | None = head
            while current is not None:
                if not await self._one(session, reader, writer, current):
                    break
                current = await _read_head(reader)
        except Refused as exc:
            await _answer(writer, exc)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # the session went away mid-request: nothing to answer
        finally:
            writer.close()

    async def _one(
        self, session: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes
    ) -> bool:
        """One request and its response; True if the connection stays open."""
        upstream = self.upstream_for(session)
        if upstream is None:
            raise Refused(
                404, "no model endpoint configured (set base_url in the agent config)", "not_found"
            )
        request = parse_head(head, upstream)
        if session.startswith("("):
            # The proxy knows no session for the worker ("(spare)", "(pid N)"):
            # nobody's budget would hold what it spends.
            raise Refused(403, "this worker serves no session yet", "forbidden")
        key = tenant_of(session)
        meters = [self.sessions.setdefault(session, Meter())]
        if key is not None:
            meters.append(self.keys.setdefault(key, Meter()))
        for m in meters:
            m.requests += 1
            m.bytes_in += len(head)
            m.last = time.time()
        left = self.budget_left(key)
        if left is not None and left <= 0:
            for m in meters:
                m.refused += 1
            log.warning(kv("model_budget_spent", session=session, key=key))
            if self.on_call is not None:
                self.on_call(key, "refused", Usage(), len(head), 0)
            raise Refused(
                429,
                f"the model token budget of HTTP key {key!r} is spent; ask the operator to raise "
                "model_budgets",
                "budget_exceeded",
            )
        usage = Usage()
        sent = received = 0
        self.active += 1
        try:
            sent, received, keep = await self._forward(upstream, request, reader, writer, usage)
        finally:
            self.active -= 1
            for m in meters:
                m.bytes_in += sent
                m.bytes_out += received
                m.input_tokens += usage.input_tokens
                m.output_tokens += usage.output_tokens
            log.info(
                kv(
                    "model_call",
                    session=session,
                    key=key,
                    path=request.path.split("?")[0],
                    sent=sent,
                    received=received,
                    input_tokens=usage.input_tokens,
                    output_tokens=usage.output_tokens,
                )
            )
            if self.on_call is not None:
                self.on_call(key, "ok", usage, sent + len(head), received)
        return keep and not request.close

    async def _forward(
        self,
        upstream: Upstream,
        request: Request,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        usage: Usage,
    ) -> tuple[int, int, bool]:
        """Send the request upstream, stream the answer back. Returns bytes
        of body sent, bytes written to the session, and whether the
        session's connection may carry another request."""
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(
                    upstream.host,
                    upstream.port,
                    ssl=self._tls_context() if upstream.scheme == "https" else None,
                    limit=MAX_HEAD,
                ),
                UPSTREAM_CONNECT_TIMEOUT,
            )
        except (OSError, TimeoutError) as exc:
            raise Refused(
                502,
                f"the model endpoint {upstream.authority} cannot be reached: {exc}",
                "upstream_unreachable",
            ) from None
        try:
            lines = [
                f"{request.method} {request.path} HTTP/1.1",
                f"Host: {upstream.authority}",
                "Accept-Encoding: identity",
                "Connection: close",
            ]
            lines += [f"{n}: {v}" for n, v in request.headers]
            credential = upstream.credential()
            if credential is not None:
                lines.append(f"{credential[0]}: {credential[1]}")
            if request.chunked:
                lines.append("Transfer-Encoding: chunked")
            elif request.length is not None:
                lines.append(f"Content-Length: {request.length}")
            up_writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
            sent = 0
            if request.chunked:
                sent = await _copy_chunked(reader, up_writer, _ignore, MAX_BODY)
            elif request.length:
                await _copy_exact(reader, up_writer, request.length, _ignore)
                sent = request.length
            await up_writer.drain()
            received, keep = await _relay_response(
                up_reader, writer, usage, request.method == "HEAD"
            )
            return sent, received, keep
        finally:
            up_writer.close()

    def _tls_context(self) -> ssl.SSLContext:
        # Made once: loading the system's CA store takes milliseconds.
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls


def _ignore(data: bytes) -> None:
    pass


async def _relay_response(
    up: asyncio.StreamReader, writer: asyncio.StreamWriter, usage: Usage, head_only: bool = False
) -> tuple[int, bool]:
    """Copy the upstream's response to the session as it arrives, reading
    its usage. Returns the bytes written and whether the session's
    connection stays usable (a body that ends at EOF ends it too)."""
    try:
        head = await up.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
        raise Refused(
            502, "the model endpoint sent no valid response head", "bad_gateway"
        ) from None
    lines = head.decode("latin-1").split("\r\n")
    status_parts = lines[0].split(" ", 2)
    if len(status_parts) < 2 or not status_parts[1].isdigit():
        raise Refused(502, "the model endpoint sent no valid status line", "bad_gateway")
    status = int(status_parts[1])
    out = [f"HTTP/1.1 {status} {status_parts[2] if len(status_parts) > 2 else ''}".rstrip()]
    length: int | None = None
    chunked = False
    content_type = ""
    for line in lines[1:]:
        if not line:
            continue
        name, _, value = line.partition(":")
        lower, value = name.strip().lower(), value.strip()
        if lower == "content-length" and value.isdigit():
            length = int(value)
        elif lower == "transfer-encoding":
            chunked = "chunked" in value.lower()
        elif lower == "content-type":
            content_type = value.lower()
        if lower in (
            "connection",
            "keep-alive",
            "proxy-connection",
            "transfer-encoding",
            "content-length",
        ):
            continue
        out.append(f"{name}: {value}")
    bodiless = head_only or status in (204, 304) or 100 <= status < 200
    # A body that ends only at EOF ends the session's connection too.
    keep = bodiless or chunked or length is not None
    if chunked:
        out.append("Transfer-Encoding: chunked")
    elif length is not None:
        out.append(f"Content-Length: {length}")
    out.append(f"Connection: {'keep-alive' if keep else 'close'}")
    data = ("\r\n".join(out) + "\r\n\r\n").encode("latin-1")
    writer.write(data)
    written = len(data)
    reading = UsageReader(content_type)
    counted = [0]

    def seen(piece: bytes) -> None:
        counted[0] += len(piece)
        reading.feed(piece)

    try:
        if bodiless:
            pass
        elif chunked:
            await _copy_chunked(up, writer, seen, None)
        elif length is not None:
            await _copy_exact(up, writer, length, seen)
        else:
            while data := await up.read(READ_SIZE):
                seen(data)
                writer.write(data)
                await writer.drain()
        await writer.drain()
    except (Refused, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
        # The session has part of the answer: no error can follow it on the
        # same connection, so the connection ends where the answer broke.
        log.warning(kv("model_response_broken", error=str(exc) or type(exc).__name__))
        raise ConnectionResetError("the model endpoint's response broke off") from None
    taken = reading.close()
    usage.input_tokens, usage.output_tokens = taken.input_tokens, taken.output_tokens
    return written + counted[0], keep


async def _answer(writer: asyncio.StreamWriter, refused: Refused) -> None:
    """Answer with the gate's own error, if the session still listens."""
    try:
        writer.write(error_response(refused.status, refused.message, refused.code))
        await writer.drain()
    except ConnectionError:
        pass


# ---------------------------------------------------------------- the installed gate

_gate: Gate = Gate(lambda session: None)


def install(gate: Gate) -> None:
    """Make `gate` the one `handle` serves with (the supervisor, at start)."""
    global _gate
    _gate = gate


def current() -> Gate:
    """The gate `handle` serves with."""
    return _gate


async def handle(
    session: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes
) -> None:
    """Serve a session's model request (the session proxy's hook): `head`
    is the request line and headers, the body still in `reader`."""
    await _gate.handle(session, reader, writer, head)
