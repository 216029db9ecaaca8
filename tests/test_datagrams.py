"""The zygote's receiver: whole requests from parts, and nothing of one
left in its buffer once it is wiped (the zygote's memory is copied into
every worker it forks after)."""

from __future__ import annotations

import socket

import pytest

from hermes_sup.local.datagrams import (
    DATAGRAM_SIZE,
    PART_SIZE,
    PartsError,
    Receiver,
    split,
    split_id,
    with_id,
)


@pytest.fixture
def pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * 1024 * 1024)
    yield a, b
    a.close()
    b.close()


def test_a_request_of_many_parts_arrives_whole_with_its_number(pair) -> None:
    a, b = pair
    message = bytes(range(256)) * (5 * PART_SIZE // 256) + b"tail"
    for part in split(with_id(7, message)):
        a.send(part)
    inbox = Receiver(b)
    whole = inbox.receive()
    assert whole is not None
    number, body = split_id(whole)
    assert (number, bytes(body)) == (7, message)


def test_wiping_leaves_nothing_of_a_request_in_the_buffer(pair) -> None:
    a, b = pair
    secret = b"SECRET-token-of-alice" * (3 * PART_SIZE // 21)
    for part in split(with_id(1, secret)):
        a.send(part)
    inbox = Receiver(b)
    whole = inbox.receive()
    assert whole is not None and b"SECRET" in bytes(whole)
    whole.release()
    inbox.wipe()
    assert b"SECRET" not in bytes(inbox.buffer)
    # The next request starts clean too, and a grown buffer leaves no copy.
    big = b"OTHER" * (12 * PART_SIZE // 5)
    for part in split(with_id(2, big)):
        a.send(part)
    whole = inbox.receive()
    assert whole is not None and bytes(split_id(whole)[1]) == big
    whole.release()
    inbox.wipe()
    assert not any(inbox.buffer)


def test_a_datagram_that_is_no_part_is_refused_and_wiped(pair) -> None:
    a, b = pair
    inbox = Receiver(b)
    a.send(b"\x01" + b"SECRET" * 10)  # MORE
    a.send(b"\x07junk")
    with pytest.raises(PartsError, match="not a part"):
        inbox.receive()
    assert b"SECRET" not in bytes(inbox.buffer)
    a.send(b"\x00" + with_id(3, b"next"))
    whole = inbox.receive()
    assert whole is not None and split_id(whole)[0] == 3


def test_an_oversized_datagram_is_refused(pair) -> None:
    a, b = pair
    a.send(b"\x00" + b"x" * DATAGRAM_SIZE)
    with pytest.raises(PartsError, match="cut short"):
        Receiver(b).receive()


def test_end_of_stream_is_none(pair) -> None:
    a, b = pair
    a.close()
    assert Receiver(b).receive() is None


def test_a_request_without_its_number_is_refused() -> None:
    with pytest.raises(PartsError, match="no request number"):
        split_id(memoryview(b"abc"))
