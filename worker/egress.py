"""A sealed worker's way out: the listener its egress proxy is served on.

A sealed worker has a network namespace of its own with only `lo` (made by
hermes_sup.seal.steps's `enter`). Right after that, while the state directory is
still in its view and before anything of a session runs, the worker makes
a TCP listening socket on SESSION_PROXY_HOST:PORT in that namespace and
hands the listening descriptor to the supervisor over <state>/EGRESS_SOCKET
(SCM_RIGHTS). The supervisor accepts the session's connections on it and
dials out from its own namespace, by policy (supervisor/proxy.py). The
worker keeps no copy: nothing in the session can accept on that port, and
once the port is taken nothing in the session can listen there either.

`network` = "none" hands the listener over too: the proxy then refuses
every destination, but the model endpoint (SESSION_MODEL_PATH) still
answers. "host" (or an unsealed worker) hands nothing over.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from hermes_sup.local.addresses import SESSION_PROXY_HOST, SESSION_PROXY_PORT
from hermes_sup.seal.calls import SealError

# The network modes whose workers hand a listener over.
LISTENING = ("egress", "none")
# How long the supervisor may take to take it (it answers at once).
HANDOFF_TIMEOUT = 10.0
PROXY_URL = f"http://{SESSION_PROXY_HOST}:{SESSION_PROXY_PORT}"
# Never through the proxy: the session's own loopback (its own servers).
NO_PROXY = "localhost,127.0.0.1,::1"


def _netns() -> int:
    return os.stat("/proc/self/ns/net").st_ino


# The zygote's network namespace (this module is imported there, before
# any fork): a worker still in it has none of its own.
ZYGOTE_NETNS = _netns()


def hand_over(plan: dict[str, Any]) -> bool:
    """Make the proxy's listener in this worker's network namespace and
    give it to the supervisor. False where the plan's network hands
    nothing over; SealError where it cannot (the worker then does not run
    the session: a session that was to be fenced must not run unfenced)."""
    if plan.get("network") not in LISTENING:
        return False
    if _netns() == ZYGOTE_NETNS:
        raise SealError(
            "network",
            f"network = {plan.get('network')}, but this worker shares the host's network namespace",
        )
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        try:
            listener.bind((SESSION_PROXY_HOST, SESSION_PROXY_PORT))
            listener.listen(128)
        except OSError as exc:
            raise SealError(
                "network",
                f"listen on {SESSION_PROXY_HOST}:{SESSION_PROXY_PORT}: {exc.strerror or exc}",
            ) from None
        answer = _send(plan["egress_socket"], listener.fileno())
    finally:
        listener.close()  # the supervisor has its own copy now (or none)
    if answer != b"ok\n":
        said = answer.decode(errors="replace").strip() or "no answer"
        raise SealError("network", f"the supervisor did not take the proxy listener: {said}")
    return True


def _send(path: str, fd: int) -> bytes:
    """Hand `fd` over at `path`; the supervisor's one-line answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as link:
        link.settimeout(HANDOFF_TIMEOUT)
        try:
            link.connect(path)
            socket.send_fds(link, [b"listener"], [fd])
            return link.recv(256)
        except OSError as exc:
            raise SealError("network", f"hand-over at {path}: {exc.strerror or exc}") from None


def proxy_env(network: str | None) -> dict[str, str]:
    """The variables that send a session's HTTP clients (curl, pip, git,
    Python, Node) through its proxy: only with network = "egress"."""
    if network != "egress":
        return {}
    env = {}
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        env[name] = env[name.lower()] = PROXY_URL
    env["NO_PROXY"] = env["no_proxy"] = NO_PROXY
    # Node's own fetch and http read the variables only when asked to (22.21+).
    env["NODE_USE_ENV_PROXY"] = "1"
    return env
