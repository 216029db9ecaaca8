"""The supervisor's sockets: where clients and workers reach it, and the
only place that sends to them.

The client sockets are the front door every hermes-sup service has
(door/fronts.py: `control.sock`, and with `tcp` set the CURVE socket;
client ids, connection caps, slow consumers). Here they are budgeted
around sessions, and joined by the one socket only a supervisor has:
`workers.sock`, a ROUTER in the private state directory that the
supervisor's own workers connect to.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq

from hermes_sup.door import gate
from hermes_sup.door.channel import Channel
from hermes_sup.door.fronts import Fronts
from hermes_sup.local import statedir
from hermes_sup.local.logfmt import kv
from hermes_sup.protocol import DEFAULT_MAX_FRAME_SIZE, Limits, LocalProtocolError, Message, encode

from .config import Settings
from .limits import FDS_PER_SESSION, PROXY_FD_SHARE, allowed_sessions
from .session import Session

log = logging.getLogger("hermes_sup.supervisor")

# A turn carries a client's text of up to the frame limit, in an envelope of
# its own: room for that envelope on the way to a worker.
ENVELOPE_ROOM = 64 * 1024
# What zmq queues on the workers' socket, in messages per worker: to a
# worker, and from one. A worker that streams faster than the supervisor
# forwards waits (its sends block) once WORKER_INBOX of its messages wait
# here, instead of the supervisor reading its stream into memory.
WORKER_QUEUE = 100_000
WORKER_INBOX = 128


def client_caps(
    fd_limit: int,
    spare_workers: int,
    max_sessions: int | None,
    wanted: int | None,
    tcp: bool,
) -> tuple[int, int]:
    """The gate's client_caps for a supervisor: sessions (and spare
    workers) are budgeted first, with the descriptors each holds."""
    sessions = allowed_sessions(fd_limit, spare_workers, max_sessions)
    # And the sealed sessions' proxy, its share of the limit (limits.py).
    held = FDS_PER_SESSION * (sessions + spare_workers) + fd_limit // PROXY_FD_SHARE
    return gate.client_caps(fd_limit, held, wanted, tcp)


def worker_limits(max_frame_size: int) -> Limits:
    """What the supervisor and its workers may send each other. Workers are
    told `max_frame_size` and keep to it, but one that was not (or a runtime
    that bypasses it) encodes up to the default: its message must still
    arrive whole, to be answered for (back.py), not cut off by zmq."""
    return Limits(max_frame_size=max(max_frame_size, DEFAULT_MAX_FRAME_SIZE) + ENVELOPE_ROOM)


class Endpoints(Fronts):
    """The bound sockets, and sending on them: the client sockets
    (`Fronts`) and the workers' socket."""

    def __init__(self, settings: Settings, key: bytes) -> None:
        s = settings  # as at start: sockets are not rebound on reload
        super().__init__(
            s.state_dir,
            key,
            max_frame_size=s.max_frame_size,
            client_queue=s.client_queue,
            tcp=s.tcp,
            data_dir=s.data_dir,
            max_clients=s.max_clients,
            caps=lambda fd_limit: client_caps(
                fd_limit, s.spare_workers, s.max_sessions, s.max_clients, bool(s.tcp)
            ),
            more_room="raise LimitNOFILE / ulimit -n, or lower max_sessions",
        )
        self.settings = settings
        self.worker_limits = worker_limits(s.max_frame_size)
        self.worker = statedir.endpoint(s.state_dir, statedir.WORKER_SOCKET)

    def open(
        self,
        loop: asyncio.AbstractEventLoop,
        on_client: Callable[[int, list[bytes]], None],
        on_worker: Callable[[list[bytes]], None],
    ) -> None:
        """Make the zmq context and bind every socket; `on_client(index,
        frames)` and `on_worker(frames)` get what arrives."""
        self.listen(zmq.Context(), loop, on_client)
        back = self._router(self.worker_limits.max_frame_size, WORKER_QUEUE, WORKER_INBOX)
        self.back = Channel(self._bind(back, self.worker), on_worker, loop)

    def close(self) -> None:
        super().close()
        self.back.close()
        self.ctx.term()

    def to_worker(self, session: Session, msg: Message) -> bool:
        """Send to a session's worker; False if it has none or is gone."""
        if session.worker_id is None or session.token is None:
            return False
        try:
            self.back.send([session.worker_id, *encode(msg, session.token, self.worker_limits)])
            return True
        except LocalProtocolError as exc:
            log.error(kv("unsendable", kind=msg.kind.value, session=session.key, error=exc.message))
            return False
        except zmq.ZMQError as exc:
            log.warning(kv("worker_unreachable", session=session.key, error=exc))
            return False
