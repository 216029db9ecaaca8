"""Where a service listens, as an operator writes it: `PORT` (loopback
only) or `HOST:PORT`. Every interface only when asked by name (`0.0.0.0:PORT`,
`[::]:PORT`), never with `*`: a service reachable from the network must be
meant. Shared by the supervisor's TCP socket and the HTTP endpoint.
"""

from __future__ import annotations

LOOPBACK = "127.0.0.1"


def parse_listen(spec: str, what: str, any_port: bool = False) -> tuple[str, int]:
    """(host, port) from `spec`; ValueError naming `what` and the fault.
    With `any_port`, port 0 (the kernel picks one) is allowed."""
    host, sep, port_text = spec.rpartition(":")
    if not sep:
        host, port_text = LOOPBACK, spec
    host = host.strip("[]") or LOOPBACK
    if host == "*":
        raise ValueError(f"{what} {spec!r}: write 0.0.0.0 to listen on every interface")
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"{what} {spec!r}: the port must be a number") from None
    if not (0 if any_port else 1) <= port < 65536:
        raise ValueError(f"{what} {spec!r}: port {port} is out of range")
    return host, port


# Inside a sealed session's network namespace, where the supervisor's
# egress proxy listens (the socket is made in the worker's namespace and
# handed to the supervisor, which accepts on it): the same address in
# every session, since no two share a namespace. Its /model/ path is the
# model endpoint, with the operator's credentials added outside.
SESSION_PROXY_HOST = LOOPBACK
SESSION_PROXY_PORT = 3128
SESSION_MODEL_PATH = "/model"
# The supervisor's socket a sealed worker hands that listening socket to,
# in the state directory (SCM_RIGHTS; checked by SO_PEERCRED).
EGRESS_SOCKET = "egress.sock"
