"""Hermes in sealed mode (worker/hermes_seal.py): preloaded in the zygote
under fixed paths, replayed in each worker for its own session's files.

The replay tests need no namespaces: a subprocess preloads hermes under
P, then P's contents are swapped for a session's (as the worker's bind
mount swaps them) and the replay must find the session's files, not what
the import saw. The audit runs real supervisors (`--agent hermes --sealed
on`, as root, with spares and unprivileged) against the fake model and
checks from outside what each session's worker and shell can reach."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hermes_sup.worker import hermes_seal

from .conftest import needs_hermes

pytestmark = [
    needs_hermes,
    # Each test but the module list's imports Hermes, preloads it in a new
    # interpreter (seconds each) or starts a sealed supervisor.
    pytest.mark.slow,
]

# Preload under base/{home,workspace,user}; swap home for the session's
# (a .env, a config.yaml); set the worker's own environment; replay (unless
# told not to); report what hermes now sees.
SWAP_AND_REPLAY = r"""
import json, os, sys
from pathlib import Path
from types import SimpleNamespace
from hermes_sup.worker import hermes_seal

base, do_replay = Path(sys.argv[1]), sys.argv[2] == "replay"
template = sys.argv[3] if len(sys.argv) > 3 else None
paths = SimpleNamespace(home=base / "home", workspace=base / "workspace", user=base / "user")
for p in (paths.home, paths.workspace, paths.user):
    p.mkdir(parents=True)
os.environ.update(HERMES_HOME=str(paths.home), TERMINAL_CWD=str(paths.workspace),
                  HOME=str(paths.user), HERMES_YOLO_MODE="1", HERMES_REDACT_SECRETS="false")
os.chdir(paths.workspace)
reports = []
done = hermes_seal.preload(paths, lambda n, of: reports.append([n, of]))
from hermes_cli import config
config.load_config()  # the zygote's (empty) config, memoized under P's path

# The "bind mount": the session's own home now at P.
paths.home.rename(base / "zygote-home")
paths.home.mkdir()
if not template:
    (paths.home / ".env").write_text("SEALED_MARK=session-value\n")
    (paths.home / "config.yaml").write_text(
        "terminal:\n  timeout: 77\nmodel:\n  context_length: 4242\n")
session_env = {"PATH": os.environ["PATH"], "HERMES_HOME": str(paths.home),
               "TERMINAL_CWD": str(paths.workspace), "HOME": str(paths.user),
               "HERMES_SESSION_KEY": "k1"}
os.environ.clear()
os.environ.update(session_env)
if do_replay:
    hermes_seal.replay(paths, template)
from tools import approval, file_operations
from agent import redact
import certifi, ssl
made = [ssl.create_default_context(cafile=certifi.where())
        for _ in range(hermes_seal.SSL_POOL_SIZE + 2)]
print(json.dumps({
    "env": {k: os.environ.get(k) for k in ("SEALED_MARK", "TERMINAL_TIMEOUT", "HERMES_QUIET",
                                           "HERMES_EXEC_ASK", "_HERMES_GATEWAY",
                                           "HERMES_SKIP_SSL_GUARD")},
    "home": sorted(p.name for p in paths.home.iterdir()),
    "zygote_home": sorted(p.name for p in (base / "zygote-home").iterdir()),
    "context_length": config.load_config().get("model", {}).get("context_length"),
    "denied": sorted(file_operations.WRITE_DENIED_PATHS),
    "missing": sorted(done.missing),
    "threads": __import__("threading").active_count(),
    "ssl": {
        "distinct": len({id(c) for c in made}) == len(made),
        "verify": all(c.verify_mode == ssl.CERT_REQUIRED and c.check_hostname for c in made),
        "certs": min(len(c.get_ca_certs()) for c in made),
        "pooled": type(ssl.create_default_context).__name__,
    },
    "progress": reports,
    "yolo": approval._YOLO_MODE_FROZEN,
    "redact": redact._REDACT_ENABLED,
}))
"""


def swap_and_replay(base: Path, mode: str, template: Path | None = None) -> dict[str, Any]:
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            SWAP_AND_REPLAY,
            str(base),
            mode,
            *([str(template)] if template else []),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if not k.startswith(("HERMES_", "TERMINAL_"))},
    )
    assert proc.returncode == 0, proc.stderr
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "stderr": proc.stderr}


@pytest.fixture(scope="module")
def replayed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return swap_and_replay(tmp_path_factory.mktemp("sealed") / "b", "replay")


def test_replay_loads_the_sessions_env_and_config_not_the_zygotes(replayed: dict[str, Any]) -> None:
    env = replayed["env"]
    assert env["SEALED_MARK"] == "session-value"  # the session's .env
    assert env["TERMINAL_TIMEOUT"] == "77"  # its config.yaml, bridged as gateway.run does
    assert replayed["context_length"] == 4242  # load_config reads the session's file
    # What the import set in the zygote's environment is set again.
    assert env["HERMES_QUIET"] == env["HERMES_EXEC_ASK"] == env["_HERMES_GATEWAY"] == "1"
    # The CA bundle was checked in the zygote for a session that names none.
    assert env["HERMES_SKIP_SSL_GUARD"] == "1"
    assert replayed["threads"] == 1


def test_the_preload_reports_how_far_it_is_in_the_recorded_list(
    replayed: dict[str, Any],
) -> None:
    recorded = len(hermes_seal.recorded_modules())
    progress = replayed["progress"]
    assert progress[0] == [0, recorded] and progress[-1] == [recorded, recorded]
    done = [n for n, _ in progress]
    assert done == sorted(done)


def test_terminal_cwd_set_by_us_is_not_called_a_deprecated_env_setting(
    replayed: dict[str, Any],
) -> None:
    """Preload and replay both run gateway.run's deprecation check, with
    TERMINAL_CWD the fixed workspace: Hermes must not take it for a .env's."""
    assert "TERMINAL_CWD" not in replayed["stderr"]
    assert "Deprecated .env settings" not in replayed["stderr"]


def test_replay_recomputes_what_the_import_froze_from_the_zygotes_env(
    replayed: dict[str, Any],
) -> None:
    """The zygote ran with HERMES_YOLO_MODE=1 and redaction off; the session
    has neither, so its approvals are on and its secrets redacted."""
    assert replayed["yolo"] is False
    assert replayed["redact"] is True


def test_ssl_contexts_made_ahead_are_each_fresh_and_verifying(replayed: dict[str, Any]) -> None:
    """Past the pool's size too: then they are made as before."""
    made = replayed["ssl"]
    assert made["pooled"] == "_SSLPool"
    assert made["distinct"] and made["verify"] and made["certs"] > 0


def test_a_new_sessions_home_is_its_template_before_the_replay_reads_it(tmp_path: Path) -> None:
    """A new session's home is empty until the template is copied: the
    template's .env and config must be what the replay loads."""
    template = tmp_path / "template"
    template.mkdir()
    (template / ".env").write_text("SEALED_MARK=session-value\n")
    (template / "config.yaml").write_text(
        "terminal:\n  timeout: 77\nmodel:\n  context_length: 4242\n"
    )
    seen = swap_and_replay(tmp_path / "b", "replay", template)
    assert seen["env"]["SEALED_MARK"] == "session-value"
    assert seen["env"]["TERMINAL_TIMEOUT"] == "77"
    assert {".env", "config.yaml", "SOUL.md"} <= set(seen["home"])


def test_replay_makes_the_sessions_home_skeleton(replayed: dict[str, Any]) -> None:
    for name in ("SOUL.md", "memories", "skills", "cron", "logs", "sessions"):
        assert name in replayed["home"], name
    # The zygote's own home holds only what its import made.
    assert ".env" not in replayed["zygote_home"]


def test_replay_leaves_the_write_deny_list_whole(replayed: dict[str, Any]) -> None:
    """A generic 'clear what is keyed by P' would empty it."""
    denied = replayed["denied"]
    assert any(p.endswith("/home/.env") for p in denied), denied


def test_without_replay_the_session_would_get_the_zygotes_view(tmp_path: Path) -> None:
    """The control: the same swap with no replay leaves the session's files
    unread, so the tests above do test the replay."""
    seen = swap_and_replay(tmp_path / "b", "none")
    assert seen["env"]["SEALED_MARK"] is None
    assert seen["env"]["HERMES_QUIET"] is None
    assert "SOUL.md" not in seen["home"]  # _HERMES_HOME_ENSURED said P was done
    assert seen["yolo"] is True and seen["redact"] is False


def test_preload_refuses_a_home_with_files_and_hermes_imported_before(tmp_path: Path) -> None:
    paths = SimpleNamespace(home=tmp_path / "h", workspace=tmp_path / "w", user=tmp_path / "u")
    for p in (paths.home, paths.workspace, paths.user):
        p.mkdir()
    (paths.home / ".env").write_text("OPENAI_API_KEY=zygote\n")
    with pytest.raises(hermes_seal.SealError, match="every session"):
        hermes_seal.preload(paths)
    (paths.home / ".env").unlink()
    importlib.import_module("run_agent")  # Hermes imported here, not under P
    with pytest.raises(hermes_seal.SealError, match="imported before the sealed preload"):
        hermes_seal.preload(paths)


# Hermes imported in the zygote under its own home (an operator's --preload
# of run_agent before the sealed preload), then a worker's replay.
IMPORTED_ELSEWHERE = r"""
import os, sys
from pathlib import Path
from types import SimpleNamespace
base = Path(sys.argv[1])
os.environ["HERMES_HOME"] = str(base / "zygote-own-home")
import run_agent
from hermes_sup.worker import hermes_seal
paths = SimpleNamespace(home=base / "home", workspace=base / "w", user=base / "u")
os.environ["HERMES_HOME"] = str(paths.home)
try:
    hermes_seal.replay(paths)
    print("replayed")
except hermes_seal.SealError as exc:
    print(f"refused: {exc}")
"""


def test_replay_refuses_hermes_imported_outside_the_sealed_preload(tmp_path: Path) -> None:
    """Its paths are the zygote's own home, which no mount makes the
    session's: the worker must not run (fail closed)."""
    proc = subprocess.run(
        [sys.executable, "-c", IMPORTED_ELSEWHERE, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "refused: " in proc.stdout and "outside the sealed preload" in proc.stdout


def test_the_recorded_module_list_is_there_and_names_hermes() -> None:
    names = hermes_seal.recorded_modules()
    assert len(names) > 500
    assert {"run_agent", "model_tools", "tools.terminal_tool"} <= set(names)
    assert not [n for n in names if n.split(".")[0] in ("hermes_sup", "tests", "__main__")]


# ------------------------------------------------------------------ the audit
# Real supervisors with `--agent hermes --sealed on`, against the fake model.

# What each session's agent runs through its terminal tool: what it sees of
# itself, a file in its workspace and one in its /tmp, and what it can list
# of the sessions' parent directory. `{data}` is the data directory.
SEES = (
    "run: echo key=$HERMES_SESSION_KEY; echo home=$HERMES_HOME; echo pwd=$(pwd); "
    "echo own-$HERMES_SESSION_KEY > mine.txt; echo tmp-$HERMES_SESSION_KEY > /tmp/{mark}; "
    "echo seen=$(cat /tmp/{mark}); echo tmpls=$(ls -A /tmp | tr '\\n' ,); "
    "echo sessions=$(ls -A {data}/sessions 2>&1 | tr '\\n' ,); "
    "echo user=$HOME=$(ls -A $HOME | tr '\\n' ,); "
    "echo template=$SEALED_TEMPLATE timeout=$TERMINAL_TIMEOUT"
)
# Escape tries from the agent's shell: each prints its exit status.
ESCAPES = (
    "run: umount /tmp 2>/dev/null; echo umount=$?; "
    "umount -l {data} 2>/dev/null; echo umountdata=$?; "
    "cat /proc/{other}/environ >/dev/null 2>&1; echo environ=$?; "
    "ls /proc/{other}/root/ >/dev/null 2>&1; echo procroot=$?; "
    "cat {state}/hmac.key 2>/dev/null; echo keyfile=$?; "
    "kill -0 {other} 2>/dev/null; echo killworker=$?; "
    "kill -0 {sup} 2>/dev/null; echo killsup=$?; "
    "cat {data}/sessions/{other_dir}/workspace/mine.txt 2>/dev/null; echo otherfile=$?"
)
ESCAPE_NAMES = (
    "umount",
    "umountdata",
    "environ",
    "procroot",
    "keyfile",
    "killworker",
    "killsup",
    "otherfile",
)


def _sealed_supervisor(
    supervisor_factory: Any, model: Any, workdir: Path, extra: list[str], as_user: bool = False
) -> Any:
    """A supervisor running sealed Hermes sessions against the fake model
    (as_user: as uid 65534, sealing with user namespaces); the test is
    skipped where this machine cannot seal (no namespaces)."""
    from hermes_sup.seal.paths import SealedPaths

    template = workdir / "template"
    template.mkdir()
    # Every approval here is answered: no timeout a loaded machine could reach.
    (template / "config.yaml").write_text(
        "approvals:\n  timeout: 600\nmodel:\n  context_length: 131072\nterminal:\n  timeout: 77\n"
    )
    # What a new session's first worker must load from its home, as unsealed.
    (template / ".env").write_text("SEALED_TEMPLATE=from-template\n")
    config = workdir / "agent.toml"
    config.write_text(
        f'model = "fake-model"\nbase_url = "{model.url}"\nprovider = "custom"\n'
        f'toolsets = ["terminal"]\ntemplate_home = "{template}"\n'
    )
    home = workdir / "user-home"
    home.mkdir()
    env = dict(os.environ, HOME=str(home))
    sup = supervisor_factory(
        "--agent",
        "hermes",
        "--agent-config",
        str(config),
        "--sealed",
        "on",
        *extra,
        env=env,
        start=False,
    )
    preexec: Any = None
    if as_user:
        # tests/test_sealed.py's way to become uid 65534 with the interpreter reachable.
        sealed_tests = importlib.import_module(f"{__package__}.test_sealed")
        preexec = sealed_tests.as_nobody_with_the_interpreter_reachable

        for path in [workdir, *workdir.rglob("*")]:
            os.chown(path, 65534, 65534)
        env["HOME"] = "/nonexistent"
    try:
        # The zygote imports all of hermes before the supervisor answers:
        # seconds, and many more on a loaded machine.
        sup.start(wait=False, preexec_fn=preexec)
        sup.wait_ready(timeout=300)
    except AssertionError as exc:
        if "sessions cannot be sealed here" in str(exc):
            pytest.skip(f"sealed mode is not available here: {exc}")
        raise
    sup.paths = SealedPaths.for_data_dir(sup.data_dir)
    sup.user_home = home
    return sup


def _tree(path: Path) -> dict[str, tuple[int, int]]:
    """Every file under path: (size, mtime_ns) by relative name."""
    out = {}
    for p in sorted(path.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(path))] = (st.st_size if p.is_file() else 0, st.st_mtime_ns)
    return out


def _turns(
    sup: Any, texts: dict[str, str], timeout: float = 180
) -> dict[str, tuple[Any, list[Any]]]:
    """Run one turn in each session at once; approve (once) whatever the agent
    asks, so that escape tries are refused by the kernel, not by hermes."""
    from hermes_sup.protocol import Kind

    with sup.client(timeout=timeout) as client, sup.client(timeout=30) as approver:
        reqs = {client.submit(Kind.SEND, {"text": t}, session=k): k for k, t in texts.items()}
        events: dict[str, list[Any]] = {r: [] for r in reqs}
        finals: dict[str, Any] = {}
        deadline = time.monotonic() + timeout
        while len(finals) < len(reqs):
            msg = client.next(timeout=max(1.0, deadline - time.monotonic()))
            if msg.re not in reqs:
                continue
            if msg.kind is Kind.EVENT:
                events[msg.re].append(msg)
                if msg.body["type"] == "approval":
                    approver.request(Kind.APPROVE, {"choice": "once"}, session=reqs[msg.re])
            else:
                finals[msg.re] = msg
    return {reqs[r]: (finals[r], events[r]) for r in reqs}


def _tool_output(events: list[Any]) -> str:
    """What the terminal tool's commands printed, over the turn's tool calls."""
    outputs = []
    for event in events:
        if event.body["type"] == "tool_complete":
            result = event.body["data"]["result"]
            try:
                outputs.append(str(json.loads(result)["output"]))
            except (TypeError, ValueError, KeyError):
                outputs.append(str(result))
    return "\n".join(outputs)


def _inodes(top: Path) -> set[tuple[int, int]]:
    found = {(top.stat().st_dev, top.stat().st_ino)}
    for p in top.rglob("*"):
        st = p.lstat()
        found.add((st.st_dev, st.st_ino))
    return found


def _foreign_fds(pid: int, own: set[tuple[int, int]], allowed: list[str]) -> list[str]:
    """The worker's open files and directories that are not its session's
    (by device and inode, as its paths read from here are its own view)."""
    import stat

    foreign = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            st = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile, or not a file (socket, pipe)
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            continue
        if (st.st_dev, st.st_ino) in own:
            continue
        if any(target == a or target.startswith(a.rstrip("/") + "/") for a in allowed):
            continue
        foreign.append(f"fd {fd} -> {target}")
    return foreign


def _readable_regions(maps: Iterable[str]) -> Iterator[tuple[int, int, str]]:
    """(start, end, name) of each readable mapping in a /proc/<pid>/maps listing, less the
    kernel's [vvar] and [vsyscall] pages, which /proc/<pid>/mem will not read."""
    for line in maps:
        fields = line.split()
        if not fields[1].startswith("r") or fields[-1] in ("[vvar]", "[vsyscall]"):
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        yield start, end, fields[-1]


def _memory_mentions(pid: int, needles: list[bytes]) -> set[bytes]:
    """Which of needles appear anywhere in the process's readable memory
    (its module globals, heap, stacks): a worker must hold nothing that
    names another session."""
    found: set[bytes] = set()
    longest = max(len(n) for n in needles)
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
        for start, end, _name in _readable_regions(maps):
            tail = b""
            for offset in range(start, end, 1 << 22):
                try:
                    mem.seek(offset)
                    chunk = tail + mem.read(min(1 << 22, end - offset))
                except (OSError, ValueError):
                    break
                found.update(n for n in needles if n in chunk)
                tail = chunk[-longest:]
    return found


def _memory_context(pid: int, needles: set[bytes]) -> list[bytes]:
    """Where in the process's memory the needles are (for a failure's message)."""
    out: list[bytes] = []
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
        for start, end, name in _readable_regions(maps):
            try:
                mem.seek(start)
                chunk = mem.read(end - start)
            except (OSError, ValueError):
                continue
            for needle in needles:
                at = chunk.find(needle)
                if at >= 0:
                    out.append(name.encode() + b": " + chunk[max(0, at - 200) : at + 100])
    return out[:6]


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("extra", "as_user"),
    [(["--spare-workers", "0"], False), (["--spare-workers", "2"], False), ([], True)],
    ids=["forked", "spares", "unprivileged"],
)
def test_sealed_hermes_sessions_see_only_their_own(
    supervisor_factory: Any, workdir: Path, extra: list[str], as_user: bool
) -> None:
    import sqlite3

    import psutil

    from hermes_sup.protocol import session_dir_name

    from .fake_model import FakeModel

    model = FakeModel()
    try:
        if as_user and os.geteuid() != 0:
            pytest.skip("needs root to start the supervisor as another uid")
        sup = _sealed_supervisor(supervisor_factory, model, workdir, extra, as_user)
        keys = ["tg-alice", "dc-bob", "web-carol"]
        data = sup.data_dir
        with sup.client(timeout=120) as client:
            # The preload said how far it was as it went, and status says what it did.
            recorded = len(hermes_seal.recorded_modules())
            preload = client.status()["preload"]
            assert preload["recorded"] == recorded and preload["modules"] > recorded
            assert f"modules={recorded}/{recorded}" in sup.log()
            for key in keys:
                client.open(key)
            deadline = time.monotonic() + 120
            while {r["state"] for r in client.sessions()} != {"idle"} and (
                time.monotonic() < deadline
            ):
                time.sleep(0.05)
            pids = {r["key"]: r["pid"] for r in client.sessions()}
        assert set(pids) == set(keys) and all(pids.values()), pids
        # The zygote's fixed paths, as its import left them.
        before = {name: _tree(getattr(sup.paths, name)) for name in ("home", "workspace", "user")}

        mark = f"sealed-{workdir.name}.txt"  # a name no other run uses
        results = _turns(sup, {k: SEES.format(data=data, mark=mark) for k in keys})
        others = {k: [o for o in keys if o != k] for k in keys}
        # Nothing in a worker's memory names another session (its key or its
        # directory). Checked before the escape tries, whose commands name others.
        for key in keys:
            needles = [n.encode() for o in others[key] for n in (o, session_dir_name(o))]
            found = _memory_mentions(pids[key], needles)
            assert found == set(), (key, found, _memory_context(pids[key], found))
        escapes = _turns(
            sup,
            {
                k: ESCAPES.format(
                    data=data,
                    state=sup.state_dir,
                    other=pids[others[k][0]],
                    other_dir=session_dir_name(others[k][0]),
                    sup=sup.pid,
                )
                for k in keys
            },
        )
        key_hex = (sup.state_dir / "hmac.key").read_text().strip()
        # As root each session has a uid of its own; not root, only Landlock's
        # signal scope (Linux 6.12+) keeps a session from signalling others.
        from hermes_sup.local import syscalls

        root = os.geteuid() == 0 and not as_user
        signals_scoped = root or syscalls.landlock_abi() >= syscalls.LANDLOCK_SCOPE_ABI
        assert ("sealed mode=root" if root else "sealed mode=user") in sup.log()

        for key in keys:
            d = data / "sessions" / session_dir_name(key)
            reply, events = results[key]
            assert reply.kind.name == "REPLY", reply.body
            out = _tool_output(events)
            assert f"key={key}" in out
            assert f"home={sup.paths.home}" in out and f"pwd={sup.paths.workspace}" in out
            assert f"seen=tmp-{key}" in out
            # Its home's .env and config (copied from the template at its
            # first start) are loaded and bridged, as unsealed.
            assert "template=from-template timeout=77" in out
            # Of the sessions' parent directory, it sees its own directory only
            # (or may not list it at all).
            listed = out.split("sessions=", 1)[1].split("\n", 1)[0]
            assert listed.strip(",") == session_dir_name(key) or "Permission denied" in listed
            for other in others[key]:
                assert other not in out and session_dir_name(other) not in out
            # What it wrote is in its own directories, at their real paths.
            assert (d / "workspace" / "mine.txt").read_text().strip() == f"own-{key}"
            # Its /tmp (where `seen` read its mark) is a tmpfs of its own.
            assert not (d / "tmp" / mark).exists()
            # Its state.db holds its own turn, and only its own.
            db = sqlite3.connect(d / "home" / "state.db")
            text = " ".join(str(row) for row in db.execute("SELECT * FROM messages"))
            db.close()
            assert f"key={key}" in text
            assert not any(f"key={o}" in text for o in others[key])
            # Every escape try was refused.
            reply, events = escapes[key]
            out = _tool_output(events)
            for name in ESCAPE_NAMES:
                status = out.split(f"{name}=", 1)[1].split("\n", 1)[0].strip()
                if name.startswith("kill") and not signals_scoped:
                    continue  # one uid, no Landlock signal scope: allowed (docs/security.md)
                assert status != "0", (key, name, out)
            assert key_hex not in out
            # Its worker holds open no file or directory outside its session
            # but the service's own code and devices.
            own = _inodes(d)
            allowed = [
                sys.prefix,
                sys.base_prefix,
                str(Path(hermes_seal.__file__).parents[1]),
                "/dev",
            ]
            assert _foreign_fds(pids[key], own, allowed) == [], key
            assert psutil.pid_exists(pids[key])

        # Nothing of any session reached the zygote's P, W or U, nor the shared /tmp.
        after = {name: _tree(getattr(sup.paths, name)) for name in ("home", "workspace", "user")}
        assert after == before
        assert before["workspace"] == {} and before["user"] == {}
        assert not (Path("/tmp") / mark).exists()
        assert list(sup.user_home.iterdir()) == []
    finally:
        model.close()


# Run by a session's own shell: how often its worker's memory holds a string.
MEMORY_SCAN = """
import sys
# Each needle comes in two parts: whole, it would be in the command, which
# passes through the worker.
pid, parts = sys.argv[1], sys.argv[2:]
needles = [(parts[i] + parts[i + 1]).encode() for i in range(0, len(parts), 2)]
hits = [0] * len(needles)
try:
    maps, mem = open(f"/proc/{pid}/maps"), open(f"/proc/{pid}/mem", "rb", 0)
except OSError as exc:
    sys.exit(f"refused: {exc}")
with maps, mem:
    for line in maps:
        fields = line.split()
        if fields[1][0] != "r" or fields[-1] in ("[vvar]", "[vsyscall]"):
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        try:
            mem.seek(start)
            chunk = mem.read(end - start)
        except OSError:
            continue
        for i, needle in enumerate(needles):
            hits[i] += chunk.count(needle)
print("hits=" + ",".join(map(str, hits)))
"""


@pytest.mark.e2e
def test_a_sealed_session_finds_nothing_of_another_in_its_workers_memory(
    supervisor_factory: Any, workdir: Path
) -> None:
    from .fake_model import FakeModel

    model = FakeModel()
    try:
        # Forked, not from spares: each worker a fork of the zygote after the
        # other session's request went through it.
        sup = _sealed_supervisor(supervisor_factory, model, workdir, ["--spare-workers", "0"])
        # Values no other text holds: each session's key and env token.
        alpha, beta = f"sa-{workdir.name}", f"sb-{workdir.name}"
        tokens = {k: f"tok-{k}-{os.getpid()}" for k in (alpha, beta)}
        with sup.client(timeout=120) as client:
            for key in (alpha, beta):  # one after the other: beta forked after alpha
                client.open(key, options={"env": {"SEALED_TOKEN": tokens[key]}})
                client.run(key, "hello")
            pid = client.sessions(prefix=beta)[0]["pid"]
        # From root: beta's worker holds its own key and token (the scan
        # sees), and nothing of alpha's.
        own = [beta.encode(), tokens[beta].encode()]
        assert _memory_mentions(pid, own) == set(own)
        assert _memory_mentions(pid, [alpha.encode(), tokens[alpha].encode()]) == set()
        # Read by beta's own shell (approved), with the agent's terminal
        # tool: nothing, not even its own token. Its worker (pid 1 of the
        # session's PID namespace) runs as the shell's uid, and is not
        # dumpable: no secret the runtime holds is the shell's to read.
        halves = [t[: len(t) // 2] + " " + t[len(t) // 2 :] for t in (tokens[beta], tokens[alpha])]
        command = f"run: python3 - 1 {' '.join(halves)} <<'EOF'\n{MEMORY_SCAN}\nEOF"
        reply, events = _turns(sup, {beta: command})[beta]
        out = _tool_output(events)
        assert "refused: [Errno 13] Permission denied" in out and "hits=" not in out, out
    finally:
        model.close()


@pytest.mark.e2e
def test_an_operators_preload_of_hermes_is_imported_sealed_not_before(
    supervisor_factory: Any, workdir: Path
) -> None:
    """`--preload run_agent` is allowed when sealed: the zygote must import it
    with the rest of Hermes under the fixed paths, not first under its own
    home (where every session would then fail closed)."""
    from .fake_model import FakeModel

    model = FakeModel()
    try:
        sup = _sealed_supervisor(supervisor_factory, model, workdir, ["--preload", "run_agent"])
        with sup.client(timeout=120) as client:
            reply = client.run("solo", "hello")
            assert "echo: hello" in reply.text, reply.text
    finally:
        model.close()
