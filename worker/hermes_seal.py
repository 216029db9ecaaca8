"""Hermes in sealed mode: imported once in the zygote, replayed in each worker.

Importing hermes-agent captures HERMES_HOME, HOME and the working directory
in module globals, and does a few things with what is under them (loads
`.env`, bridges config.yaml into os.environ, creates the home's skeleton,
remembers which homes it has done so for). So outside sealed mode the
zygote may not import hermes: every session would share the zygote's home.

In sealed mode it may. The zygote imports hermes under fixed paths P
(HERMES_HOME), W (workspace) and U (HOME), and each worker, in its own
mount namespace, finds its own session's directories bind-mounted over
exactly those paths (worker/seal.py). Every path hermes captured is then
the session's own by construction; only what hermes *did* at import with
the contents under those paths is the zygote's, and must be done again for
the session's contents. That is `replay`:

- the memos keyed by path that say "already done for P" are cleared, by
  name. Never generically: `tools.file_operations.WRITE_DENIED_PATHS` is
  a set keyed by P's paths too, and it is a security deny-list;
- the home skeleton is made (`ensure_hermes_home`);
- the session's `.env` is loaded, as `run_agent` and `gateway.run` load it
  at import;
- `gateway.run`'s import-time statements that read the home (its `.env`,
  its config.yaml bridged into TERMINAL_*, HERMES_* variables, the
  terminal cwd) are run again, from hermes's own source, in its module;
- the globals computed from the environment at import (approvals' frozen
  YOLO mode, secret redaction, terminal limits) are computed again from the
  session's;
- plugins are discovered again if the session's home or config names any;
- the variables the import set in the zygote's os.environ (the worker's
  environment is replaced by the session's, so they are gone) are set
  again;
- Hermes's pre-exec scanner (tirith) is switched off where it is not
  installed and the session left it to Hermes, which would otherwise try
  to download it through a network the worker does not have.

`preload` also runs, once, what every session's first agent would run
and that depends on nothing of the session: the CA bundle check
(after which workers skip it, `HERMES_SKIP_SSL_GUARD=1`, unless the
session names a CA bundle of its own), the environment probe, and the
SSL contexts an agent's clients make (each parses the whole CA bundle:
see `_SSLPool`), and a model turn's streaming through the openai client,
from a canned reply (`_warm_model_client`).

A new hermes-agent version needs this re-checked (the replay refuses to
run when the statements it re-runs are not where it expects them).
"""

from __future__ import annotations

import ast
import importlib
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("hermes_sup.worker.hermes_seal")

# What the Hermes runtime imports first (worker/hermes.py): hermes must load.
BASE_MODULES = (
    "gateway.run",
    "run_agent",
    "hermes_state",
    "model_tools",
    "tools.terminal_tool",
    "tools.approval",
)
# The modules a first turn of a Hermes session loads, recorded from a real
# worker (python -m bench.sealed --record-modules); one name a line.
MODULES_FILE = Path(__file__).with_name("hermes_modules.txt")

# The memos hermes-agent 0.19 fills at import, keyed by a path under P, that
# mean "already done for this path". After the bind mount the same path holds
# another session's files, so each is cleared. Named one by one on purpose.
PATH_MEMOS = (
    ("hermes_cli.config", "_HERMES_HOME_ENSURED"),  # home skeleton made
    ("hermes_cli.config", "_LAST_EXPANDED_CONFIG_BY_PATH"),  # last good config
    ("hermes_cli.config", "_LOAD_CONFIG_CACHE"),  # parsed config.yaml by stat
    ("hermes_cli.config", "_RAW_CONFIG_CACHE"),  # raw config.yaml by stat
    ("hermes_cli.env_loader", "_APPLIED_HOMES"),  # secret sources pulled
    ("hermes_cli.env_loader", "_SECRET_SOURCES"),  # where those secrets came from
)
# Variables naming a CA bundle: hermes's SSL guard checks each that is set.
CA_BUNDLE_VARS = ("HERMES_CA_BUNDLE", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")
SKIP_SSL_GUARD = "HERMES_SKIP_SSL_GUARD"
# Files in P that would make the zygote's import read values every session
# would then inherit: P must be the bare skeleton.
UNSHARED_FILES = (".env", "config.yaml", ".op.env")


class SealedPathsLike(Protocol):
    """The fixed paths (hermes_sup.seal.paths.SealedPaths)."""

    @property
    def home(self) -> Path: ...

    @property
    def workspace(self) -> Path: ...

    @property
    def user(self) -> Path: ...


class SealError(RuntimeError):
    """Hermes cannot be preloaded or replayed as sealed mode needs."""


@dataclass
class Preloaded:
    """What `preload` did, kept in the zygote and inherited by workers."""

    paths: tuple[str, str, str] = ("", "", "")
    modules: int = 0
    recorded: int = 0  # names in the recorded list (MODULES_FILE)
    missing: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    # Variables the import and warm-ups changed: name -> value (None: removed).
    env: dict[str, str | None] = field(default_factory=dict)
    # Sets of CA bundle variables the zygote checked good (None: unset).
    ca_checked: list[dict[str, str | None]] = field(default_factory=list)
    warm_ups: dict[str, str] = field(default_factory=dict)


_PRELOADED: Preloaded | None = None
# The fixed paths this process put itself under before importing hermes.
_ENTERED: tuple[str, str, str] | None = None


def preloaded() -> Preloaded | None:
    """What this process's `preload` did, if it ran."""
    return _PRELOADED


def recorded_modules(path: Path = MODULES_FILE) -> list[str]:
    """The recorded module list (comments and blank lines skipped)."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    return [s for s in (line.strip() for line in lines) if s and not s.startswith("#")]


# Top-level packages of hermes-agent that capture paths at import.
HERMES_PACKAGES = ("run_agent", "hermes_constants", "hermes_cli", "hermes_state", "gateway")


def _enter_paths(paths: SealedPathsLike) -> tuple[str, str, str]:
    """Put this process under exactly the fixed paths (HERMES_HOME=P,
    TERMINAL_CWD=W, HOME=U, cwd W), so that what hermes captures at import
    is what each worker finds its own session at. Refuses if hermes was
    imported already (under other paths), or if P holds files every
    session would inherit."""
    for name in UNSHARED_FILES:
        if (Path(paths.home) / name).exists():
            raise SealError(
                f"{Path(paths.home) / name} exists: the zygote would load it into every "
                "session; the sealed home must hold only what hermes makes there"
            )
    early = [name for name in HERMES_PACKAGES if name in sys.modules]
    if early:
        raise SealError(
            f"{', '.join(early)} imported before the sealed preload, under other paths "
            "than the fixed ones: do not --preload hermes's own modules"
        )
    os.environ["HERMES_HOME"] = str(paths.home)
    os.environ["TERMINAL_CWD"] = str(paths.workspace)
    os.environ["HOME"] = str(paths.user)
    os.chdir(paths.workspace)
    return str(paths.home), str(paths.workspace), str(paths.user)


# How often a preload in progress reports how far it is (seconds).
PROGRESS_EVERY = 2.0


def preload(
    paths: SealedPathsLike, progress: Callable[[int, int], None] | None = None
) -> Preloaded:
    """In the zygote, before gc.freeze: move under the fixed paths, import
    hermes and the modules a first turn loads, and run the warm-ups. Raises
    SealError if hermes itself cannot be imported; a recorded module that
    is missing is only noted. `progress(done, of)` hears how many of the
    recorded modules are done, at the start, every PROGRESS_EVERY seconds
    and at the end (seconds on a quiet machine, minutes on a loaded one)."""
    global _PRELOADED, _ENTERED
    started = time.perf_counter()
    done = Preloaded(paths=_enter_paths(paths))
    # From here hermes is imported under the fixed paths, even if the
    # preload stops half way: a worker may replay what got imported.
    _ENTERED = done.paths
    before = dict(os.environ)
    # TERMINAL_CWD is W here and in every worker: not a deprecated .env's.
    from .hermes_warnings import quiet_own_terminal_cwd

    quiet_own_terminal_cwd()
    for name in BASE_MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:
            raise SealError(f"cannot import {name}: {type(exc).__name__}: {exc}") from exc
    parent = os.getppid()
    recorded = recorded_modules()
    done.recorded = len(recorded)
    said = time.perf_counter()
    if progress is not None:
        progress(0, len(recorded))
    for index, name in enumerate(recorded):
        if progress is not None and time.perf_counter() - said >= PROGRESS_EVERY:
            said = time.perf_counter()
            progress(index, len(recorded))
        if name in sys.modules:
            continue
        if os.getppid() != parent:  # the supervisor is gone: stop, do not make it wait
            raise SealError("the zygote's parent went away during the preload")
        try:
            importlib.import_module(name)
        except BaseException as exc:  # a module may exit or need what is absent
            done.missing[name] = f"{type(exc).__name__}: {exc}"
    if progress is not None:
        progress(len(recorded), len(recorded))
    done.ca_checked = _check_ca_bundle(done.warm_ups)
    _probe_environment(done.warm_ups)
    if os.environ.get(SSL_POOL_ENV, "1") != "0":
        _pool_ssl_contexts(done.ca_checked, done.warm_ups)
    _gateway_statements()  # compiled once, shared by every worker
    _warm_model_client(done.warm_ups)
    _check_left_behind(done.paths)
    after = dict(os.environ)
    done.env = {
        k: after.get(k) for k in before.keys() | after.keys() if before.get(k) != after.get(k)
    }
    done.env.pop(SKIP_SSL_GUARD, None)  # decided per session, in replay
    done.modules = len(sys.modules)
    done.seconds = time.perf_counter() - started
    _PRELOADED = done
    log.info(
        "hermes preloaded under %s: %d modules in %.1fs, %d recorded ones missing; %s",
        done.paths[0],
        done.modules,
        done.seconds,
        len(done.missing),
        "; ".join(f"{k}: {v}" for k, v in done.warm_ups.items()),
    )
    return done


def _check_left_behind(paths: tuple[str, str, str]) -> None:
    """The zygote forks sealed workers: it must hold no thread (unshare
    refuses a threaded process) and no open file under P, W or U (a worker
    would inherit the zygote's, not see its session's)."""
    import threading

    others = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
    if others:
        raise SealError(f"preloading hermes left threads running: {', '.join(others)}")
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the listing's own fd, closed since
        if any(target == p or target.startswith(p + "/") for p in paths):
            raise SealError(f"preloading hermes left {target} open (fd {fd})")


def _check_ca_bundle(notes: dict[str, str]) -> list[dict[str, str | None]]:
    """Hermes's SSL guard, once (each AIAgent otherwise parses the CA bundle
    again), for the zygote's CA variables and for a session that sets none
    (gateway.run then points SSL_CERT_FILE at the system's bundle, which is
    what the supervisor's default environment gives a worker). Returns the
    CA variable sets it found good; a session whose set is among them skips
    the guard."""
    from agent.ssl_guard import verify_ca_bundle

    good: list[dict[str, str | None]] = []
    saved = {name: os.environ.get(name) for name in CA_BUNDLE_VARS}
    try:
        for label in ("zygote", "none set"):
            if label == "none set":
                for name in CA_BUNDLE_VARS:
                    os.environ.pop(name, None)
                gateway_run = sys.modules.get("gateway.run")
                if gateway_run is not None:
                    gateway_run._ensure_ssl_certs()
            state = {name: os.environ.get(name) for name in CA_BUNDLE_VARS}
            try:
                verify_ca_bundle()
            except Exception as exc:
                notes[f"ssl_guard ({label})"] = f"failed: {type(exc).__name__}: {exc}"
                continue
            notes[f"ssl_guard ({label})"] = "checked"
            good.append(state)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return good


SSL_POOL_ENV = "HERMES_SUP_SSL_POOL"
# Contexts made ahead per CA file: building an AIAgent makes two (each
# parses the whole bundle, about 65 ms here), a turn's clients a few more.
SSL_POOL_SIZE = 4


class _SSLPool:
    """`ssl.create_default_context` with contexts made ahead in the zygote.

    Each worker's first calls for a CA file the zygote knows get a context
    made there, never used before in this process (each worker has its own
    copy-on-write copies); any other call, and any call once the pool is
    used up, makes one as before. The contexts hold the CA bundle as it was
    when the zygote started: restart the service after updating the CA
    certificates (as any long-running process needs). Off with
    HERMES_SUP_SSL_POOL=0."""

    def __init__(self, original: Any) -> None:
        self.original = original
        self.ready: dict[str, list[Any]] = {}

    def fill(self, cafile: str, count: int) -> None:
        self.ready[cafile] = [self.original(cafile=cafile) for _ in range(count)]

    def __call__(
        self, purpose: Any = None, *, cafile: Any = None, capath: Any = None, cadata: Any = None
    ) -> Any:
        import ssl

        if purpose is None:
            purpose = ssl.Purpose.SERVER_AUTH
        if purpose == ssl.Purpose.SERVER_AUTH and capath is None and cadata is None:
            ready = self.ready.get(os.fspath(cafile)) if cafile is not None else None
            if ready:
                try:
                    return ready.pop()
                except IndexError:  # another thread took the last one
                    pass
        return self.original(purpose, cafile=cafile, capath=capath, cadata=cadata)


def _pool_ssl_contexts(checked: list[dict[str, str | None]], notes: dict[str, str]) -> None:
    """Make SSL contexts ahead for the CA files sessions will load: those of
    the CA variable sets the guard found good, and certifi's (httpx's
    default)."""
    import ssl

    files: set[str] = set()
    for state in checked:
        files.update(v for v in state.values() if v and os.path.isfile(v))
    try:
        import certifi

        files.add(certifi.where())
    except ImportError:
        pass
    original = ssl.create_default_context
    pool = original if isinstance(original, _SSLPool) else _SSLPool(original)
    try:
        for cafile in sorted(files):
            pool.fill(cafile, SSL_POOL_SIZE)
    except (OSError, ssl.SSLError) as exc:
        notes["ssl_pool"] = f"not made: {type(exc).__name__}: {exc}"
        return
    ssl.create_default_context = pool
    notes["ssl_pool"] = f"{SSL_POOL_SIZE} contexts for each of {', '.join(sorted(files))}"


# The canned model the warm-up streams from: a `terminal` tool call, then
# once the tool's result is in the conversation, a short text reply.
_WARM_TOOL = {
    "type": "function",
    "function": {
        "name": "terminal",
        "description": "run a command",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    },
}
WARM_ROUNDS = 3  # past the interpreter's warm-up of each function a turn runs


def _warm_chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "warm-up",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "warm-up",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def _warm_model_client(notes: dict[str, str]) -> None:
    """Stream a tool-call turn and its answer through the openai client
    (httpx, pydantic, the SSE decoder), from a canned reply in this process:
    no network, no thread, no file, nothing of Hermes. Code run once before
    the fork is specialised and its lazily made objects (validators, compiled
    patterns, type caches) exist, in pages every worker shares; run first in
    each worker's turn instead, it writes to those pages, and each write is
    a page copied for that worker (bench/worker_pages.py: 2-3 MiB of a live
    worker). Only libraries that capture nothing per session run here."""
    import json

    try:
        import httpx
        import openai
    except ImportError as exc:
        notes["model_client"] = f"not warmed: {exc}"
        return
    call = [
        _warm_chunk(
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "warm-up",
                        "type": "function",
                        "function": {"name": "terminal", "arguments": ""},
                    }
                ],
            }
        ),
        _warm_chunk(
            {"tool_calls": [{"index": 0, "function": {"arguments": '{"command": "true"}'}}]}
        ),
        _warm_chunk({}, "tool_calls"),
    ]
    answer = [_warm_chunk({"role": "assistant", "content": "warm"}), _warm_chunk({}, "stop")]

    def canned(request: httpx.Request) -> httpx.Response:
        messages = json.loads(request.content).get("messages", [])
        chunks = answer if any(m.get("role") == "tool" for m in messages) else call
        body = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
        return httpx.Response(
            200, content=body + b"data: [DONE]\n\n", headers={"content-type": "text/event-stream"}
        )

    try:
        for _ in range(WARM_ROUNDS):
            with openai.OpenAI(
                api_key="warm-up",
                base_url="http://warm-up.invalid/v1",
                http_client=httpx.Client(transport=httpx.MockTransport(canned)),
            ) as client:
                messages: list[dict[str, Any]] = [{"role": "user", "content": "warm-up"}]
                # Plain dicts, as Hermes sends them (not the SDK's TypedDicts).
                create: Any = client.chat.completions.create
                for _reply in range(2):
                    stream = create(
                        model="warm-up", messages=messages, tools=[_WARM_TOOL], stream=True
                    )
                    for chunk in stream:
                        chunk.model_dump()
                    messages.append({"role": "tool", "tool_call_id": "warm-up", "content": "{}"})
    except Exception as exc:  # a client version this does not fit: workers pay as before
        notes["model_client"] = f"not warmed: {type(exc).__name__}: {exc}"
        return
    notes["model_client"] = "warmed"


# Hermes's pre-exec scanner: where it is not installed, Hermes downloads it
# from GitHub at a session's first command. A sealed worker's only way out is
# the supervisor's proxy, so that attempt can only fail, and each session
# logs it. Settings (Hermes's own, tools/tirith_security.py) that name a
# scanner or say what to do without one are the session's to keep.
TIRITH_SETTINGS = ("TIRITH_ENABLED", "TIRITH_BIN")


def _no_tirith_download() -> None:
    """Switch Hermes's scanner off in this sealed worker (TIRITH_ENABLED=0,
    Hermes's own setting) when it is not installed where Hermes looks first
    (on PATH, or in the home's bin/) and nothing of the session chose
    otherwise: no TIRITH_* variable, no `security.tirith_path` of its own,
    and `security.tirith_fail_open` not false (a session that wants commands
    blocked without a scanner keeps Hermes's behaviour, download try and
    all). Hermes allows every command a missing scanner cannot check
    (fail-open, its default): so does this, without the try."""
    if any(name in os.environ for name in TIRITH_SETTINGS):
        return
    from hermes_cli.config import load_config

    try:
        security = load_config().get("security") or {}
    except Exception:
        return  # a config Hermes cannot read: Hermes will say so itself
    if not isinstance(security, dict) or security.get("tirith_enabled") is False:
        return
    if security.get("tirith_path", "tirith") != "tirith":
        return  # an explicit path: Hermes never downloads over it
    if security.get("tirith_fail_open", True) is False:
        return
    if shutil.which("tirith") or os.access(
        Path(os.environ["HERMES_HOME"]) / "bin" / "tirith", os.X_OK
    ):
        return
    os.environ["TIRITH_ENABLED"] = "0"


def _probe_environment(notes: dict[str, str]) -> None:
    """Hermes's environment probe (the python/pip line of the system prompt),
    once, in this thread: the zygote must never start a thread."""
    try:
        from tools import env_probe

        env_probe._probe_worker(env_probe._PROBE_GEN)
        notes["env_probe"] = "done" if env_probe._PROBE_DONE.is_set() else "not done"
    except Exception as exc:
        notes["env_probe"] = f"failed, left to each session: {type(exc).__name__}: {exc}"


def replay(paths: SealedPathsLike, template: str | os.PathLike[str] | None = None) -> None:
    """In the worker, after its mounts and environment are set and before
    the runtime loads: redo what hermes's import did with the contents of
    P, now the session's. Raises SealError when it cannot; the worker must
    then not run hermes.

    `template`: the Hermes runtime's `template_home`. A new session's home
    starts as a copy of it, and without preloading that copy comes before
    hermes's import reads the home; given, it comes before the replay too.
    (Not given, the runtime copies it after the replay: hermes-agent 0.19
    loads the `.env` and bridges config.yaml again when it resolves the
    agent's settings, so a new session's first worker still sees them,
    tested; what only the import reads would be missed.)"""
    home = Path(paths.home)
    if os.environ.get("HERMES_HOME") != str(home):
        raise SealError(f"replay needs HERMES_HOME={home}, found {os.environ.get('HERMES_HOME')!r}")
    imported = [name for name in HERMES_PACKAGES if name in sys.modules]
    if not imported:
        return  # hermes was not preloaded: its own import does all of this
    wanted = (str(paths.home), str(paths.workspace), str(paths.user))
    if _ENTERED != wanted:
        # Imported in the zygote some other way (an operator's --preload of
        # run_agent before the sealed preload): what it captured is the
        # zygote's own home, which no mount makes the session's.
        raise SealError(
            f"{', '.join(imported)} were imported in the zygote outside the sealed preload "
            f"under {wanted[0]}: their paths are not this session's"
        )
    if template and not (home / "config.yaml").exists():
        # As the Hermes runtime does it (worker/hermes.py), which then finds
        # config.yaml there and copies nothing more.
        shutil.copytree(template, home, dirs_exist_ok=True, symlinks=True)
    _clear_memos()
    from hermes_cli.config import ensure_hermes_home

    ensure_hermes_home()
    _replay_import_env()
    from hermes_cli.env_loader import load_hermes_dotenv

    _replay_gateway_run()
    _refreeze_env_globals()
    _replay_plugins(home, Path(paths.workspace))
    run_agent = sys.modules["run_agent"]
    load_hermes_dotenv(hermes_home=home, project_env=Path(run_agent.__file__ or "").parent / ".env")
    _skip_ssl_guard_if_checked()
    _no_tirith_download()


def _yolo() -> bool:
    from utils import is_truthy_value

    return bool(is_truthy_value(os.getenv("HERMES_YOLO_MODE", "")))


def _redact() -> bool:
    return os.getenv("HERMES_REDACT_SECRETS", "true").lower() in {"1", "true", "yes", "on"}


def _terminal_env(name: str, default: Any, kind: type, label: str) -> Any:
    parse = sys.modules["tools.terminal_tool"]._safe_parse_import_env
    return parse(name, default, kind, label)


# Module globals hermes-agent 0.19 computes from os.environ at import, each
# recomputed as its module computes it, from the session's environment (its
# own, its .env and its config.yaml bridged): else the zygote's values would
# hold for every session. _YOLO_MODE_FROZEN above all: a zygote started with
# HERMES_YOLO_MODE=1 would switch approvals off in every session.
ENV_GLOBALS: tuple[tuple[str, str, Any], ...] = (
    ("tools.approval", "_YOLO_MODE_FROZEN", _yolo),
    ("agent.redact", "_REDACT_ENABLED", _redact),
    (
        "tools.terminal_tool",
        "FOREGROUND_MAX_TIMEOUT",
        lambda: _terminal_env("TERMINAL_MAX_FOREGROUND_TIMEOUT", 600, int, "integer"),
    ),
    (
        "tools.terminal_tool",
        "DISK_USAGE_WARNING_THRESHOLD_GB",
        lambda: _terminal_env("TERMINAL_DISK_WARNING_GB", 500.0, float, "number"),
    ),
)


def _refreeze_env_globals() -> None:
    for module_name, attr, compute in ENV_GLOBALS:
        module = sys.modules.get(module_name)
        if module is None:
            continue
        if not hasattr(module, attr):
            raise SealError(f"{module_name}.{attr} is gone: re-check the replay for this hermes")
        setattr(module, attr, compute())


def _replay_plugins(home: Path, workspace: Path) -> None:
    """model_tools discovered plugins at import from P's (empty) home and
    default config. Discover again, for this session, if its home or
    config can name others (about 80 ms, so only then)."""
    config = home / "config.yaml"
    named = (home / "plugins").is_dir() and any((home / "plugins").iterdir())
    if not named and config.is_file():
        named = any(line.startswith("plugins:") for line in config.read_text().splitlines())
    if not named and os.environ.get("HERMES_ENABLE_PROJECT_PLUGINS"):
        named = (workspace / ".hermes" / "plugins").is_dir()
    if named and "hermes_cli.plugins" in sys.modules:
        sys.modules["hermes_cli.plugins"].discover_plugins(force=True)


def _clear_memos() -> None:
    for module_name, attr in PATH_MEMOS:
        module = sys.modules.get(module_name)
        if module is None:
            continue
        memo = getattr(module, attr, None)
        if memo is None:
            raise SealError(f"{module_name}.{attr} is gone: re-check the replay for this hermes")
        memo.clear()


def _replay_import_env() -> None:
    """The variables the zygote's import set (HERMES_QUIET, ...), which the
    worker's own environment replaced."""
    done = _PRELOADED
    if done is None:
        return
    for name, value in done.env.items():
        if value is None:
            os.environ.pop(name, None)
        elif name not in os.environ:
            os.environ[name] = value


def _skip_ssl_guard_if_checked() -> None:
    """Skip hermes's CA bundle check in this worker if the zygote checked
    the very bundles this session uses."""
    done = _PRELOADED
    if done is None:
        return
    used = {name: os.environ.get(name) for name in CA_BUNDLE_VARS}
    if used in done.ca_checked:
        os.environ[SKIP_SSL_GUARD] = "1"


# The first and last of gateway.run's import-time statements that read
# HERMES_HOME or the environment it loads (hermes-agent 0.19).
_GATEWAY_FIRST = 'os.environ["_HERMES_GATEWAY"] = "1"'
_GATEWAY_LAST_NAME = "_configured_cwd"
_gateway_code: Any = None


def _gateway_statements() -> Any:
    """gateway.run's import-time statements from its `.env` load to its
    terminal cwd, compiled from its own source (once, cached: the zygote
    may compile it in preload so workers share it)."""
    global _gateway_code
    if _gateway_code is not None:
        return _gateway_code
    module = sys.modules["gateway.run"]
    source = Path(module.__file__ or "").read_text(encoding="utf-8")
    lines = source.splitlines()
    body: list[ast.stmt] = []
    started = False
    for node in ast.parse(source).body:
        first = lines[node.lineno - 1].strip() if node.lineno == node.end_lineno else ""
        if not started:
            started = first == _GATEWAY_FIRST
            if not started:
                continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if first.startswith("sys.path.insert"):
            continue
        body.append(node)
        if isinstance(node, ast.If) and _GATEWAY_LAST_NAME in ast.unparse(node.test):
            break
    else:
        raise SealError(
            "gateway.run's import-time home statements are not where hermes-agent 0.19 has "
            "them: re-check the replay for this hermes version"
        )
    _gateway_code = compile(ast.Module(body=body, type_ignores=[]), module.__file__ or "", "exec")
    return _gateway_code


def _replay_gateway_run() -> None:
    module = sys.modules.get("gateway.run")
    if module is None:
        return
    exec(_gateway_statements(), module.__dict__)
