"""The zygote: a preloaded, thread-free process that forks workers.

Runs as `python -m hermes_sup.worker.zygote`, started by the supervisor before
the supervisor creates any zmq context. It imports what workers need (plus the
configured preload list), freezes its gc so forked children do not dirty the
shared pages, and then forks one worker per request.

Each worker is double-forked: the intermediate child exits at once, so the
worker re-parents to the supervisor (a child subreaper), which then reaps it
and learns its exit status directly. The zygote never holds a zmq context and
never starts a thread: both would be inherited broken by every fork.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib
import os
import signal
import socket
import sys
import time
import traceback
from typing import Any

import msgpack

PR_SET_PDEATHSIG = 1
# Imported before the freeze so every worker shares them copy-on-write.
BASE_PRELOAD = ("zmq", "msgpack", "psutil", "setproctitle", "hermes_sup.worker.main")


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl failed")


def _preload(modules: list[str]) -> tuple[list[str], dict[str, str]]:
    loaded: list[str] = []
    failed: dict[str, str] = {}
    for name in modules:
        try:
            importlib.import_module(name)
            loaded.append(name)
        except Exception as exc:  # report, do not die: the supervisor decides
            failed[name] = f"{type(exc).__name__}: {exc}"
    return loaded, failed


def _fork_worker(sock: socket.socket, request: dict[str, Any]) -> int:
    """Double-fork one worker and return its pid (as seen by the supervisor)."""
    r, w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    middle = os.fork()
    if middle == 0:
        try:
            os.close(r)
            pid = os.fork()
            if pid == 0:
                os.close(w)
                sock.close()
                from hermes_sup.worker.main import boot

                boot(request)  # never returns
            os.write(w, pid.to_bytes(8, "little"))
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    try:
        while len(data) < 8:
            chunk = os.read(r, 8 - len(data))
            if not chunk:
                break
            data += chunk
    finally:
        os.close(r)
        os.waitpid(middle, 0)
    if len(data) != 8:
        raise OSError("the intermediate fork died before reporting the worker's pid")
    return int.from_bytes(data, "little")


def serve(sock: socket.socket) -> int:
    """Answer spawn requests until the supervisor closes its end."""
    while True:
        try:
            data = sock.recv(1 << 20)
        except InterruptedError:
            continue
        if not data:
            return 0
        request = msgpack.unpackb(data, raw=False)
        reply: dict[str, Any] = {"id": request.get("id")}
        try:
            reply["pid"] = _fork_worker(sock, request)
        except Exception as exc:
            reply["error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        sock.send(msgpack.packb(reply))


def main(argv: list[str] | None = None) -> int:
    """Entry point of the zygote process."""
    parser = argparse.ArgumentParser(prog="hermes-sup-zygote")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--supervisor-pid", type=int, required=True)
    parser.add_argument("--cwd", required=True)
    parser.add_argument("--preload", action="append", default=[])
    args = parser.parse_args(argv)

    # Die with the supervisor; and if it is already gone, do not start.
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != args.supervisor_pid:
        return 1
    # Ctrl-C in a terminal reaches the whole foreground group; the supervisor
    # decides what it means, so the zygote ignores it (workers reset it).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.chdir(args.cwd)
    try:
        import setproctitle

        setproctitle.setproctitle(f"hermes-sup zygote (supervisor {args.supervisor_pid})")
    except ImportError:
        pass

    sock = socket.socket(fileno=args.fd)
    started = time.perf_counter()
    loaded, failed = _preload(list(BASE_PRELOAD) + list(args.preload))
    # Everything allocated so far is shared with children: keep the collector
    # from touching (and so copying) those pages in every worker.
    gc.collect()
    gc.freeze()
    sock.send(
        msgpack.packb(
            {
                "pid": os.getpid(),
                "loaded": loaded,
                "failed": failed,
                "seconds": time.perf_counter() - started,
            }
        )
    )
    return serve(sock)


if __name__ == "__main__":
    sys.exit(main())
