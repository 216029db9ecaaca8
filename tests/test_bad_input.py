"""Bad keys, bad frames, bad runtimes: each gets a clear error, and the
supervisor keeps serving everyone else. Real supervisor, raw sockets."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq

from hermes_sup.client import SupervisorError
from hermes_sup.local import statedir
from hermes_sup.protocol import MAGIC, Kind, Message, decode, encode, sign

pytestmark = pytest.mark.e2e


@pytest.fixture
def raw(supervisor, zmq_context):
    """A raw DEALER socket on the control endpoint, and the key to sign with."""
    sock = zmq_context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(statedir.endpoint(supervisor.state_dir, statedir.CONTROL_SOCKET))
    key = statedir.read_key(supervisor.state_dir)
    yield sock, key
    sock.close(0)


def answer(sock: zmq.Socket, key: bytes, timeout: float = 5.0) -> Message | None:
    if not sock.poll(int(timeout * 1000)):
        return None
    return decode(sock.recv_multipart(), key)


@pytest.mark.parametrize(
    "key",
    ["../../etc", "a\0b", "x" * 129, "", "has space", "a/b", "..", "-rf"],
)
def test_bad_session_keys_get_an_error_and_create_nothing(supervisor, key: str) -> None:
    with supervisor.client() as client:
        with pytest.raises(SupervisorError) as err:
            client.run(key, "cwd")
        assert err.value.code == "bad_session_key"
        assert "invalid session key" in err.value.message
        with pytest.raises(SupervisorError):
            client.open(key)
        # Everyone else is still served.
        assert client.run("good", "env HERMES_SESSION_KEY").text == "good"
    sessions = supervisor.data_dir / "sessions"
    assert [p.name for p in sessions.iterdir()] == [
        __import__("hermes_sup.protocol").protocol.session_dir_name("good")
    ]
    assert not (supervisor.data_dir.parent / "etc").exists()


def test_bad_frames_each_get_a_coded_error_and_service_continues(supervisor, raw) -> None:
    sock, key = raw
    good = encode(Message(Kind.PING), key)
    payload = good[2]
    cases = {
        "bad_frames": [b"garbage"],
        "unsupported_version": [b"HSUP/2", good[1], payload],
        "bad_signature": [MAGIC, sign(b"x" * 32, payload), payload],
        "malformed": [MAGIC, sign(key, b"\xc1"), b"\xc1"],
        "unknown_kind": [
            MAGIC,
            sign(
                key,
                p := msgpack.packb({"id": "z1", "kind": "rm -rf", "ts": time.time(), "body": {}}),
            ),
            p,
        ],
        "bad_field": encode(Message(Kind.PING), key)[:2]
        + [
            msgpack.packb(
                {"id": "z2", "kind": "send", "ts": time.time(), "session": "a", "body": {}}
            )
        ],
    }
    # bad_field case: re-sign the tampered payload so it reaches validation.
    cases["bad_field"][1] = sign(key, cases["bad_field"][2])
    with supervisor.client() as client:
        for code, frames in cases.items():
            sock.send_multipart(frames)
            reply = answer(sock, key)
            assert reply is not None and reply.kind is Kind.ERROR, code
            assert reply.body["code"] == code, reply.body
            assert reply.body["message"]
            # Another client's session keeps working after every bad frame.
            assert client.run("steady", "pid").ok

        # A replayed copy of a signed request is refused the second time.
        sock.send_multipart(good)
        assert answer(sock, key).kind is Kind.PONG
        sock.send_multipart(good)
        replay = answer(sock, key)
        assert replay.kind is Kind.ERROR and replay.body["code"] == "replayed"


def test_oversized_frames(supervisor_factory, zmq_context) -> None:
    sup = supervisor_factory("--max-frame-size", "65536")
    key = statedir.read_key(sup.state_dir)
    sock = zmq_context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(statedir.endpoint(sup.state_dir, statedir.CONTROL_SOCKET))
    try:
        # Just over the limit: refused with a reply that says so.
        big = encode(Message(Kind.SEND, {"text": "x" * 70_000}, session="a"), key)
        sock.send_multipart(big)
        reply = answer(sock, key)
        assert reply is not None and reply.body["code"] == "too_large"
        assert "65536" in reply.body["message"]
        # Far over: zmq drops the connection before we read it; no reply possible.
        huge = [MAGIC, b"s" * 32, b"x" * 2_000_000]
        sock.send_multipart(huge)
        assert answer(sock, key, timeout=1.0) is None
    finally:
        sock.close(0)
    with sup.client() as client:
        assert client.run("after", "pid").ok
    assert "too_large" in sup.log()


def test_a_runtime_that_cannot_load_fails_clearly(supervisor_factory) -> None:
    sup = supervisor_factory("--agent", "no_such_module_anywhere:make")
    with sup.client() as client:
        with pytest.raises(SupervisorError) as err:
            client.run("a", "hello")
        # A runtime that cannot load will never start: failed at once, no retry loop.
        assert err.value.code == "session_failed"
        assert "could not load its agent runtime" in err.value.message
        assert client.ping().pid == sup.pid
        (row,) = client.sessions()
        assert row["state"] == "failed" and "status 71" in row["last_exit"]
        assert row["exits"] == 1
        with pytest.raises(SupervisorError) as err:
            client.run("a", "again")
        assert err.value.code == "session_failed" and "Kill it to retry" in err.value.message
        assert client.kill("a").reason == "cleared"
        assert client.sessions()[0]["state"] == "exited"
    log = (sup.data_dir / "sessions").glob("*/worker.log")
    assert any("no_such_module_anywhere" in p.read_text() for p in log)


def test_a_turn_that_raises_is_an_error_and_the_session_stays_usable(supervisor) -> None:
    with supervisor.client() as client:
        with pytest.raises(SupervisorError) as err:
            client.run("a", "sleep forever")
        assert err.value.code == "turn_failed"
        assert "usage: sleep SECONDS" in err.value.message
        assert client.run("a", "cwd").ok


def test_conflicting_options_on_a_running_session(supervisor) -> None:
    with supervisor.client() as client:
        client.open("c", options={"session_env": {"platform": "slack"}})
        client.open("c", options={"session_env": {"platform": "slack"}})  # same: fine
        with pytest.raises(SupervisorError) as err:
            client.open("c", options={"session_env": {"platform": "discord"}})
        assert err.value.code == "session_conflict"
        with pytest.raises(SupervisorError) as err:
            client.open("d", options={"env": {"HERMES_HOME": "/etc"}})
        assert err.value.code == "bad_field" and "HERMES_HOME" in err.value.message


def test_a_full_queue_refuses_with_busy_and_loses_nothing(supervisor_factory) -> None:
    sup = supervisor_factory("--max-queue", "3")
    with sup.client() as client:
        reqs = [client.submit(Kind.SEND, {"text": "sleep 0.3"}, session="slow")]
        reqs += [
            client.submit(Kind.SEND, {"text": f"sh echo {i}"}, session="slow") for i in range(6)
        ]
        finals = {}
        while len(finals) < len(reqs):
            msg = client.next()
            if msg.kind is not Kind.EVENT:
                finals[msg.re] = msg
        kinds = [finals[r].kind for r in reqs]
        busy = [finals[r] for r in reqs if finals[r].kind is Kind.ERROR]
        # Every request got exactly one answer: the ones over the bound a clear
        # busy error, the rest their replies, in order.
        assert all(b.body["code"] == "busy" and "limit 3" in b.body["message"] for b in busy)
        assert len(busy) >= 2 and kinds.count(Kind.REPLY) + len(busy) == len(reqs)
        assert client.run("other", "pid").ok


def test_a_request_past_its_time_to_live_is_refused_and_not_carried_out(supervisor, raw) -> None:
    sock, key = raw
    late = Message(Kind.SEND, {"text": "pid"}, session="too-late", ts=time.time() - 3, ttl=1.0)
    sock.send_multipart(encode(late, key))
    got = answer(sock, key)
    assert got is not None and got.kind is Kind.ERROR and got.re == late.id
    assert got.body["code"] == "expired"
    assert "time to live" in got.body["message"]
    # In time, the same kind of request runs; a bad ttl is named.
    fresh = Message(Kind.SEND, {"text": "pid"}, session="in-time", ttl=30.0)
    sock.send_multipart(encode(fresh, key))
    kinds = []
    while (got := answer(sock, key)) is not None and got.kind is Kind.EVENT:
        kinds.append(got.body["data"]["state"])
    assert got is not None and got.kind is Kind.REPLY and got.re == fresh.id
    envelope = {"id": "t1", "kind": "ping", "ts": time.time(), "ttl": "soon", "body": {}}
    payload = msgpack.packb(envelope, use_bin_type=True)
    sock.send_multipart([MAGIC, sign(key, payload), payload])
    got = answer(sock, key)
    assert got is not None and got.body["code"] == "bad_field" and "'ttl'" in got.body["message"]
    with supervisor.client() as client:
        assert [r["key"] for r in client.sessions()] == ["in-time"]
    # Not carried out, so its id is not spent: the same turn sent again, in
    # time, runs (a client's retry by turn id after `expired`).
    retry = Message(Kind.SEND, {"text": "pid"}, session="too-late", id=late.id, ttl=30.0)
    sock.send_multipart(encode(retry, key))
    got = answer(sock, key)
    assert got is not None and got.kind is Kind.EVENT and got.re == late.id, got
    while (got := answer(sock, key)) is not None and got.kind is Kind.EVENT:
        pass
    assert got is not None and got.kind is Kind.REPLY, got
