"""The real Hermes agent in each worker, against a fake model server on
127.0.0.1. Needs hermes-agent installed (`make test` installs it)."""

from __future__ import annotations

import os
import signal
import sqlite3
import time
from pathlib import Path

import psutil
import pytest

from hermes_sup.client import SupervisorError
from hermes_sup.protocol import Kind, session_dir_name

from .conftest import needs_hermes
from .fake_model import FakeModel
from .test_faults import final, until, wait_running
from .test_isolation import _text
from .waiting import wait_for

pytestmark = [needs_hermes, pytest.mark.e2e]

PROBE = (
    "run: pwd; echo key=$HERMES_SESSION_KEY; echo home=$HERMES_HOME; "
    "echo cwd=$TERMINAL_CWD; echo chat=$HERMES_SESSION_CHAT_ID"
)


@pytest.fixture
def model():
    fake = FakeModel()
    yield fake
    fake.close()


# Seconds Hermes waits for an approval's answer: long where the test
# answers (however late a loaded machine lets it), short where the test is
# of nobody answering.
ANSWERED_APPROVALS = 600
UNANSWERED_APPROVALS = 3


@pytest.fixture
def hermes(supervisor_factory, model, workdir, request):
    """A supervisor running the hermes runtime against the fake model, with
    its own HOME (which must stay untouched) and a template HERMES_HOME.
    Parametrize it indirectly with extra `serve` arguments."""
    return start_hermes(supervisor_factory, model, workdir, request, ANSWERED_APPROVALS)


@pytest.fixture
def hermes_unanswered(supervisor_factory, model, workdir, request):
    """`hermes` for tests of approvals nobody answers: they time out in
    UNANSWERED_APPROVALS seconds."""
    return start_hermes(supervisor_factory, model, workdir, request, UNANSWERED_APPROVALS)


def start_hermes(supervisor_factory, model, workdir, request, approval_timeout: int):
    """The supervisor of `hermes`, its approvals waiting `approval_timeout` seconds."""
    template = workdir / "template"
    template.mkdir()
    (template / "config.yaml").write_text(f"approvals:\n  timeout: {approval_timeout}\n")
    config = workdir / "agent.toml"
    config.write_text(
        f'model = "fake-model"\nbase_url = "{model.url}"\nprovider = "custom"\n'
        f'toolsets = ["terminal"]\napi_key_env = "FAKE_MODEL_KEY"\n'
        f'template_home = "{template}"\n'
    )
    home = workdir / "user-home"
    home.mkdir()
    env = dict(os.environ, FAKE_MODEL_KEY="sk-fake-secret", HOME=str(home))
    extra = getattr(request, "param", [])
    sup = supervisor_factory("--agent", "hermes", "--agent-config", str(config), *extra, env=env)
    sup.user_home = home
    return sup


def session_dir(sup, key: str) -> Path:
    return sup.data_dir / "sessions" / session_dir_name(key)


def collect(client, reqs: dict[str, str], timeout: float = 120) -> dict[str, tuple]:
    """Run turns concurrently: {request id: key} -> {key: (final, events)}."""
    events: dict[str, list] = {r: [] for r in reqs}
    finals = {}
    deadline = time.monotonic() + timeout
    while len(finals) < len(reqs):
        msg = client.next(timeout=max(1.0, deadline - time.monotonic()))
        if msg.re not in reqs:
            continue
        if msg.kind is Kind.EVENT:
            events[msg.re].append(msg)
        else:
            finals[msg.re] = msg
    return {reqs[r]: (finals[r], events[r]) for r in reqs}


# What a session's data directory may hold: the worker's home, workspace, tmp
# and log, and the supervisor's own files (its metadata, its turn journal,
# and the session's lease and fencing epoch when the supervisor keeps them).
SESSION_ENTRIES = (
    "home",
    "workspace",
    "tmp",
    "user",
    "worker.log",
    "session.json",
    "turns",
    "turns.1",
    "lease",
    "epoch",
)


# Unsealed Hermes: imported in each worker after its environment is set
# (test_sealed_hermes.py has the sealed, preloaded one).
@pytest.mark.parametrize(
    "hermes",
    [["--spare-workers", "0", "--sealed", "off"], ["--spare-workers", "3", "--sealed", "off"]],
    ids=["forked", "spares"],
    indirect=True,
)
def test_concurrent_hermes_sessions_see_only_their_own_values(hermes, model) -> None:
    keys = ["tg-alice", "dc-bob", "web-carol"]
    with hermes.client(timeout=120) as client:
        from_spares = "3" in hermes.args  # every session's worker was a spare
        if from_spares:
            deadline = time.monotonic() + 30
            while client.status()["spare_workers"] < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            spare_pids = {
                p.pid
                for p in psutil.Process(hermes.pid).children()
                if "(spare)" in " ".join(p.cmdline())
            }
            assert len(spare_pids) == 3
        for i, key in enumerate(keys):
            client.open(key, options={"session_env": {"platform": "api", "chat_id": f"chat-{i}"}})
        reqs = {client.submit(Kind.SEND, {"text": PROBE}, session=k): k for k in keys}
        results = collect(client, reqs)
        if from_spares:
            assert {row["pid"] for row in client.sessions()} == spare_pids

    for i, key in enumerate(keys):
        reply, events = results[key]
        assert reply.kind is Kind.REPLY, reply.body
        d = session_dir(hermes, key)
        tool = next(e.body["data"] for e in events if e.body["type"] == "tool_complete")
        out = tool["result"]
        for expected in (
            f"key={key}",
            f"home={d / 'home'}",
            f"cwd={d / 'workspace'}",
            f"chat=chat-{i}",
            str(d / "workspace"),
        ):
            assert expected in out and expected in reply.body["text"], (expected, out)
        for other in keys:
            if other != key:
                assert other not in out and session_dir_name(other) not in out
        assert any(e.body["type"] == "token" for e in events)
        # The session's own state.db holds its own turn, and only its own.
        db = sqlite3.connect(d / "home" / "state.db")
        text = " ".join(str(row) for row in db.execute("SELECT * FROM messages"))
        db.close()
        assert f"key={key}" in text
        assert not any(f"key={o}" in text for o in keys if o != key)
    # The api key reached the model, not the workers' environments.
    assert all(r.get("messages") for r in model.requests)

    # Isolation audit: every file hermes wrote is under its own session's
    # home or workspace; the zygote's HERMES_HOME and the user's HOME stay empty.
    assert list((hermes.data_dir / "zygote-home").iterdir()) == []
    assert list(hermes.user_home.iterdir()) == []
    for key in keys:
        d = session_dir(hermes, key)
        for path in d.rglob("*"):
            rel = path.relative_to(d)
            assert rel.parts[0] in SESSION_ENTRIES, rel
            if path.is_file() and path.suffix in (".log", ".md", ".yaml", ".json", ".txt"):
                content = path.read_text(errors="replace")
                for other in keys:
                    if other != key:
                        assert session_dir_name(other) not in content, (path, other)
        assert (d / "home" / "state.db").exists()
        assert (d / "home" / "config.yaml").read_text().startswith("approvals")  # template
        # The supervisor's TERMINAL_CWD is not called a deprecated .env setting.
        log = (d / "worker.log").read_text(errors="replace")
        assert "Deprecated .env settings" not in log and "found in .env" not in log
        # Hermes's terminal wrote its shell snapshot (the session's whole
        # environment) into the session's own tmp/, not the shared /tmp.
        snaps = list((d / "tmp").glob("hermes-snap-*.sh"))
        assert snaps and f"HERMES_SESSION_KEY={key}" in snaps[0].read_text().replace('"', "")
    # /tmp is everyone's: a file listed may be gone before it is read.
    shared = [p for p in Path("/tmp").glob("hermes-*") if str(hermes.data_dir) in _text(p)]
    assert shared == []
    known = ("sessions", "zygote-home", ".spare-sessions")
    leftovers = [p for p in hermes.data_dir.iterdir() if p.name not in known]
    assert leftovers == []
    # Session directories made ahead of time for new sessions hold nothing
    # yet: empty directories, and the supervisor's lease files when it keeps them.
    spare_root = hermes.data_dir / ".spare-sessions"
    assert any(p.name == "workspace" for p in spare_root.rglob("*") if p.is_dir())
    files = [p for p in spare_root.rglob("*") if not p.is_dir()]
    assert all(p.name in SESSION_ENTRIES[-2:] or p.suffix == ".lock" for p in files), files
    # The api key is in no log and no file of any session.
    assert "sk-fake-secret" not in hermes.log()
    for path in hermes.data_dir.rglob("*"):
        if path.is_file():
            assert b"sk-fake-secret" not in path.read_bytes(), path


def test_approval_deny_then_once(hermes) -> None:
    with hermes.client(timeout=120) as client:
        client.run("ops", "run: mkdir -p target && echo keep > target/file && echo made")
        target = session_dir(hermes, "ops") / "workspace" / "target"
        assert (target / "file").exists()

        for choice in ("deny", "once"):
            req = client.submit(Kind.SEND, {"text": "run: rm -rf target"}, session="ops")
            while True:
                msg = client.next()
                assert msg.re == req and msg.kind is Kind.EVENT, msg.body
                if msg.body["type"] == "approval":
                    request = msg.body["data"]
                    break
            assert "rm -rf target" in request["command"] and request["description"]
            assert (
                client.request(Kind.APPROVE, {"choice": choice}, session="ops").body["choice"]
                == choice
            )
            reply = final(client, req, timeout=60)
            assert reply.kind is Kind.REPLY, reply.body
            if choice == "deny":
                assert "BLOCKED" in reply.body["text"] or "denied" in reply.body["text"].lower()
                assert (target / "file").exists()
            else:
                assert not target.exists()
        with pytest.raises(SupervisorError) as err:
            client.request(Kind.APPROVE, {"choice": "once"}, session="ops")
        assert err.value.code == "nothing_to_approve"


def test_no_answer_to_an_approval_means_deny_and_the_front_end_is_told(hermes_unanswered) -> None:
    hermes = hermes_unanswered
    with hermes.client(timeout=120) as client:
        client.run("quiet", "run: mkdir -p target && echo made")
        target = session_dir(hermes, "quiet") / "workspace" / "target"
        reply = client.run("quiet", "run: rm -rf target")
        events = reply.events
        types = [e.type for e in events]
        assert "approval" in types and "approval_timeout" in types
        assert target.exists()


def test_cancel_interrupts_a_running_hermes_turn(hermes) -> None:
    with hermes.client(timeout=120) as client:
        req = client.submit(Kind.SEND, {"text": "slow: 20"}, session="long")
        while True:
            msg = client.next()
            if msg.kind is Kind.EVENT and msg.body["type"] == "token":
                break
        started = time.monotonic()
        assert client.cancel("long") == req
        reply = final(client, req, timeout=30)
        assert time.monotonic() - started < 10
        assert reply.kind is Kind.REPLY and reply.body["data"].get("interrupted")
        assert client.run("long", "still there?").text.startswith("echo: still there?")


def test_conversation_resumes_after_kill_and_after_a_crash(hermes) -> None:
    with hermes.client(timeout=120) as client:
        assert client.run("memo", "first").text == "echo: first (turn 1)"
        client.kill("memo")
        assert client.run("memo", "second").text == "echo: second (turn 2)"
        req = client.submit(Kind.SEND, {"text": "slow: 20"}, session="memo")
        pid = wait_running(client, req)
        while client.next().body.get("type") != "token":
            pass
        os.kill(pid, signal.SIGKILL)
        crashed = final(client, req)
        assert crashed.kind is Kind.ERROR and crashed.body["code"] == "worker_died"
        assert "SIGKILL" in crashed.body["message"]
        until(lambda: client.sessions()[0]["state"] in ("exited", "backoff"), timeout=5)
        reply = client.run("memo", "third")
        # The interrupted message is part of the resumed history (hermes folds
        # it into the next user turn); the conversation went on from there.
        assert reply.text.startswith("echo: ") and "third" in reply.text
        assert "(turn 3)" in reply.text or "slow: 20" in reply.text


def test_bad_model_settings_fail_the_turn_not_the_session(hermes) -> None:
    with hermes.client(timeout=180) as client:
        client.open("nowhere", options={"agent": {"base_url": "http://127.0.0.1:9/v1"}})
        with pytest.raises(SupervisorError) as err:
            client.run("nowhere", "hello")
        assert err.value.code == "turn_failed" and err.value.message
        pid = client.sessions()[0]["pid"]
        with pytest.raises(SupervisorError):
            client.run("nowhere", "hello again")
        assert client.sessions()[0]["pid"] == pid  # same worker, still serving
        with pytest.raises(SupervisorError) as err:
            client.open("nowhere", options={"agent": {"temperature": 2}})
        assert err.value.code == "bad_field" and "unknown agent option" in err.value.message


def test_an_operator_answers_an_approval_in_attach(hermes) -> None:
    import sys

    import pexpect

    with hermes.client(timeout=120) as client:
        client.run("guarded", "run: mkdir -p target && echo made")
        target = session_dir(hermes, "guarded") / "workspace" / "target"
        cmd = f"{sys.executable} -m hermes_sup.cli --state-dir {hermes.state_dir} attach guarded"
        child = pexpect.spawn(
            cmd,
            encoding="utf-8",
            timeout=60,
            env=dict(os.environ, NO_COLOR="1"),
            dimensions=(40, 160),
        )
        try:
            child.expect("attached to guarded")
            req = client.submit(Kind.SEND, {"text": "run: rm -rf target"}, session="guarded")
            child.expect(r"\? approval requested: rm -rf target")
            child.sendline("/deny")
            child.expect("approval answer sent: deny")
            reply = final(client, req, timeout=60)
            assert reply.kind is Kind.REPLY
            assert target.exists()
            child.sendeof()
            child.expect(pexpect.EOF)
        finally:
            child.close(force=True)


def test_each_approval_timeout_is_reported_when_it_happens_with_its_id(hermes_unanswered) -> None:
    hermes = hermes_unanswered
    """Two dangerous commands in one turn, nobody answers: each request times
    out in turn (approvals.timeout is UNANSWERED_APPROVALS here), and each timeout names its
    request before the next one is asked, not only when the turn ends."""
    with hermes.client(timeout=120) as client:
        client.run("twice", "run: mkdir -p a b && echo made")
        reply = client.run("twice", "runs: rm -rf a ;; rm -rf b")
        seen = [(e.type, e.id) for e in reply.events if e.type in ("approval", "approval_timeout")]
        assert len(seen) == 4, seen
        first, second = seen[0][1], seen[2][1]
        assert first and second and first != second, seen
        assert seen == [
            ("approval", first),
            ("approval_timeout", first),
            ("approval", second),
            ("approval_timeout", second),
        ]
        workspace = session_dir(hermes, "twice") / "workspace"
        assert (workspace / "a").exists() and (workspace / "b").exists()


# The values the seed bugs sent to the wrong chat, workspace or person, as
# every tool of the session sees them (the terminal's child process here).
SEED_VARIABLES = (
    "run: echo platform=$HERMES_SESSION_PLATFORM chat=$HERMES_SESSION_CHAT_ID "
    "user=$HERMES_SESSION_USER_ID thread=$HERMES_SESSION_THREAD_ID "
    "key=$HERMES_SESSION_KEY ask=$HERMES_EXEC_ASK home=$HERMES_HOME "
    "cwd=$TERMINAL_CWD pwd=$(pwd)"
)


@pytest.mark.parametrize(
    "hermes",
    [
        ["--allow-env", "HERMES_EXEC_ASK", "--spare-workers", spares, "--sealed", sealed]
        for sealed in ("off", "auto")
        for spares in ("0", "2")
    ],
    ids=["unsealed-forked", "unsealed-spares", "sealed-forked", "sealed-spares"],
    indirect=True,
)
def test_the_seed_variables_reach_every_tool_of_their_own_session(hermes, model) -> None:
    """Each session's platform, chat, user, thread, key, approval mode, home
    and workspace, as its tools see them, sealed or not, from a spare or
    forked. hermes-agent's gateway.run sets HERMES_EXEC_ASK=1 at import: a
    front end's allowed 0 must still be what the session's tools see."""
    sessions = {
        "tg:111": {"platform": "telegram", "chat_id": "111", "user_id": "u-1", "thread_id": "t1"},
        "dc:222": {"platform": "discord", "chat_id": "222", "user_id": "u-2", "thread_id": "t2"},
    }
    asks = {"tg:111": "0", "dc:222": "1"}
    with hermes.client(timeout=120) as client:
        if "2" in hermes.args:
            wait_for(lambda: client.status()["spare_workers"] == 2, 60, what="spares")
        for key, values in sessions.items():
            env = {"HERMES_EXEC_ASK": "0"} if asks[key] == "0" else {}
            client.open(key, options={"session_env": values, "env": env})
        reqs = {client.submit(Kind.SEND, {"text": SEED_VARIABLES}, session=k): k for k in sessions}
        results = collect(client, reqs)
        sealed = "sealed mode=" in hermes.log()
    for key, values in sessions.items():
        reply, events = results[key]
        assert reply.kind is Kind.REPLY, reply.body
        done = [e.body["data"] for e in events if e.body["type"] == "tool_complete"]
        out = str(done[-1]["result"])
        d = session_dir(hermes, key)
        home = hermes.data_dir / "sealed" / "home" if sealed else d / "home"
        workspace = hermes.data_dir / "sealed" / "workspace" if sealed else d / "workspace"
        expected = (
            f"platform={values['platform']} chat={values['chat_id']} user={values['user_id']} "
            f"thread={values['thread_id']} key={key} ask={asks[key]} home={home} "
            f"cwd={workspace} pwd={workspace}"
        )
        assert expected in out, (key, out)
