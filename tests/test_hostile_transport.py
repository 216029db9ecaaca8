"""What one client or one session sends cannot take the supervisor down,
stall it, or make it drop what it owes others: connection floods at a low
descriptor limit, floods of failed handshakes, answers over the frame limit,
and spawn requests at the documented maximum of options. Real supervisor,
real processes, real sockets."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import pytest
import zmq

from hermes_sup.client import SupervisorError
from hermes_sup.protocol import Kind, Message


def wait_for(predicate, timeout: float = 15.0):  # noqa: ANN001, ANN201
    """Poll until `predicate` returns something truthy, with a deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError("timed out")


# ------------------------------------------------------- options at the limit


def largest_options() -> dict[str, dict[str, str]]:
    """`env` and `session_env` at the documented maximum: 64 entries of
    4,096 characters each (supervisor/environment.py)."""
    return {
        "env": {f"HS_BIG_{i:02d}": f"{i:02d}" * 2048 for i in range(64)},
        "session_env": {f"big{i:02d}": f"{i:02x}" * 2048 for i in range(64)},
    }


def spare_pids(sup) -> set[int]:  # noqa: ANN001
    found = set()
    for child in psutil.Process(sup.pid).children():
        try:
            if "(spare)" in " ".join(child.cmdline()):
                found.add(child.pid)
        except psutil.Error:
            pass
    return found


def test_a_message_of_any_size_goes_as_parts_and_comes_back_whole() -> None:
    from hermes_sup.local.datagrams import DATAGRAM_SIZE, Joiner, PartsError, split

    joiner = Joiner()
    for size in (0, 1, 32 * 1024 - 1, 32 * 1024, 32 * 1024 + 1, 3_000_000):
        message = os.urandom(size)
        parts = split(message)
        assert all(len(p) <= DATAGRAM_SIZE for p in parts)
        assert [joiner.add(p) for p in parts[:-1]] == [None] * (len(parts) - 1)
        assert joiner.add(parts[-1]) == message
    with pytest.raises(PartsError):
        joiner.add(b"\x07oops")


def test_options_whose_environment_could_not_start_a_program_are_refused() -> None:
    from hermes_sup.protocol import RemoteProtocolError
    from hermes_sup.supervisor.environment import MAX_ENVIRONMENT_BYTES, parse_options

    largest = largest_options()
    assert len(parse_options(largest).env) == 64  # the documented maximum is accepted
    wide = {name: "\U0001f600" * 4096 for name in largest["env"]}  # 4 bytes a character
    with pytest.raises(RemoteProtocolError) as err:
        parse_options({"env": wide, "session_env": largest["session_env"]})
    assert err.value.code.value == "bad_field"
    assert f"at most {MAX_ENVIRONMENT_BYTES}" in err.value.message
    assert "env and session_env" in err.value.message


@pytest.mark.parametrize("spares", [0, 2])
def test_a_session_with_the_largest_options_starts_and_answers(supervisor_factory, spares) -> None:
    sup = supervisor_factory("--spare-workers", str(spares))
    options = largest_options()
    with sup.client(timeout=30) as client:
        ready = (
            wait_for(lambda: len(spare_pids(sup)) == spares and spare_pids(sup))
            if spares
            else set()
        )
        client.open("big", **options)
        reply = client.run("big", "env HS_BIG_63")
        assert reply.text == options["env"]["HS_BIG_63"]
        assert client.run("big", "env HERMES_SESSION_BIG07").text == "07" * 2048
        # Its programs start too: the environment fits exec(2)'s limit.
        ran = client.run("big", "sh echo started")
        assert [e.data for e in ran.events if e.type == "output"] == ["started"]
        (row,) = client.sessions()
        if spares:
            assert row["pid"] in ready  # the request went to a spare, over zmq
        # And everyone else is served as before.
        assert client.run("small", "env HERMES_SESSION_KEY").text == "small"
    assert "Message too long" not in sup.log()


# ------------------------------------------------------ answers over the limit

RUNTIMES = str(Path(__file__).parent / "runtimes")
SMALL_FRAMES = 64 * 1024


@pytest.fixture
def small_frames(supervisor_factory):  # noqa: ANN001, ANN201
    """A supervisor with a 64 KiB frame limit and a runtime that answers as
    large as asked."""
    env = dict(os.environ, PYTHONPATH=RUNTIMES)
    return supervisor_factory(
        "--agent",
        "hs_big:make",
        "--max-frame-size",
        str(SMALL_FRAMES),
        "--heartbeat-timeout",
        "1",
        env=env,
    )


@pytest.mark.parametrize("size", [SMALL_FRAMES + 100, 5 * SMALL_FRAMES])
def test_a_reply_over_the_frame_limit_ends_its_turn_with_an_error(small_frames, size) -> None:
    sup = small_frames
    with sup.client() as client:
        pid = client.run("big", "pid").text
        with pytest.raises(SupervisorError) as err:
            client.run("big", f"reply {size}")
        assert err.value.code == "too_large"
        assert f"{SMALL_FRAMES}-byte frame limit" in err.value.message
        # The worker is healthy and stays: beyond the hang timeout, the
        # same process still answers, with a reply that fits.
        time.sleep(2.5)
        assert client.run("big", "pid").text == pid
        assert client.run("big", f"reply {SMALL_FRAMES // 2}").text == "r" * (SMALL_FRAMES // 2)
    assert "hung" not in sup.log()


def test_an_event_over_the_frame_limit_is_replaced_by_a_notice(small_frames) -> None:
    sup = small_frames
    with sup.client() as client:
        reply = client.run("big", f"event {3 * SMALL_FRAMES}")
        assert reply.text == "done"
        notice, small = [(e.type, e.data) for e in reply.events if e.type != "status"]
        assert notice[0] == "too_large"
        assert notice[1]["event"] == "output" and notice[1]["limit"] == SMALL_FRAMES
        assert notice[1]["bytes"] > 3 * SMALL_FRAMES
        assert small == ("output", "small")


def test_a_worker_told_the_limit_sends_a_notice_instead(workdir, zmq_context) -> None:
    from hermes_sup.protocol import decode as decode_frames
    from hermes_sup.worker.main import Link

    endpoint = f"ipc://{workdir}/w.sock"
    router = zmq_context.socket(zmq.ROUTER)
    router.linger = 0
    router.bind(endpoint)
    token = b"t" * 32
    link = Link({"worker_id": b"w1", "endpoint": endpoint, "token": token, "max_frame_size": 4096})
    try:
        reply = Message(Kind.REPLY, {"text": "x" * 10_000, "ok": True}, session="s", re="turn-1")
        event = Message(
            Kind.EVENT, {"type": "token", "data": "y" * 10_000}, session="s", re="turn-1"
        )
        fits = Message(Kind.EVENT, {"type": "token", "data": "z" * 1000}, session="s", re="turn-1")
        for msg in (event, fits, reply):
            link.send(msg)
        got = []
        for _ in range(3):
            assert router.poll(5000)
            got.append(decode_frames(router.recv_multipart()[1:], token))
        assert got[0].kind is Kind.EVENT and got[0].body["type"] == "too_large"
        assert got[0].body["data"]["event"] == "token" and got[0].body["data"]["limit"] == 4096
        assert got[1].body == fits.body
        assert got[2].kind is Kind.ERROR and got[2].re == "turn-1"
        assert (
            got[2].body["code"] == "too_large" and "4096-byte frame limit" in got[2].body["message"]
        )
    finally:
        link.sock.close(0)
        link.ctx.term()
