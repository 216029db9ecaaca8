"""Frames on the wire: encode, decode, sign, verify, and the replay window.

A message travels as three ZMQ frames (after any routing frames a ROUTER
socket adds or strips):

    [MAGIC, signature, payload]

MAGIC names the protocol and its version; payload is one msgpack map (the
envelope); signature is HMAC-SHA256(key, payload), 32 raw bytes. This module
does no I/O and never imports zmq.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from .errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from .messages import BODY_SCHEMAS, MAX_ID_LENGTH, SESSION_KINDS, Kind, Message

PROTOCOL_VERSION = 1
MAGIC = b"HSUP/1"
SIGNATURE_SIZE = 32
FRAME_COUNT = 3
DEFAULT_MAX_FRAME_SIZE = 16 * 1024 * 1024
_KINDS = {k.value: k for k in Kind}


@dataclass(frozen=True)
class Limits:
    """Hard limits on what a peer may send."""

    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE


DEFAULT_LIMITS = Limits()

# Watches and `logs` follows one client connection may have open at once
# (PROTOCOL.md, "watch"): a supervisor holds each connection to it, and a
# router each front end behind it.
MAX_WATCHES_PER_CLIENT = 32


def sign(key: bytes, payload: bytes) -> bytes:
    """The HMAC-SHA256 signature of one payload frame (RFC 2104)."""
    pads = _PADS.get(key)
    if pads is None:
        pads = _pads(key)
    inner = pads[0].copy()
    inner.update(payload)
    outer = pads[1].copy()
    outer.update(inner.digest())
    return outer.digest()


# HMAC's keyed inner and outer hash states, computed once per key and copied
# per message: a signature then costs two SHA-256 copies and three small
# updates, about a quarter of hmac.digest(), which sets up both states from
# the key on every call (and OpenSSL 3 looks up the digest by name, too).
_PADS: dict[bytes, tuple[hashlib._Hash, hashlib._Hash]] = {}
_MAX_KEYS = 8192  # a supervisor holds one key per running worker, plus its own
_BLOCK = 64  # SHA-256's block size
_IPAD = bytes(x ^ 0x36 for x in range(256))
_OPAD = bytes(x ^ 0x5C for x in range(256))


def _pads(key: bytes) -> tuple[hashlib._Hash, hashlib._Hash]:
    block = hashlib.sha256(key).digest() if len(key) > _BLOCK else key
    block = block.ljust(_BLOCK, b"\0")
    pads = (
        hashlib.sha256(block.translate(_IPAD)),
        hashlib.sha256(block.translate(_OPAD)),
    )
    if len(_PADS) >= _MAX_KEYS:
        _PADS.clear()  # rare: the cost is recomputing pads for keys still in use
    _PADS[key] = pads
    return pads


def encode(msg: Message, key: bytes, limits: Limits = DEFAULT_LIMITS) -> list[bytes]:
    """Turn a message into signed frames. Raises LocalProtocolError if the
    message itself breaks the protocol (a bug on this side)."""
    try:
        _check_envelope(msg.kind.value, msg.id, msg.ts, msg.session, msg.re, msg.body, msg.ttl)
    except RemoteProtocolError as exc:
        raise LocalProtocolError(exc.code, exc.message, msg_id=msg.id) from None
    envelope = {
        "id": msg.id,
        "kind": msg.kind.value,
        "ts": msg.ts,
        "session": msg.session,
        "re": msg.re,
        "body": msg.body,
    }
    if msg.ttl is not None:
        envelope["ttl"] = msg.ttl
    try:
        payload = msgpack.packb(envelope, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise LocalProtocolError(ErrorCode.MALFORMED, f"cannot pack message: {exc}") from None
    if len(payload) > limits.max_frame_size:
        raise LocalProtocolError(
            ErrorCode.TOO_LARGE,
            f"message is {len(payload)} bytes, over the {limits.max_frame_size}-byte limit",
            msg_id=msg.id,
        )
    return [MAGIC, sign(key, payload), payload]


def decode(
    frames: Sequence[bytes],
    key: bytes,
    limits: Limits = DEFAULT_LIMITS,
    guard: ReplayGuard | None = None,
    now: float | None = None,
) -> Message:
    """Verify and parse signed frames. Raises RemoteProtocolError, and nothing
    else, for anything a peer could have got wrong."""
    return message_of(unpack(verify(frames, key, limits)), guard, now)


def verify(frames: Sequence[bytes], key: bytes, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """The payload of signed frames, once their shape, size and signature
    check out (decode's first step). Raises RemoteProtocolError."""
    if len(frames) != FRAME_COUNT:
        raise RemoteProtocolError(
            ErrorCode.BAD_FRAMES, f"expected {FRAME_COUNT} frames, got {len(frames)}"
        )
    magic, signature, payload = (bytes(f) for f in frames)
    if magic != MAGIC:
        if magic.startswith(b"HSUP/"):
            raise RemoteProtocolError(
                ErrorCode.UNSUPPORTED_VERSION,
                f"protocol {magic[:16]!r} is not supported; this peer speaks {MAGIC!r}",
            )
        raise RemoteProtocolError(ErrorCode.BAD_FRAMES, f"first frame must be {MAGIC!r}")
    if len(payload) > limits.max_frame_size:
        raise RemoteProtocolError(
            ErrorCode.TOO_LARGE,
            f"payload is {len(payload)} bytes, over the {limits.max_frame_size}-byte limit",
        )
    # Verify before parsing: an unsigned peer never reaches the msgpack parser.
    if len(signature) != SIGNATURE_SIZE or not hmac.compare_digest(signature, sign(key, payload)):
        raise RemoteProtocolError(ErrorCode.BAD_SIGNATURE, "signature does not match the payload")
    return payload


def unpack(payload: bytes) -> dict[Any, Any]:
    """The envelope in a verified payload: a msgpack map, not yet checked
    (decode's second step). Raises RemoteProtocolError."""
    try:
        envelope = msgpack.unpackb(payload, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises a zoo of types for bad input
        raise RemoteProtocolError(ErrorCode.MALFORMED, f"payload is not msgpack: {exc}") from None
    if not isinstance(envelope, dict):
        raise RemoteProtocolError(ErrorCode.MALFORMED, "payload must be a msgpack map")
    return envelope


def message_of(
    envelope: dict[Any, Any], guard: ReplayGuard | None = None, now: float | None = None
) -> Message:
    """The message an unpacked envelope holds, its fields and body checked
    against the kind's schema (decode's last step). Raises RemoteProtocolError."""
    msg_id = envelope.get("id")
    try:
        kind = _check_envelope(
            envelope.get("kind"),
            msg_id,
            envelope.get("ts"),
            envelope.get("session"),
            envelope.get("re"),
            envelope.get("body"),
            envelope.get("ttl"),
        )
    except RemoteProtocolError as exc:
        exc.msg_id = msg_id if isinstance(msg_id, str) and len(msg_id) <= MAX_ID_LENGTH else None
        raise
    msg = Message(
        kind,
        envelope["body"],
        session=envelope.get("session"),
        re=envelope.get("re"),
        id=envelope["id"],
        ts=float(envelope["ts"]),
        ttl=None if envelope.get("ttl") is None else float(envelope["ttl"]),
    )
    if guard is not None:
        guard.check(msg.id, msg.ts, time.time() if now is None else now)
    return msg


def _check_envelope(
    kind: object,
    msg_id: object,
    ts: object,
    session: object,
    re: object,
    body: object,
    ttl: object = None,
) -> Kind:
    """Check the envelope fields and the body against the kind's schema."""
    if not isinstance(kind, str):
        raise RemoteProtocolError(ErrorCode.BAD_FIELD, "envelope field 'kind' must be a string")
    k = _KINDS.get(kind)  # a dict lookup: Enum's constructor is slow on a hot path
    if k is None:
        raise RemoteProtocolError(ErrorCode.UNKNOWN_KIND, f"unknown message kind {kind[:40]!r}")
    if not isinstance(msg_id, str) or not 0 < len(msg_id) <= MAX_ID_LENGTH:
        raise RemoteProtocolError(
            ErrorCode.BAD_FIELD, f"envelope field 'id' must be a string of 1 to {MAX_ID_LENGTH}"
        )
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
        raise RemoteProtocolError(ErrorCode.BAD_FIELD, "envelope field 'ts' must be a number")
    if session is not None and not isinstance(session, str):
        raise RemoteProtocolError(ErrorCode.BAD_FIELD, "envelope field 'session' must be a string")
    if k in SESSION_KINDS and session is None:
        raise RemoteProtocolError(ErrorCode.BAD_FIELD, f"a {k.value!r} message must name a session")
    if re is not None and (not isinstance(re, str) or len(re) > MAX_ID_LENGTH):
        raise RemoteProtocolError(ErrorCode.BAD_FIELD, "envelope field 're' must be a string")
    if not isinstance(body, dict):
        raise RemoteProtocolError(ErrorCode.BAD_FIELD, "envelope field 'body' must be a map")
    if ttl is not None and (
        isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl > 0
    ):
        raise RemoteProtocolError(
            ErrorCode.BAD_FIELD, "envelope field 'ttl' must be a positive number of seconds"
        )
    _check_body(k, body)
    return k


def _check_body(kind: Kind, body: dict[Any, Any]) -> None:
    schema = BODY_SCHEMAS[kind]
    for name, (types, required) in schema.items():
        if name not in body:
            if required:
                raise RemoteProtocolError(
                    ErrorCode.BAD_FIELD, f"{kind.value!r} needs body field {name!r}"
                )
            continue
        value = body[name]
        # bool is an int in Python; msgpack keeps them apart, so do we.
        if object not in types and (
            not isinstance(value, types) or (isinstance(value, bool) and bool not in types)
        ):
            names = " or ".join("nil" if t is type(None) else t.__name__ for t in types)
            raise RemoteProtocolError(
                ErrorCode.BAD_FIELD,
                f"{kind.value!r} body field {name!r} must be {names}, got {type(value).__name__}",
            )


class ReplayGuard:
    """Refuses a message id seen before, and messages too old to tell.

    Ids are remembered for `window` seconds; a message whose timestamp is
    further than that from now is refused as stale, so forgetting old ids is
    safe. If more than `capacity` ids arrive within a window, the oldest are
    forgotten early and `floor` rises so that none of them can be replayed.
    """

    def __init__(self, window: float = 60.0, capacity: int = 200_000) -> None:
        self.window = window
        self.capacity = capacity
        self.floor = -math.inf
        self._seen: OrderedDict[str, float] = OrderedDict()

    def check(self, msg_id: str, ts: float, now: float) -> None:
        """Record `msg_id`, or raise RemoteProtocolError(REPLAYED)."""
        if abs(now - ts) > self.window or ts <= self.floor:
            raise RemoteProtocolError(
                ErrorCode.REPLAYED,
                f"message timestamp is {now - ts:+.1f}s from this peer's clock, outside the "
                f"{self.window:.0f}s replay window",
                msg_id=msg_id,
            )
        if msg_id in self._seen:
            raise RemoteProtocolError(
                ErrorCode.REPLAYED, f"message id {msg_id!r} was already received", msg_id=msg_id
            )
        self._seen[msg_id] = ts
        self._expire(now)

    def forget(self, msg_id: str) -> None:
        """Let `msg_id` come again: its request was refused before it had
        any effect (`moved`), and a router sends it again, as signed, once
        the session's lease comes free."""
        self._seen.pop(msg_id, None)

    def __len__(self) -> int:
        return len(self._seen)

    def _expire(self, now: float) -> None:
        horizon = now - self.window
        seen = self._seen
        # Arrival order is roughly timestamp order; stop at the first fresh one.
        while seen:
            oldest_id, oldest_ts = next(iter(seen.items()))
            if oldest_ts >= horizon and len(seen) <= self.capacity:
                break
            seen.popitem(last=False)
            if oldest_ts >= horizon:
                # Forgotten early: refuse anything this old from now on.
                self.floor = max(self.floor, oldest_ts)
