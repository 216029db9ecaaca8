"""Protocol tier: pure encode/decode, signing, limits and the replay window. No sockets."""

from __future__ import annotations

import subprocess
import sys

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hermes_sup.protocol import (
    BODY_SCHEMAS,
    MAGIC,
    ErrorCode,
    Kind,
    Limits,
    LocalProtocolError,
    Message,
    RemoteProtocolError,
    ReplayGuard,
    decode,
    encode,
    sign,
)

KEY = b"k" * 32


def sample_body(kind: Kind) -> dict[str, object]:
    """A valid body for each kind, built from its schema."""
    values = {
        str: "x",
        int: 7,
        float: 1.5,
        bool: True,
        dict: {"a": 1},
        list: [1, "b"],
        object: None,
    }
    body = {}
    for name, (types, _required) in BODY_SCHEMAS[kind].items():
        body[name] = values[next(t for t in types if t is not type(None))]
    return body


@pytest.mark.parametrize("kind", list(Kind))
def test_every_kind_round_trips(kind: Kind) -> None:
    msg = Message(kind, sample_body(kind), session="alice", re="r1")
    frames = encode(msg, KEY)
    assert frames[0] == MAGIC and len(frames) == 3
    assert decode(frames, KEY) == msg


def test_unicode_and_nested_data_survive() -> None:
    data = {"text": "héllo ✓ \U0001f600", "nested": [{"a": [1, 2.5, None, True]}], "b": b"\x00\xff"}
    msg = Message(Kind.EVENT, {"type": "output", "data": data}, session="s")
    assert decode(encode(msg, KEY), KEY).body["data"] == data


@given(key=st.binary(max_size=200), payload=st.binary(max_size=400))
def test_signature_is_standard_hmac_sha256(key: bytes, payload: bytes) -> None:
    """`sign` caches each key's pads; it must stay HMAC-SHA256 for every key
    length (keys past the 64-byte block are hashed first), every time."""
    import hmac

    assert sign(key, payload) == hmac.digest(key, payload, "sha256")
    assert sign(key, payload) == hmac.digest(key, payload, "sha256")  # cached


def test_forged_signature_is_refused() -> None:
    frames = encode(Message(Kind.PING), KEY)
    with pytest.raises(RemoteProtocolError) as err:
        decode(frames, b"other-key" * 4)
    assert err.value.code is ErrorCode.BAD_SIGNATURE


def test_tampered_payload_is_refused() -> None:
    frames = encode(Message(Kind.SEND, {"text": "hi"}, session="alice"), KEY)
    envelope = msgpack.unpackb(frames[2])
    envelope["session"] = "bob"
    frames[2] = msgpack.packb(envelope)
    with pytest.raises(RemoteProtocolError) as err:
        decode(frames, KEY)
    assert err.value.code is ErrorCode.BAD_SIGNATURE


def test_unsigned_frames_are_refused() -> None:
    payload = encode(Message(Kind.PING), KEY)[2]
    with pytest.raises(RemoteProtocolError) as err:
        decode([MAGIC, b"", payload], KEY)
    assert err.value.code is ErrorCode.BAD_SIGNATURE


@pytest.mark.parametrize(
    "frames, code",
    [
        ([b"x"], ErrorCode.BAD_FRAMES),
        ([MAGIC, b"a", b"b", b"c"], ErrorCode.BAD_FRAMES),
        ([b"HTTP/1.1", b"a", b"b"], ErrorCode.BAD_FRAMES),
        ([b"HSUP/9", b"a", b"b"], ErrorCode.UNSUPPORTED_VERSION),
    ],
)
def test_bad_frame_shapes(frames: list[bytes], code: ErrorCode) -> None:
    with pytest.raises(RemoteProtocolError) as err:
        decode(frames, KEY)
    assert err.value.code is code


def signed(payload: bytes) -> list[bytes]:
    return [MAGIC, sign(KEY, payload), payload]


def envelope(**overrides: object) -> bytes:
    env = {"id": "m1", "kind": "ping", "ts": 1.0, "session": None, "re": None, "body": {}}
    env.update(overrides)
    return msgpack.packb(env)


@pytest.mark.parametrize(
    "payload, code, words",
    [
        (b"\xc1\xc1", ErrorCode.MALFORMED, "msgpack"),
        (msgpack.packb([1, 2]), ErrorCode.MALFORMED, "map"),
        (envelope(kind="launch_missiles"), ErrorCode.UNKNOWN_KIND, "launch_missiles"),
        (envelope(kind=3), ErrorCode.BAD_FIELD, "kind"),
        (envelope(id=""), ErrorCode.BAD_FIELD, "'id'"),
        (envelope(id="x" * 65), ErrorCode.BAD_FIELD, "'id'"),
        (envelope(ts="yesterday"), ErrorCode.BAD_FIELD, "'ts'"),
        (envelope(ts=float("nan")), ErrorCode.BAD_FIELD, "'ts'"),
        (envelope(body=[]), ErrorCode.BAD_FIELD, "'body'"),
        (envelope(kind="send", session="a", body={}), ErrorCode.BAD_FIELD, "'text'"),
        (envelope(kind="send", session="a", body={"text": 5}), ErrorCode.BAD_FIELD, "'text'"),
        (envelope(kind="send", body={"text": "hi"}), ErrorCode.BAD_FIELD, "session"),
        (envelope(kind="kill", session="a", body={"force": 1}), ErrorCode.BAD_FIELD, "force"),
        (envelope(kind="hello", session="a", body={"pid": True}), ErrorCode.BAD_FIELD, "pid"),
        (envelope(session=7), ErrorCode.BAD_FIELD, "session"),
    ],
)
def test_bad_envelopes_name_what_is_wrong(payload: bytes, code: ErrorCode, words: str) -> None:
    with pytest.raises(RemoteProtocolError) as err:
        decode(signed(payload), KEY)
    assert err.value.code is code
    assert words in err.value.message


def test_error_cites_the_offending_id_when_readable() -> None:
    with pytest.raises(RemoteProtocolError) as err:
        decode(signed(envelope(id="abc", kind="send", session="a", body={})), KEY)
    assert err.value.msg_id == "abc"


def test_size_limit_both_ways() -> None:
    limits = Limits(max_frame_size=1024)
    big = Message(Kind.SEND, {"text": "x" * 2000}, session="a")
    with pytest.raises(LocalProtocolError) as err:
        encode(big, KEY, limits)
    assert err.value.code is ErrorCode.TOO_LARGE
    frames = encode(big, KEY)
    with pytest.raises(RemoteProtocolError) as rerr:
        decode(frames, KEY, limits)
    assert rerr.value.code is ErrorCode.TOO_LARGE


def test_encode_refuses_what_decode_would_refuse() -> None:
    with pytest.raises(LocalProtocolError):
        encode(Message(Kind.SEND, {"text": 1}, session="a"), KEY)
    with pytest.raises(LocalProtocolError):
        encode(Message(Kind.SEND, {"text": "hi"}), KEY)  # no session
    with pytest.raises(LocalProtocolError):
        encode(Message(Kind.EVENT, {"type": "x", "data": object()}, session="a"), KEY)
    for ttl in (0, -1.0, float("nan"), True):
        with pytest.raises(LocalProtocolError, match="'ttl'"):
            encode(Message(Kind.PING, ttl=ttl), KEY)


def test_a_time_to_live_travels_and_is_left_out_when_unset() -> None:
    assert decode(encode(Message(Kind.PING, ttl=2.5), KEY), KEY).ttl == 2.5
    frames = encode(Message(Kind.PING), KEY)
    assert "ttl" not in msgpack.unpackb(frames[2]) and decode(frames, KEY).ttl is None


def test_replay_guard_refuses_a_second_copy() -> None:
    guard = ReplayGuard(window=60)
    frames = encode(Message(Kind.PING, ts=1000.0), KEY)
    decode(frames, KEY, guard=guard, now=1000.5)
    with pytest.raises(RemoteProtocolError) as err:
        decode(frames, KEY, guard=guard, now=1001.0)
    assert err.value.code is ErrorCode.REPLAYED


def test_replay_guard_refuses_stale_and_future_messages() -> None:
    guard = ReplayGuard(window=60)
    for ts in (1000.0 - 61, 1000.0 + 61):
        with pytest.raises(RemoteProtocolError) as err:
            guard.check(f"id{ts}", ts, now=1000.0)
        assert err.value.code is ErrorCode.REPLAYED


def test_replay_guard_stays_bounded_and_safe_when_full() -> None:
    guard = ReplayGuard(window=60, capacity=100)
    for i in range(1000):
        guard.check(f"m{i}", 1000.0 + i * 0.001, now=1001.0)
    assert len(guard) <= 101
    # An id forgotten early must still be refused: the floor has risen past it.
    with pytest.raises(RemoteProtocolError):
        guard.check("m5", 1000.0 + 5 * 0.001, now=1001.0)
    guard.check("fresh", 1001.0, now=1001.0)


def test_replay_guard_forgets_expired_ids() -> None:
    guard = ReplayGuard(window=10)
    for i in range(50):
        guard.check(f"m{i}", 100.0, now=100.0)
    guard.check("later", 200.0, now=200.0)
    assert len(guard) == 1


frame = st.binary(max_size=256)


@given(st.lists(frame, max_size=5))
def test_garbage_frames_only_ever_raise_remote_errors(frames: list[bytes]) -> None:
    with pytest.raises(RemoteProtocolError):
        decode(frames, KEY)


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@given(
    st.dictionaries(
        st.sampled_from(["id", "kind", "ts", "session", "re", "body", "extra"]),
        msgpack_values | st.sampled_from([k.value for k in Kind]),
    )
)
def test_signed_garbage_envelopes_never_crash(env: dict[str, object]) -> None:
    """Even a peer holding the key cannot make decode raise anything unexpected."""
    payload = msgpack.packb(env)
    try:
        msg = decode(signed(payload), KEY)
    except RemoteProtocolError:
        return
    # What got through is a well-formed message that encodes again.
    assert decode(encode(msg, KEY), KEY) == msg


def test_importing_protocol_does_not_import_zmq() -> None:
    code = (
        "import sys, hermes_sup.protocol as p; "
        "bad = [m for m in sys.modules if m == 'zmq' or m.startswith(('zmq.', 'asyncio'))]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
