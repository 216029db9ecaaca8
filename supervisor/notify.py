"""systemd's notify protocol: READY, STATUS, WATCHDOG and STOPPING datagrams.

One datagram per notification on the unix socket named by $NOTIFY_SOCKET
("@name" is the abstract namespace). Outside systemd the variable is unset
and every call is a no-op. Failures are logged once and never stop the
supervisor: a service manager that went away must not take sessions down.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import MutableMapping

log = logging.getLogger("hermes_sup.supervisor")


class Notifier:
    """Sends sd_notify messages if the service manager asked for them."""

    def __init__(self, environ: MutableMapping[str, str]) -> None:
        address = environ.pop("NOTIFY_SOCKET", "")
        if address.startswith("@"):
            address = "\0" + address[1:]
        self.address = address or None
        # The watchdog applies to us only if it names our pid (or no pid).
        usec = environ.pop("WATCHDOG_USEC", "")
        pid = environ.pop("WATCHDOG_PID", "")
        self.watchdog: float | None = None
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self.watchdog = int(usec) / 1e6
        self._sock: socket.socket | None = None
        self._warned = False
        self._status = ""

    @property
    def enabled(self) -> bool:
        """True when running under a service manager that listens."""
        return self.address is not None

    def send(self, *fields: str) -> None:
        """Send one notification, e.g. send("READY=1", "STATUS=serving")."""
        if self.address is None:
            return
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto("\n".join(fields).encode(), self.address)
        except OSError as exc:
            if not self._warned:
                log.warning("notify_failed socket=%s error=%s", self.address, exc)
                self._warned = True

    def status(self, text: str) -> None:
        """Send STATUS= when it changed."""
        if text != self._status:
            self._status = text
            self.send(f"STATUS={text}")

    def close(self) -> None:
        """Close the datagram socket."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
