"""What runs inside one session's worker process, from fork to exit.

`boot` is called in the freshly forked child of the zygote. It makes the
process the session's own: its own session and process group, umask 077,
stdout/stderr into the session log, cwd = the workspace, and os.environ
replaced by exactly the environment the supervisor computed for this session.
Only then does it create a zmq context and connect to the supervisor.

A spare worker (`spare_workers`, see supervisor/spare_workers.py) is forked before
there is a session for it: it does only what no session decides (its own
process group, death with the supervisor, the zmq connection, a warm-up,
the turn thread), then waits for the supervisor to assign it a session, and
from there goes on exactly as above.

From there the session is served by worker/loop.py's main loop.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, NoReturn

from hermes_sup.local.prctl import PR_SET_CHILD_SUBREAPER, PR_SET_PDEATHSIG, prctl
from hermes_sup.protocol import (
    Kind,
    Message,
    WorkerExit,
    decode,
    encode,
)

from . import runtime as runtime_mod
from .loop import Link, TurnThread, WorkerLoop

# The signal the kernel sends us when the supervisor dies. It only wakes the
# main loop, which checks getppid() and cleans up; it must not kill us first.
PARENT_DEATH_SIGNAL = signal.SIGUSR1

log = logging.getLogger("hermes_sup.worker")


def boot(request: dict[str, Any], out_fd: int) -> NoReturn:
    """Become the session's worker; never returns. `out_fd` is the pipe to the
    supervisor that becomes stdout and stderr."""
    code = WorkerExit.BOOT_FAILED
    try:
        _redirect_output(out_fd)
        code = _boot(request)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(int(code))


def _boot(req: dict[str, Any]) -> int:
    supervisor_pid = int(req["supervisor_pid"])
    code = _own_process(supervisor_pid)
    if code is not None:
        return code
    link = None
    if req.get("spare"):
        # Forked ahead of need (--spare-workers): connect now, then wait to
        # be given a session. Nothing of any session is here before that.
        _set_title("(spare)")
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the zygote's handler
        link = Link(req)
        turns = TurnThread()
        turns.start()
        _warm_up(link.token)
        assigned = link.wait_for_session(supervisor_pid)
        if assigned is None:
            gone = os.getppid() != supervisor_pid
            return WorkerExit.SUPERVISOR_GONE if gone else WorkerExit.OK
        return _serve_session(assigned, link, turns)
    return _serve_session(req)


def _set_title(title: str) -> None:
    try:
        import setproctitle

        setproctitle.setproctitle(f"hermes-sup worker {title}")
    except ImportError:
        pass


def _own_process(supervisor_pid: int) -> int | None:
    """Make this process a worker of `supervisor_pid`, before any session:
    its own process group, our children's orphans ours, death with the
    supervisor. An exit code if it cannot be."""
    os.setsid()
    # Orphans of our children re-parent to us, so our process tree is always
    # the whole of what this session started (setsid or not).
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    # Our parent is the supervisor at once (clone with CLONE_PARENT); after a
    # double fork we must first be adopted by it before asking for a
    # parent-death signal (else it fires now).
    deadline = time.monotonic() + 5.0
    while os.getppid() != supervisor_pid:
        if time.monotonic() > deadline:
            return WorkerExit.SUPERVISOR_GONE
        time.sleep(0.0002)
    signal.signal(PARENT_DEATH_SIGNAL, lambda *_: None)
    prctl(PR_SET_PDEATHSIG, PARENT_DEATH_SIGNAL)
    if os.getppid() != supervisor_pid:
        return WorkerExit.SUPERVISOR_GONE
    return None


def _serve_session(
    req: dict[str, Any], link: Link | None = None, turns: TurnThread | None = None
) -> int:
    """Become the session's worker, then serve it until told to stop."""
    os.umask(0o077)
    _apply_rlimits(req.get("rlimits") or {})
    workspace = Path(req["workspace"])
    home = Path(req["home"])
    for d in (workspace, home):
        _make_dir(d)
    if req.get("tmp"):
        _fresh_tmp(Path(req["tmp"]))
    os.chdir(workspace)
    # Exactly the session's environment, changing only what differs from
    # the zygote's (most of it is the same base): every key touched is
    # pages copied from the zygote.
    env: dict[str, str] = req["env"]
    for name in [n for n in os.environ if n not in env]:
        del os.environ[name]
    for name, value in env.items():
        if os.environ.get(name) != value:
            os.environ[name] = value
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _set_title(req["title"])
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format=LOG_FORMAT)
    # A hung worker gets SIGABRT before SIGKILL: dump every thread's stack to
    # the session log so the operator can see where it hung.
    faulthandler.enable(file=sys.stderr, all_threads=True)
    log.info("worker start session=%s pid=%d runtime=%s", req["key"], os.getpid(), req["runtime"])

    info = runtime_mod.SessionInfo(
        key=req["key"],
        workspace=workspace,
        home=home,
        options=dict(req.get("options") or {}),
        config=dict(req.get("runtime_config") or {}),
    )
    try:
        agent = runtime_mod.load(req["runtime"], info)
    except runtime_mod.RuntimeLoadError as exc:
        log.error("runtime load failed: %s", exc)
        traceback.print_exc()
        return WorkerExit.RUNTIME_LOAD_FAILED
    return WorkerLoop(req, agent, link, turns).run()


def _make_dir(path: Path) -> None:
    """mkdir -p, tolerating the supervisor's rename of a spare session
    directory into place meanwhile: a rename may replace the (empty) parent
    we just made, and a mkdir inside the replaced one fails with ENOENT.
    Trying again finds the renamed directory."""
    for attempt in range(3):
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            return
        except FileNotFoundError:
            if attempt == 2:
                raise


def _fresh_tmp(path: Path) -> None:
    """The session's own temporary directory, emptied: what an earlier
    worker of the session left there (it exits with os._exit, so programs'
    own clean-up never runs) goes, and nothing is ever written to the
    shared /tmp. `tempfile` may have cached the zygote's choice: forget it."""
    if path.exists() and any(path.iterdir()):
        shutil.rmtree(path, ignore_errors=True)
    _make_dir(path)
    tempfile.tempdir = str(path)


RLIMITS = {"nofile": resource.RLIMIT_NOFILE, "cpu": resource.RLIMIT_CPU, "as": resource.RLIMIT_AS}


def _apply_rlimits(limits: dict[str, int]) -> None:
    """Lower this worker's rlimits (inherited by everything it starts)."""
    for name, value in limits.items():
        which = RLIMITS[name]
        _soft, hard = resource.getrlimit(which)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        # CPU: the soft limit sends SIGXCPU (a named death); the hard one, a
        # second later, SIGKILL if SIGXCPU was caught.
        new_hard = value + 1 if which == resource.RLIMIT_CPU else value
        if hard != resource.RLIM_INFINITY:
            new_hard = min(new_hard, hard)
        resource.setrlimit(which, (value, new_hard))


# Made once in the zygote by `prepare`, and shared by every worker: text
# streams on fds 1 and 2 (a worker points the fds themselves at its pipe).
_STREAMS: tuple[Any, Any] | None = None
LOG_FORMAT = "%(asctime)s %(levelname)s %(message)s"


def prepare() -> None:
    """Run in the zygote before it freezes its heap: make what every worker
    would make first thing, and run the worker's message and logging code
    once, warm. A worker then finds these made, instead of creating them in
    pages it shares with the zygote: each first write to such a page is a
    copy-on-write fault, about 5 us here, and a worker took about a
    thousand between its fork and its first reply."""
    global _STREAMS
    _STREAMS = (
        open(1, "w", buffering=1, closefd=False),  # noqa: SIM115
        open(2, "w", buffering=1, closefd=False),  # noqa: SIM115
    )
    logging.basicConfig(level=logging.INFO, stream=_STREAMS[1], format=LOG_FORMAT)
    formatter = logging.Formatter(LOG_FORMAT)
    warm_log = logging.getLogger("hermes_sup.warm-up")
    warm_log.propagate = False
    warm_log.addHandler(logging.NullHandler())
    key = bytes(32)
    for _ in range(16):  # past the interpreter's warm-up of each function
        for msg in (
            Message(Kind.HELLO, {"pid": 1}, session="k"),
            Message(Kind.TURN, {"text": "x"}, session="k"),
            Message(Kind.REPLY, {"text": "x", "ok": True, "data": {}}, session="k", re="r"),
            Message(Kind.EVENT, {"type": "token", "data": "x"}, session="k", re="r"),
            Message(Kind.HEARTBEAT, {"busy": False}, session="k"),
        ):
            decode(encode(msg, key), key)
        record = logging.LogRecord("w", logging.INFO, __file__, 0, "start %s %d", ("k", 1), None)
        formatter.format(record)
        warm_log.info("start %s %d", "k", 1)


def _redirect_output(fd: int) -> None:
    """stdin from /dev/null; stdout and stderr into the pipe to the supervisor,
    which writes the session log."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.close(null)
    if _STREAMS is not None:
        sys.stdout, sys.stderr = _STREAMS
    else:
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115


def _warm_up(token: bytes) -> None:
    """In a spare, before any session: run once what a session's start runs
    that does not depend on the session. Each first write to a page shared
    with the zygote is a copy-on-write fault (about 5 us here); taken now,
    they are not on a new session's way to its first reply."""
    faulthandler.enable(file=sys.stderr, all_threads=True)
    request = {"key": "k", "env": {"K": "v"}, "rlimits": {}, "options": {}, "turn": None}
    for msg in (
        Message(Kind.ASSIGN, {"request": request}),
        Message(Kind.HELLO, {"pid": 1}, session="k"),
        Message(Kind.REPLY, {"text": "x", "ok": True, "data": {}}, session="k", re="r"),
    ):
        decode(encode(msg, token), token)
    Path(os.getcwd()).is_dir()
    record = logging.LogRecord("w", logging.INFO, __file__, 0, "start %s %d", ("k", 1), None)
    for handler in logging.getLogger().handlers:
        handler.format(record)
