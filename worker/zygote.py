"""The zygote: a preloaded, thread-free process that forks workers.

Runs as `python -m hermes_sup.worker.zygote`, started by the supervisor before
the supervisor creates any zmq context. It imports what workers need (plus the
configured preload list), freezes its gc so forked children do not dirty the
shared pages, and then forks one worker per request.

Each worker is forked with clone(CLONE_PARENT), so its parent is the
supervisor, which reaps it and learns its exit status directly (where that
is not available, a double fork: the worker re-parents to the supervisor, a
child subreaper). Sealed, the same clone puts the worker in a PID namespace
of its own (hermes_sup.seal.steps), and it learns of the supervisor's death from a
pidfd the zygote opened (worker/parent.py). The zygote never holds a zmq
context and never starts a thread: both would be inherited broken by every
fork.

The zygote is also the workers' guardian. It remembers every worker it forked
(pid and create time); when the supervisor's end of the socketpair closes,
cleanly or because the supervisor was killed, it kills whatever of those
workers and their descendants is still alive. Workers clean up after
themselves on their parent-death signal too, but a stopped or hung worker
cannot; this catches it.
"""

from __future__ import annotations

import argparse
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

from hermes_sup.local import datagrams
from hermes_sup.local.cgroupfs import WORKER_OOM_SCORE_ADJ
from hermes_sup.local.prctl import PR_SET_PDEATHSIG, can_fork_to_parent, fork_to_parent, prctl
from hermes_sup.worker import parent

# Imported before the freeze so every worker shares them copy-on-write.
# (Everything a worker imports after the fork costs it both time and private
# memory: the built-in runtimes and the stdlib they use are preloaded too.)
BASE_PRELOAD = (
    "zmq",
    "msgpack",
    "psutil",
    "setproctitle",
    "logging",
    "faulthandler",
    "subprocess",
    "threading",
    "queue",
    "hermes_sup.worker.main",
    "hermes_sup.worker.seal",
    "hermes_sup.worker.runtime",
    "hermes_sup.worker.probe",
)


# glibc's mallopt parameter for the most malloc arenas a process may have.
M_ARENA_MAX = -8


def one_malloc_arena() -> bool:
    """Give every worker one malloc arena, glibc's main one, as this
    process has (inherited at fork). By default glibc gives each thread
    that allocates an arena of its own, and a worker's threads (the turn's,
    zmq's, Hermes's) each fill one with pages no other process shares: 7
    MiB of a live Hermes worker's USS, against 2 MiB more of the main
    heap copied from the zygote with one (bench/worker_pages.py). Worker
    threads allocate under the GIL or rarely (zmq's I/O threads), so they
    have no malloc contention to spread. False where the C library has no
    mallopt (not glibc) or refuses."""
    import ctypes

    try:
        return bool(ctypes.CDLL(None).mallopt(M_ARENA_MAX, 1))
    except (OSError, AttributeError):
        return False


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


def _preload_hermes(
    paths: Any, failed: dict[str, str], sock: socket.socket
) -> dict[str, Any] | None:
    """Sealed mode only: import hermes under the fixed paths (S2's
    worker/hermes_seal.py). Safe here and nowhere else: every worker mounts
    its own session's directories over those paths before it runs hermes.
    A failure is reported, not fatal: workers then import it themselves.
    How far it is goes to the supervisor as it goes (`progress` datagrams
    before the ready one), which logs it and shows it in `status`."""
    started = time.perf_counter()

    def progress(done: int, of: int) -> None:
        body = {"done": done, "of": of, "seconds": time.perf_counter() - started}
        sock.send(msgpack.packb({"progress": body}))

    try:
        from hermes_sup.worker import hermes_seal

        done = hermes_seal.preload(paths, progress)
    except Exception as exc:
        failed["hermes (sealed preload)"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
        return None
    return {
        "modules": done.modules,
        "recorded": done.recorded,
        "seconds": done.seconds,
        "missing": len(done.missing),
    }


def _boot(body: memoryview, out_w: int) -> None:
    """In the forked child: decode its request (the zygote never does) and
    become the worker. Never returns."""
    from hermes_sup.worker.main import boot

    request = msgpack.unpackb(body, raw=False)
    enter_cgroup(request.get("cgroup") or ())
    boot(request, out_w)


def enter_cgroup(procs_files: Any) -> None:
    """The forked child's first act, before anything of its session runs:
    into the session's cgroup (the supervisor made it and checks this after,
    moving it where a write here failed), and first in line for the OOM
    killer (raising one's own oom_score_adj is always allowed; children
    inherit it)."""
    for path in procs_files:
        try:
            fd = os.open(str(path), os.O_WRONLY)
            try:
                os.write(fd, b"0")  # "0": the writing process itself
            finally:
                os.close(fd)
        except OSError:
            pass
    try:
        fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
        try:
            os.write(fd, str(WORKER_OOM_SCORE_ADJ).encode())
        finally:
            os.close(fd)
    except OSError:
        pass


# The namespaces each worker is forked into (sealed: its own PID namespace,
# see hermes_sup.seal.steps), and our uid and gid, which a worker born into a user
# namespace maps to themselves.
_NAMESPACES = 0
_IDS = (os.getuid(), os.getgid())


def _fork_worker(sock: socket.socket, request: memoryview) -> tuple[int, int]:
    """Fork one worker as a child of the supervisor, for the encoded
    `request`. Returns its pid and the read end of the pipe that carries
    its stdout and stderr (for the supervisor)."""
    out_r, out_w = os.pipe()
    if can_fork_to_parent():
        sys.stdout.flush()
        sys.stderr.flush()
        pid = fork_to_parent(_NAMESPACES)
        if pid == 0:
            try:
                if _NAMESPACES:
                    from hermes_sup.seal import steps

                    steps.born(_NAMESPACES, _IDS)
                os.close(out_r)
                sock.close()
                _boot(request, out_w)  # never returns
            finally:
                os._exit(1)
        os.close(out_w)
        return pid, out_r
    return _double_fork(sock, request, out_r, out_w)


def _double_fork(
    sock: socket.socket, request: memoryview, out_r: int, out_w: int
) -> tuple[int, int]:
    """Where clone(CLONE_PARENT) is not available: the intermediate child
    exits at once and the worker re-parents to the supervisor (a subreaper)."""
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
                os.close(out_r)
                sock.close()
                _boot(request, out_w)  # never returns
            os.write(w, pid.to_bytes(8, "little"))
        finally:
            os._exit(0)
    os.close(w)
    os.close(out_w)
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
        os.close(out_r)
        raise OSError("the intermediate fork died before reporting the worker's pid")
    return int.from_bytes(data, "little"), out_r


_parent_gone = False


def _on_parent_death(signum: int, frame: object) -> None:
    # Only note it. The supervisor's death also closes its end of our socket,
    # so recv returns EOF right after; raising here instead could abort the
    # clean-up below when the signal lands while it runs (seen in CI).
    global _parent_gone
    _parent_gone = True


def _create_time(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def kill_workers(workers: dict[int, float | None]) -> int:
    """SIGKILL every recorded worker that is still the same process, and its
    whole tree (snapshotted first). Returns how many processes were hit."""
    import psutil

    hit = 0
    for pid, created in workers.items():
        try:
            proc = psutil.Process(pid)
            if created is None or proc.create_time() != created:
                continue  # gone, or the pid now names someone else
            tree = proc.children(recursive=True)
        except psutil.Error:
            continue
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
        for p in [proc, *tree]:
            try:
                p.kill()
                hit += 1
            except psutil.Error:
                pass
    return hit


def serve(sock: socket.socket, workers: dict[int, float | None]) -> int:
    """Answer spawn requests until the supervisor closes its end. A request
    may come in several parts (see hermes_sup.local.datagrams). The zygote
    never decodes one: only the worker forked for it does, and the buffer
    it came in is wiped once the fork is done, so no later worker inherits
    another session's environment or token from the zygote's memory."""
    inbox = datagrams.Receiver(sock)
    while True:
        try:
            message = inbox.receive()
        except datagrams.PartsError:
            traceback.print_exc()
            continue
        except OSError:
            return 0
        if message is None or _parent_gone:
            return 0  # the supervisor is gone: fork nothing more
        out_fd: int | None = None
        try:
            req_id, body = datagrams.split_id(message)
            reply: dict[str, Any] = {"id": req_id}
            try:
                pid, out_fd = _fork_worker(sock, body)
                reply["pid"] = pid
            except Exception as exc:
                reply["error"] = f"{type(exc).__name__}: {exc}"
                traceback.print_exc()
            finally:
                body.release()
        except datagrams.PartsError:
            traceback.print_exc()
            continue
        finally:
            message.release()
            inbox.wipe()
        if out_fd is None:
            sock.send(msgpack.packb(reply))
        else:
            # The pipe's read end travels with the reply (SCM_RIGHTS).
            socket.send_fds(sock, [msgpack.packb(reply)], [out_fd])
            os.close(out_fd)
        if "pid" in reply:  # after the reply: the supervisor is waiting for it
            workers[reply["pid"]] = _create_time(reply["pid"])
        if len(workers) > 4096:
            # Forget workers that are gone (reaped by the supervisor).
            for pid in [p for p, t in workers.items() if _create_time(p) != t]:
                del workers[pid]


def main(argv: list[str] | None = None) -> int:
    """Entry point of the zygote process."""
    global _NAMESPACES
    parser = argparse.ArgumentParser(prog="hermes-sup-zygote")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--supervisor-pid", type=int, required=True)
    parser.add_argument("--cwd", required=True)
    parser.add_argument("--preload", action="append", default=[])
    # Sealed mode (hermes_sup.seal): "root" or "user"; the fixed paths P, W, U
    # under --data-dir; --hermes: preload hermes under them.
    parser.add_argument("--sealed", choices=["root", "user"], default=None)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--hermes", action="store_true")
    # The session cgroups' parents (supervisor/cgroups.py), deepest first.
    parser.add_argument("--cgroup-dir", action="append", default=[])
    args = parser.parse_args(argv)

    # Hear of the supervisor's death (as SIGTERM, or as EOF on the socket);
    # and if it is already gone, do not start.
    signal.signal(signal.SIGTERM, _on_parent_death)
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != args.supervisor_pid:
        return 1
    # Ctrl-C in a terminal reaches the whole foreground group; the supervisor
    # decides what it means, so the zygote ignores it (workers reset it).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    paths = None
    if args.sealed:
        from hermes_sup.seal import steps
        from hermes_sup.seal.paths import SealedPaths

        paths = SealedPaths.for_data_dir(args.data_dir)
        paths.make()  # empty: each worker mounts its session's over them
        steps.prepare()
        # A PID namespace per worker needs the clone (the double fork's
        # worker could not be told from its adopter) and a pidfd to follow
        # the supervisor by (getppid is 0 inside).
        if can_fork_to_parent() and parent.watch(args.supervisor_pid):
            _NAMESPACES = steps.namespaces_for(args.sealed)
    os.chdir(args.cwd)
    try:
        import setproctitle

        setproctitle.setproctitle(f"hermes-sup zygote (supervisor {args.supervisor_pid})")
    except ImportError:
        pass

    one_malloc_arena()
    sock = socket.socket(fileno=args.fd)
    started = time.perf_counter()
    failed: dict[str, str] = {}
    sealed_preload: dict[str, Any] | None = None
    if paths is not None and args.hermes:
        # First: an operator's preload list may name Hermes's own modules
        # (allowed when sealed), which must be imported under P, W and U
        # with everything else of Hermes, never before.
        sealed_preload = _preload_hermes(paths, failed, sock)
    loaded, failed_too = _preload(list(BASE_PRELOAD) + list(args.preload))
    failed.update(failed_too)
    from hermes_sup.worker.main import prepare

    try:
        prepare()  # before the freeze: what it makes is shared by every worker
    except Exception:
        traceback.print_exc()  # workers then make their own; say why, go on
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
                "sealed": args.sealed,
                "pid_namespaces": bool(_NAMESPACES),
                "sealed_preload": sealed_preload,
            }
        )
    )
    workers: dict[int, float | None] = {}
    try:
        return serve(sock, workers)
    finally:
        killed = kill_workers(workers)
        if killed:
            print(
                f"hermes-sup zygote: killed {killed} leftover worker process(es)", file=sys.stderr
            )
        if args.cgroup_dir:
            # A supervisor killed outright leaves its session groups; a
            # stopping one has removed them already (then this finds none).
            from hermes_sup.local.cgroupfs import remove_empty

            remove_empty(args.cgroup_dir)


if __name__ == "__main__":
    sys.exit(main())
