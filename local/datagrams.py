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
zygote (worker/zygote.py). It imports nothing.
"""

from __future__ import annotations

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
