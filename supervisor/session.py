"""One session as the supervisor sees it: its data, its worker, its queue of turns."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hermes_sup.protocol import RemoteProtocolError, check_session_key, session_dir_name

from .config import Settings
from .environment import SessionOptions, parse_options
from .leases import Lease
from .logs import PipeReader, SessionLog
from .process import WorkerProcess
from .states import Event, Sleep, State, Stop, listed_state, next_sleep, next_state

SESSION_FILE = "session.json"
LOG_FILE = "worker.log"


@dataclass
class Turn:
    """A message waiting for, or running in, a session's worker."""

    id: str  # the client's request id; events and the reply cite it
    client: bytes  # the client's routing id (a resend may move it)
    text: str
    # What the front end sent with the text for the runtime (instructions,
    # conversation history, ...: see PROTOCOL.md), passed on as it is.
    context: dict[str, Any] | None = None
    queued_at: float = field(default_factory=time.monotonic)
    # Set when the supervisor gave up on the turn (timeout): its late answer
    # from the worker is dropped, the client already had an error.
    abandoned: bool = False
    started_at: float | None = None  # monotonic, when handed to the worker
    # Seconds its client may be gone before it is cancelled (orphans.py),
    # and since when it is (monotonic), if it is.
    orphan_grace: float | None = None
    orphaned_at: float | None = None


@dataclass
class Session:
    """A session key, its directory, and the worker serving it (if any)."""

    key: str
    dir: Path
    options: SessionOptions
    # The git repository whose worktree (on `branch`) is its workspace, if
    # any: fixed when the session is created (worktrees.py).
    repo: str | None = None
    branch: str | None = None
    state: State = State.EXITED
    proc: WorkerProcess | None = None
    hello_pid: int | None = None  # the pid its hello gave, until proc is known
    worker_id: bytes | None = None
    token: bytes | None = None
    generation: int = 0
    queue: deque[Turn] = field(default_factory=deque)
    current: Turn | None = None
    # The approval requests of the running turn still waiting for an answer,
    # oldest first, by the id the worker gave each ("" when its runtime gives
    # none): an answer goes to the oldest, and names it or no other.
    approvals: list[str] = field(default_factory=list)
    # A cancel for the first turn, which its worker (still starting) was
    # handed in the spawn request: sent once the worker says hello.
    cancel_on_hello: str | None = None
    # The runtime (name and config) its worker was started with.
    runtime_kind: str = ""
    # A new session's directory and session.json are written once its
    # first worker is asked for: the fork need not wait for the disk.
    unsaved: bool = False
    # The session's lease (leases.py), held from before its worker starts
    # until it is exited with nothing queued: None while another supervisor
    # may own it. `epoch_seen` is the last epoch we held it at (a taking by
    # another node in between means its session.json may have changed), and
    # `meta_dirty` a session.json to write once the lease is ours.
    lease: Lease | None = None
    epoch_seen: int = 0
    meta_dirty: bool = False
    # Asleep once its worker was stopped for idleness (health.py), not by
    # request: listed `hibernated` until its next worker starts (states.py).
    sleep: Sleep = Sleep.AWAKE
    # What the awake cap did to its background processes (health.py), for
    # `inspect`: None until it acted on this session.
    awake_capped: dict[str, Any] | None = None
    # Its bytes on disk at the last complete round of the disk sampler.
    disk_used: int | None = None
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None
    last_activity: float = field(default_factory=time.time)
    turns: int = 0
    exits: int = 0
    last_exit: str | None = None
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    # Monotonic clocks for the supervisor's own bookkeeping.
    spawned_mono: float = 0.0
    last_heartbeat: float = 0.0
    hang_signalled: bool = False
    # Fast failures in a row, and when a backed-off or failed session may run.
    fast_failures: int = 0
    retry_at: float = 0.0
    retry_timer: asyncio.TimerHandle | None = None
    # Why the supervisor itself ended the worker, if it did (overrides the
    # bare exit status in errors and `list`), and the code the turn gets.
    kill_reason: str | None = None
    kill_code: str | None = None
    # The settings its worker was started with: a reload changes new
    # sessions, not running ones (until they restart).
    settings: Settings | None = None
    # Output of the worker (stdout/stderr) and who follows it.
    log: SessionLog | None = None
    pipe: PipeReader | None = None
    log_followers: dict[str, bytes] = field(default_factory=dict)
    # Recent events (type, body) replayed to a new watcher, e.g. `attach`.
    history: deque[tuple[str, dict[str, Any]]] = field(default_factory=lambda: deque(maxlen=200))
    # (cpu seconds of the tree, monotonic time) at the last `list`, for CPU%.
    cpu_sample: tuple[float, float] | None = None

    @property
    def workspace(self) -> Path:
        """The worker's cwd and TERMINAL_CWD: the one chosen at open (under a
        workspace root), else the session's own."""
        if self.options.workspace is not None:
            return Path(self.options.workspace)
        return self.dir / "workspace"

    @property
    def home(self) -> Path:
        """The worker's HERMES_HOME."""
        return self.dir / "home"

    @property
    def user(self) -> Path:
        """The worker's HOME: the session's own, so that dotfiles
        (~/.gitconfig, ~/.cache, a memory provider's ~/.honcho) are never
        shared between sessions, nor the operator's used."""
        return self.dir / "user"

    @property
    def tmp(self) -> Path:
        """The worker's TMPDIR: its temporary files (Hermes's shell snapshot,
        a dump of the session's environment, among them) stay in its own
        data, never in the shared /tmp; emptied at each worker start and
        removed with the session."""
        return self.dir / "tmp"

    @property
    def log_path(self) -> Path:
        """Where the worker's stdout and stderr go."""
        return self.dir / LOG_FILE

    @property
    def pid(self) -> int | None:
        """The live worker's pid, if there is one."""
        if self.proc is None:
            # Its hello can be read before the zygote's answer that names it.
            return self.hello_pid
        if self.proc.returncode is not None:
            return None
        return self.proc.pid

    def advance(self, event: Event) -> State:
        """Apply one transition from the state table (and from its sleep
        table: a spawn wakes it)."""
        self.state = next_state(self.state, event)
        self.sleep = next_sleep(self.sleep, event)
        return self.state

    def stopping(self, why: Stop) -> None:
        """Note why its worker is about to be stopped: for idleness it
        sleeps once exited; by request it is exited, awake."""
        self.sleep = next_sleep(self.sleep, why)

    def touch(self) -> None:
        """Note activity (any message either way)."""
        self.last_activity = time.time()

    @property
    def listed_state(self) -> str:
        """Its state as `list` shows it (states.listed_state)."""
        return listed_state(self.state, self.sleep)

    def describe(self) -> dict[str, Any]:
        """The session as a `sessions` list entry."""
        return {
            "key": self.key,
            "state": self.listed_state,
            "pid": self.pid,
            "started": self.started_at,
            "last_activity": self.last_activity,
            "turns": self.turns,
            "queued": len(self.queue),
            "exits": self.exits,
            "last_exit": self.last_exit,
            "fast_failures": self.fast_failures,
            "label": self.options.label,
            "repo": self.repo,
            "branch": self.branch,
        }


@dataclass(frozen=True)
class StoredSession:
    """A session whose directory a previous run of the supervisor left: known
    by its session.json, shown as exited, without a worker or a `Session`
    until a request names it."""

    key: str
    created: float
    last_activity: float  # when its log (else its session.json) last changed
    runtime: str | None  # the runtime it chose, if it chose one
    label: str | None = None  # its label option, if it has one
    repo: str | None = None  # its repository and branch, if it works in a worktree
    branch: str | None = None

    def describe(self) -> dict[str, Any]:
        """The session as a `sessions` list entry, as `Session.describe` has it."""
        return {
            "key": self.key,
            "state": State.EXITED.value,
            "pid": None,
            "started": None,
            "last_activity": self.last_activity,
            "turns": 0,
            "queued": 0,
            "exits": 0,
            "last_exit": None,
            "fast_failures": 0,
            "label": self.label,
            "repo": self.repo,
            "branch": self.branch,
        }


def sessions_dir(data_dir: Path) -> Path:
    """Where every session's directory is."""
    return data_dir / "sessions"


def session_path(data_dir: Path, key: str) -> Path:
    """Where a session's directory is (or will be)."""
    return sessions_dir(data_dir) / session_dir_name(key)


def stored_options(stored: dict[str, Any] | None, key: str, path: Path) -> SessionOptions | None:
    """The options in a session.json's content, if it has usable ones; one
    that names another key is refused (RuntimeError)."""
    if stored is None:
        return None
    if stored.get("key") != key:
        raise RuntimeError(
            f"{path / SESSION_FILE} belongs to key {stored.get('key')!r}, not {key!r}"
        )
    try:
        return parse_options(stored.get("options"))
    except Exception:
        return None


def stored_worktree(stored: dict[str, Any] | None) -> dict[str, str | None]:
    """The repository and branch a session.json names (both, or neither)."""
    if stored is None:
        return {"repo": None, "branch": None}
    repo, branch = stored.get("repo"), stored.get("branch")
    if isinstance(repo, str) and isinstance(branch, str) and repo and branch:
        return {"repo": repo, "branch": branch}
    return {"repo": None, "branch": None}


def save_session_meta(session: Session) -> None:
    """Record the key and options next to the session's data (atomically)."""
    meta = session.dir / SESSION_FILE
    tmp = meta.with_suffix(".tmp")
    data: dict[str, Any] = {
        "key": session.key,
        "options": session.options.to_wire(),
        "created": session.created_at,
    }
    if session.repo is not None:
        data.update(repo=session.repo, branch=session.branch)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, meta)
    except OSError:
        tmp.unlink(missing_ok=True)  # a full disk leaves the old file, not a partial one
        raise


def read_session_meta(path: Path | str) -> dict[str, Any] | None:
    """What a session directory's session.json holds (key, options,
    created), or None if it has none that can be read."""
    # os.open and one read on a str path: a third of what open() and Path
    # cost, which counts when every session on disk is read at start.
    try:
        fd = os.open(os.path.join(path, SESSION_FILE), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data = b""
        while chunk := os.read(fd, 65536):
            data += chunk
        stored = json.loads(data)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return stored if isinstance(stored, dict) else None


def scan_sessions(data_dir: Path) -> tuple[dict[str, StoredSession], int]:
    """Every session directory under `data_dir` with a readable session.json
    whose key is the one its directory is named for, and how many other
    directories there were. One directory read and two file reads or stats
    per session, no parsing of options: it runs at every start."""
    found: dict[str, StoredSession] = {}
    skipped = 0
    try:
        entries = list(os.scandir(sessions_dir(data_dir)))
    except FileNotFoundError:
        return found, 0
    for entry in entries:
        if not entry.is_dir(follow_symlinks=False):
            continue
        stored = read_session_meta(entry.path)
        key = None if stored is None else stored.get("key")
        try:
            check_session_key(key)
        except RemoteProtocolError:
            skipped += 1
            continue
        assert isinstance(key, str) and stored is not None
        if session_dir_name(key) != entry.name:
            skipped += 1  # copied or renamed by hand: not the key's directory
            continue
        created = stored.get("created")
        created = float(created) if isinstance(created, (int, float)) else 0.0
        options = stored.get("options")
        if not isinstance(options, dict):
            options = {}
        runtime, label = options.get("runtime"), options.get("label")
        try:
            changed = os.stat(os.path.join(entry.path, LOG_FILE)).st_mtime
        except OSError:
            changed = created
        found[key] = StoredSession(
            key=key,
            created=created,
            last_activity=changed,
            runtime=runtime if isinstance(runtime, str) else None,
            label=label if isinstance(label, str) and label.isprintable() else None,
            **stored_worktree(stored),
        )
    return found, skipped
