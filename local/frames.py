"""Sending and receiving multipart zmq messages quickly, for both ends.

The client and the supervisor move the same frames at the same rates, so
they share one pair of helpers (and the monitor events that mean a CURVE
handshake failed); they live here so that a client gets them without
loading the server. The supervisor's asyncio driving of a socket stays in
`hermes_sup.door.channel`. This is the one module of the package
that imports zmq.
"""

from __future__ import annotations

import zmq

# Plain ints: pyzmq's flag enums cost more per operation than the routing,
# and its send_multipart/recv_multipart combine them for every frame.
POLLIN = int(zmq.POLLIN)
NOBLOCK = int(zmq.NOBLOCK)
EVENTS = int(zmq.EVENTS)
SNDMORE = int(zmq.SNDMORE)
RCVMORE = int(zmq.RCVMORE)
# zmq_msg_get's property: the descriptor of the connection a frame came in on.
SRCFD = int(zmq.SRCFD)

# The socket monitor events of a failed CURVE handshake: the supervisor logs
# them, a client turns them into an error that says which side is wrong.
HANDSHAKE_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)

# The backend's own send and recv, called unbound: pyzmq's Python-level
# wrappers around them add a frame of argument handling per zmq frame.
_send = zmq.backend.Socket.send
_recv = zmq.backend.Socket.recv


def send_frames(sock: zmq.Socket[bytes], frames: list[bytes], flags: int = 0) -> None:
    """send_multipart for bytes frames, without enum arithmetic per frame."""
    for frame in frames[:-1]:
        _send(sock, frame, SNDMORE | flags)
    _send(sock, frames[-1], flags)


def recv_frames(sock: zmq.Socket[bytes], flags: int = 0) -> list[bytes]:
    """recv_multipart, reading each frame's more-flag from the frame itself:
    getsockopt(RCVMORE) would convert the option to an enum on every call."""
    frames = []
    while True:
        frame = _recv(sock, flags, copy=False)
        frames.append(frame.bytes)
        if not frame.more:
            return frames


def recv_frames_from(sock: zmq.Socket[bytes], flags: int = 0) -> tuple[list[bytes], int]:
    """recv_frames, and the descriptor of the connection the message came
    in on (-1 if zmq does not say)."""
    frames = []
    while True:
        frame = _recv(sock, flags, copy=False)
        frames.append(frame.bytes)
        if not frame.more:
            try:
                fd = int(frame.get(SRCFD))
            except zmq.ZMQError:
                fd = -1
            return frames, fd
