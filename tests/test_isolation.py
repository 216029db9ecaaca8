"""The mission, proven end to end: sessions cannot see each other's environment,
files or directories. Real supervisor, real forked workers, real sockets."""

from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from hermes_sup.protocol import Kind, session_dir_name

pytestmark = pytest.mark.e2e

SESSIONS = 32
OPS_PER_SESSION = 14
MARK = re.compile(r"iso-(\d{3})-\d+")


@dataclass
class Driver:
    """One session's script and what it expects to observe."""

    index: int
    key: str
    root: Path
    sealed: bool  # then its worker sees its directories at the fixed paths
    ops: list[str] = field(default_factory=list)
    env_value: str = ""
    file_value: str | None = None
    counter: int = 0
    observations: int = 0
    pending_op: str = ""

    def token(self) -> str:
        self.counter += 1
        return f"iso-{self.index:03d}-{self.counter}"

    def next_op(self, rng: random.Random) -> str:
        choice = rng.choice(["setenv", "env", "sh", "write", "cwd", "key"])
        if choice == "setenv" or not self.env_value:
            self.env_value = self.token()
            op = f"setenv ISO_VAR {self.env_value}"
        elif choice == "env":
            op = "env ISO_VAR"
        elif choice == "sh":
            op = (
                'sh echo "$ISO_VAR|$HERMES_SESSION_KEY|$HERMES_HOME|$TERMINAL_CWD|$(pwd)"; '
                "cat mark.txt 2>/dev/null; echo; ls"
            )
        elif choice == "write":
            self.file_value = self.token()
            op = f"write mark.txt {self.file_value}"
        elif choice == "cwd":
            op = "cwd"
        else:
            op = "env HERMES_SESSION_KEY"
        self.pending_op = op
        return op

    @property
    def on_disk(self) -> Path:
        """Its workspace, as the host sees it."""
        return self.root / "sessions" / session_dir_name(self.key) / "workspace"

    @property
    def workspace(self) -> str:
        """Its workspace, as its worker sees it."""
        return str(self.root / "sealed" / "workspace" if self.sealed else self.on_disk)

    @property
    def home(self) -> str:
        if self.sealed:
            return str(self.root / "sealed" / "home")
        return str(self.root / "sessions" / session_dir_name(self.key) / "home")

    def check(self, reply: str, output: list[str]) -> None:
        """Every value observed must be this session's own, and the latest one."""
        for text in [reply, *output]:
            for other in MARK.findall(text):
                assert int(other) == self.index, (
                    f"session {self.key} observed session {other}'s value: {text!r}"
                )
        op = self.pending_op
        if op.startswith("env ISO_VAR"):
            assert reply == self.env_value
        elif op.startswith("env HERMES_SESSION_KEY"):
            assert reply == self.key
        elif op == "cwd":
            assert reply == self.workspace
        elif op.startswith("sh "):
            # One output event may hold several lines (coalesced streams).
            output = "\n".join(output).split("\n")
            var, key, home, tcwd, pwd = output[0].split("|")
            assert (var, key, home, tcwd, pwd) == (
                self.env_value,
                self.key,
                self.home,
                self.workspace,
                self.workspace,
            )
            if self.file_value is not None:
                assert output[1] == self.file_value
            assert reply == "exit 0"
        self.observations += 1


@pytest.mark.parametrize("sealed", ["auto", "off"])
def test_32_concurrent_sessions_never_see_each_other(supervisor_factory, sealed: str) -> None:
    supervisor = supervisor_factory("--sealed", sealed)
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    is_sealed = sealed == "auto"  # this test runs where sealing works
    drivers = {
        f"user-{i:03d}": Driver(i, f"user-{i:03d}", supervisor.data_dir, is_sealed)
        for i in range(SESSIONS)
    }
    remaining = {key: OPS_PER_SESSION for key in drivers}
    in_flight: dict[str, tuple[str, list[str]]] = {}  # request id -> (key, output lines)
    pids: dict[str, set[int]] = {key: set() for key in drivers}

    with supervisor.client(timeout=60) as client:

        def submit(key: str) -> None:
            op = drivers[key].next_op(rng)
            req = client.submit(Kind.SEND, {"text": op}, session=key)
            in_flight[req] = (key, [])
            remaining[key] -= 1

        # Start every session at once, in random order; then keep each one
        # busy with its next operation as soon as its previous one answers.
        for key in rng.sample(sorted(drivers), len(drivers)):
            submit(key)
        while in_flight:
            msg = client.next()
            key, output = in_flight[msg.re]
            if msg.kind is Kind.EVENT:
                if msg.body["type"] == "output":
                    output.append(msg.body["data"])
                elif msg.body["type"] == "status" and msg.body["data"].get("pid"):
                    pids[key].add(msg.body["data"]["pid"])
                continue
            assert msg.kind is Kind.REPLY, msg.body
            del in_flight[msg.re]
            drivers[key].check(msg.body["text"], output)
            if remaining[key]:
                submit(key)

        sessions = client.sessions()

    assert sum(d.observations for d in drivers.values()) == SESSIONS * OPS_PER_SESSION
    # One distinct worker process per session, each serving only its own key.
    all_pids = [p for ps in pids.values() for p in ps]
    assert len(all_pids) == SESSIONS == len(set(all_pids))
    assert {s["key"] for s in sessions} == set(drivers)
    assert all(s["turns"] == OPS_PER_SESSION for s in sessions)
    # Files landed only in their own session's workspace.
    for d in drivers.values():
        mark = d.on_disk / "mark.txt"
        if d.file_value is not None:
            assert mark.read_text() == d.file_value


def test_supervisor_secrets_stay_out_of_workers_unless_allowlisted(supervisor_factory) -> None:
    env = dict(
        os.environ,
        SUPERVISOR_ONLY_SECRET="hunter2",
        OPERATOR_ALLOWED="visible",
        OPENAI_API_KEY="sk-not-for-workers",
    )
    sup = supervisor_factory("--pass-env", "OPERATOR_ALLOWED", "--env", "FIXED=configured", env=env)
    with sup.client() as client:
        assert client.run("a", "env SUPERVISOR_ONLY_SECRET").text == ""
        assert client.run("a", "env OPENAI_API_KEY").text == ""
        assert client.run("a", "env OPERATOR_ALLOWED").text == "visible"
        assert client.run("a", "env FIXED").text == "configured"
        # Not even a child process of the worker sees it.
        reply = client.run("a", "sh env")
        events = reply.events
        output = "\n".join(e.data for e in events if e.type == "output")
        assert "hunter2" not in output and "sk-not-for-workers" not in output
        assert "OPERATOR_ALLOWED=visible" in output
        pid = int(client.run("a", "pid").text)
    # The worker's initial environment block (from the zygote's exec) holds no secret either.
    with open(f"/proc/{pid}/environ", "rb") as f:
        block = f.read()
    assert b"hunter2" not in block and b"sk-not-for-workers" not in block


def test_session_values_from_the_front_end_reach_only_their_worker(supervisor) -> None:
    with supervisor.client() as client:
        client.open("tg-1", options={"session_env": {"platform": "telegram", "chat_id": "111"}})
        client.open("dc-2", options={"session_env": {"platform": "discord", "chat_id": "222"}})
        got = {
            key: client.run(key, "sh echo $HERMES_SESSION_PLATFORM:$HERMES_SESSION_CHAT_ID").events
            for key in ("tg-1", "dc-2")
        }
        assert got["tg-1"][-1].data == "telegram:111"
        assert got["dc-2"][-1].data == "discord:222"


def test_directories_are_private(supervisor) -> None:
    """The state and data directories are the service's alone. (Sealed as
    root, sessions connect to the workers' socket as uids of their own, so
    it is 0666, in a 0700 directory that sessions' views hide besides.)"""
    with supervisor.client() as client:
        client.run("priv", "write notes.txt secret")
    session_dir = supervisor.data_dir / "sessions" / session_dir_name("priv")
    for path in (
        supervisor.state_dir,
        session_dir,
        session_dir / "workspace",
        session_dir / "home",
    ):
        assert path.stat().st_mode & 0o777 == 0o700, path
    for path in (
        supervisor.state_dir / "hmac.key",
        supervisor.state_dir / "control.sock",
        session_dir / "workspace" / "notes.txt",
    ):
        assert path.stat().st_mode & 0o777 == 0o600, path
    sealed_as_root = "sealed mode=root" in supervisor.log()
    expected = 0o666 if sealed_as_root else 0o600
    assert (supervisor.state_dir / "workers.sock").stat().st_mode & 0o777 == expected


def test_each_session_has_its_own_temporary_directory_emptied_at_start_and_purged(
    supervisor_factory,
) -> None:
    """Temporary files (Hermes's shell snapshot is a full dump of a session's
    environment) go to the session's own tmp/, never to the shared /tmp.
    Unsealed (sealed, /tmp itself is a tmpfs of the session's own:
    test_hostile_session.py)."""
    supervisor = supervisor_factory("--sealed", "off")
    dirs = {k: supervisor.data_dir / "sessions" / session_dir_name(k) for k in ("ta", "tb")}
    with supervisor.client() as client:
        for key, d in dirs.items():
            out = client.run(key, "sh echo $TMPDIR:$TMP:$TEMP").events[-1].data
            assert out == ":".join([str(d / "tmp")] * 3)
            # Python's own choice in the worker too, though the zygote chose before.
            script = "import tempfile; print(tempfile.gettempdir())"
            out = client.run(key, f"sh python3 -c '{script}'").events[-1].data
            assert out == str(d / "tmp")
            client.run(key, f'sh echo "secret of {key}" > "$TMPDIR/dump.sh"')
            assert (d / "tmp").stat().st_mode & 0o777 == 0o700
        assert (dirs["ta"] / "tmp" / "dump.sh").read_text() == "secret of ta\n"
        # A new worker of the session starts with it empty: the last one left
        # with os._exit, and nothing it wrote there outlives it.
        client.kill("ta")
        assert client.run("ta", "sh ls -A $TMPDIR | wc -l").events[-1].data.strip() == "0"
        assert (dirs["tb"] / "tmp" / "dump.sh").exists()
        client.kill("tb", purge=True)
    assert not dirs["tb"].exists()
    assert not [p for p in Path("/tmp").glob("*") if "secret of t" in _text(p)]


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace") if path.is_file() else ""
    except OSError:
        return ""


def test_a_turns_context_reaches_its_runtime_and_no_other_turn(supervisor) -> None:
    """What a front end sends with a turn's text (instructions, history) goes
    to the runtime with that turn only: on a new worker and an idle one."""
    context = {"instructions": "be brief", "history": [{"role": "user", "content": "hi"}]}
    with supervisor.client() as client:
        for _ in range(2):  # a new session's first turn, then an idle worker's
            assert json.loads(client.run("ctx", "context", context=context).text) == context
        assert client.run("ctx", "context").text == "null"
        assert client.run("other", "context").text == "null"
