"""Messages of any size over a SOCK_SEQPACKET socket, as a run of parts.

The supervisor asks the zygote for workers over a SOCK_SEQPACKET
socketpair: it keeps message boundaries and carries the file descriptor of
each reply. But one datagram must fit the socket's send buffer (about 200
KiB by default, more only with privileges), and a spawn request holds a
whole environment and a session's options: 64 variables of 4,096
characters in each of `env` and `session_env` is over a megabyte. So a
message goes as parts of at most PART_SIZE bytes, each behind one flag
byte: MORE (another part follows) or LAST. One writer per direction keeps
the parts of one message together.

Both ends use this module: the supervisor (supervisor/spawner.py) and the
zygote (worker/zygote.py). The zygote reads with a `Receiver`, which puts
every part straight into one buffer it wipes after each request: a spawn
request holds a session's environment and its worker's token, and the
zygote's memory is copied into every worker it forks after, so what it
read for one session must not linger there, freed but not overwritten, for
the next session's worker (and that session's shell) to find.
"""

from __future__ import annotations

import socket

PART_SIZE = 32 * 1024
MORE = b"\x01"
LAST = b"\x00"
# What a reader passes to recv: one part and its flag byte.
DATAGRAM_SIZE = PART_SIZE + 1


class PartsError(Exception):
    """A datagram that is not a part of a message."""


def split(message: bytes, size: int = PART_SIZE) -> list[bytes]:
    """The datagrams that carry `message`, in order (one, for a small one)."""
    starts = range(0, max(len(message), 1), size)
    last = starts[-1]
    return [(LAST if start == last else MORE) + message[start : start + size] for start in starts]


# A request's own number, in front of its message (the zygote answers with
# it without decoding the message: see Receiver).
ID_SIZE = 8


def with_id(request_id: int, message: bytes) -> bytes:
    """`message` behind its request's number."""
    return request_id.to_bytes(ID_SIZE, "big") + message


def split_id(message: memoryview) -> tuple[int, memoryview]:
    """The request's number and the message behind it."""
    if len(message) < ID_SIZE:
        raise PartsError(f"a request of {len(message)} bytes has no request number")
    return int.from_bytes(message[:ID_SIZE], "big"), message[ID_SIZE:]


class Receiver:
    """Reads whole messages from a SOCK_SEQPACKET socket into one buffer,
    and wipes it on demand. The kernel writes each part straight into the
    buffer (recvmsg_into, the flag byte apart), so no copy of a message is
    ever made in a Python object that would be freed without being wiped."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = bytearray(4 * PART_SIZE)
        self.size = 0
        self._flag = bytearray(1)

    def receive(self) -> memoryview | None:
        """The next whole message (a view of the buffer, valid until wipe),
        or None at end of stream. PartsError for a datagram that is not a
        part; OSError from the socket."""
        self.wipe()
        while True:
            if len(self.buffer) < self.size + PART_SIZE:
                self._grow()
            room = memoryview(self.buffer)[self.size : self.size + PART_SIZE]
            count, _, flags, _ = self.sock.recvmsg_into([self._flag, room])
            room.release()
            if count == 0:
                return None
            if flags & socket.MSG_TRUNC:
                self.wipe()
                raise PartsError(f"a datagram over {DATAGRAM_SIZE} bytes was cut short")
            self.size += count - 1
            if self._flag == LAST:
                return memoryview(self.buffer)[: self.size]
            if self._flag != MORE:
                self.wipe()
                raise PartsError(f"a datagram with flag {bytes(self._flag)!r} is not a part")

    def wipe(self) -> None:
        """Overwrite what the last message left in the buffer."""
        if self.size:
            self.buffer[: self.size] = bytes(self.size)
            self.size = 0

    def _grow(self) -> None:
        bigger = bytearray(2 * len(self.buffer))
        with memoryview(self.buffer) as old:
            bigger[: self.size] = old[: self.size]
        self.buffer[: self.size] = bytes(self.size)
        self.buffer = bigger


class Joiner:
    """Puts messages back together from their parts, as they arrive."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def add(self, datagram: bytes) -> bytes | None:
        """Take one datagram; the whole message once its last part is in."""
        flag, part = datagram[:1], datagram[1:]
        if flag == MORE:
            self._parts.append(part)
            return None
        if flag != LAST:
            self._parts.clear()
            raise PartsError(f"a datagram with flag {flag!r} is not a part of a message")
        if not self._parts:
            return part
        self._parts.append(part)
        whole = b"".join(self._parts)
        self._parts.clear()
        return whole
