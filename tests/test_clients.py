"""The Python client library against real supervisors: typed events and
errors, many threads and many tasks on one client, reconnection after a
restart, session options, and remote front ends over CURVE."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq

from hermes_sup.client import (
    AccessDenied,
    ApprovalRequest,
    AsyncClient,
    BadRequest,
    Client,
    Connection,
    NoSuchSession,
    NotRunning,
    Output,
    Reply,
    Running,
    SessionConflict,
    Timeout,
    Token,
)
from hermes_sup.client.connection import write_connection_file
from hermes_sup.protocol import Kind, Message, decode, encode


def test_a_turn_streams_typed_events_then_its_reply(supervisor) -> None:
    with supervisor.client() as client:
        turn = client.send("s1", "stream the quick brown fox")
        events = list(turn)
    running = [e for e in events if isinstance(e, Running)]
    assert len(running) == 1 and running[0].pid and running[0].turn == turn.id
    tokens = [e.text for e in events if isinstance(e, Token)]
    # Four words 20 ms apart; a worker may merge two that come closer under load.
    assert 2 <= len(tokens) <= 4 and "".join(tokens) == "the quick brown fox"
    assert isinstance(events[-1], Reply) and turn.reply is events[-1]
    assert turn.reply.text == "the quick brown fox" and turn.reply.session == "s1"


def test_errors_are_typed_and_carry_the_supervisors_code(supervisor) -> None:
    with supervisor.client() as client:
        with pytest.raises(BadRequest) as bad:
            client.run("../etc", "pid")
        assert bad.value.code == "bad_session_key" and "../etc" in bad.value.message
        with pytest.raises(NoSuchSession) as missing:
            client.kill("never-seen")
        assert missing.value.code == "no_such_session"
        client.open("c", session_env={"platform": "slack"})
        with pytest.raises(SessionConflict):
            client.open("c", session_env={"platform": "discord"})
        assert client.run("c", "env HERMES_SESSION_PLATFORM").text == "slack"


def test_many_threads_share_one_client(supervisor) -> None:
    results: dict[str, object] = {}

    def work(key: str) -> None:
        try:
            for i in range(5):
                reply = client.run(key, f"sh echo {key}-{i}")
                assert [e.line for e in reply.events if isinstance(e, Output)] == [f"{key}-{i}"]
            results[key] = client.run(key, "env HERMES_SESSION_KEY").text
        except Exception as exc:  # reported below, with the key
            results[key] = exc

    with supervisor.client() as client:
        threads = [threading.Thread(target=work, args=(f"t{i}",)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(client._links) == 8  # one socket per thread
        # Threads that ended give their sockets back when the next one comes.
        for _ in range(20):
            t = threading.Thread(target=client.ping)
            t.start()
            t.join()
        assert len(client._links) <= 2
        assert client.ping().pid == supervisor.pid
    assert results == {f"t{i}": f"t{i}" for i in range(8)}


def test_asyncio_client_runs_many_tasks_answers_approvals_and_cancels(supervisor) -> None:
    async def chat(client: AsyncClient, key: str) -> str:
        await client.open(key, session_env={"chat_id": key})
        text = ""
        async for event in await client.send(key, f"stream hello from {key}"):
            if isinstance(event, Token):
                text += event.text
        reply = await client.run(key, "env HERMES_SESSION_CHAT_ID")
        assert reply.text == key
        return text

    async def approve(client: AsyncClient, choice: str) -> Reply:
        turn = await client.send("ops", "ask echo approved-and-ran")
        async for event in turn:
            if isinstance(event, ApprovalRequest):
                assert event.command == "echo approved-and-ran" and "deny" in event.choices
                assert await client.approve("ops", choice) == choice
        assert turn.reply is not None
        return turn.reply

    async def cancel(client: AsyncClient) -> Reply:
        turn = await client.send("slow", "sleep 30")
        seen = []
        async for event in turn:
            seen.append(event)
            if isinstance(event, Running):
                assert await turn.cancel() == turn.id
        assert isinstance(seen[-1], Reply)
        return seen[-1]

    async def main() -> None:
        async with AsyncClient(supervisor.state_dir, timeout=15) as client:
            texts = await asyncio.gather(*(chat(client, f"a{i}") for i in range(8)))
            assert texts == [f"hello from a{i}" for i in range(8)]
            allowed = await approve(client, "once")
            assert allowed.text == "exit 0"
            denied = await approve(client, "deny")
            assert denied.text.startswith("denied")
            assert (await cancel(client)).data == {"cancelled": True}
            with pytest.raises(NoSuchSession):
                await client.kill("nobody")
            assert (await client.ping()).pid == supervisor.pid

    asyncio.run(main())


def test_timeouts_on_a_frozen_supervisor(supervisor) -> None:
    with supervisor.client(timeout=0.5) as client:
        client.ping()
        os.kill(supervisor.pid, 19)  # SIGSTOP
        try:
            with pytest.raises(Timeout):
                client.ping()
            with pytest.raises(Timeout):
                asyncio.run(_async_ping(supervisor.state_dir, 0.5))
        finally:
            os.kill(supervisor.pid, 18)  # SIGCONT
        assert client.ping().pid == supervisor.pid


async def _async_ping(state_dir: Path, timeout: float) -> object:
    async with AsyncClient(state_dir, timeout=timeout) as client:
        return await client.ping()


def test_clients_reconnect_after_a_supervisor_restart(supervisor_factory) -> None:
    sup = supervisor_factory()
    client = sup.client()
    aclient_box: list[AsyncClient] = []

    async def arun(text: str) -> str:
        if not aclient_box:
            aclient_box.append(AsyncClient(sup.state_dir, timeout=15))
        return (await aclient_box[0].run("r", text)).text

    loop = asyncio.new_event_loop()
    try:
        assert client.run("r", "echo-before").text == "echo-before"
        assert loop.run_until_complete(arun("async-before")) == "async-before"
        # A turn in flight when the supervisor stops ends with an error, not a hang.
        turn = client.send("r", "sleep 30")
        first = next(iter(turn))
        assert isinstance(first, Running)
        sup.stop()
        with pytest.raises(NotRunning):
            client.run("r", "pid")
        with pytest.raises(NotRunning):
            loop.run_until_complete(arun("pid"))
        sup.start()
        assert client.run("r", "echo-after").text == "echo-after"
        assert loop.run_until_complete(arun("async-after")) == "async-after"
    finally:
        client.close()
        if aclient_box:
            loop.run_until_complete(aclient_box[0].close())
        loop.close()


def test_workspace_and_runtime_options_follow_the_operators_policy(
    supervisor_factory, workdir
) -> None:
    root = workdir / "projects"
    (root / "acme").mkdir(parents=True)
    outside = workdir / "elsewhere"
    outside.mkdir()
    (root / "escape").symlink_to(outside)
    sup = supervisor_factory("--workspace-root", str(root))
    with sup.client() as client:
        client.open("w1", workspace=root / "acme")
        # Its cwd and TERMINAL_CWD are the chosen directory (sealed, seen at
        # the fixed path the zygote imported under).
        assert client.run("w1", "cwd").text == client.run("w1", "env TERMINAL_CWD").text
        assert client.run("w1", "write mark.txt in-acme").ok
        assert (root / "acme" / "mark.txt").read_text() == "in-acme"
        with pytest.raises(BadRequest) as out:
            client.open("w2", workspace=outside)
        assert "not under a workspace root" in out.value.message
        with pytest.raises(BadRequest):
            client.open("w3", workspace=root / "escape")  # a symlink out of the root
        with pytest.raises(BadRequest) as rt:
            client.open("w4", runtime="hermes")
        assert "'hermes' is not allowed" in rt.value.message
        assert client.run("w5", "cwd").text.endswith("/workspace")  # the session's own
    (root / "cli").mkdir()
    by_cli = hs(sup, "--state-dir", str(sup.state_dir), "send", "w6", "--workspace",
                str(root / "cli"), "write by-cli.txt cli")  # fmt: skip
    assert by_cli.returncode == 0, by_cli.stderr
    assert (root / "cli" / "by-cli.txt").read_text() == "cli"
    refused = hs(sup, "--state-dir", str(sup.state_dir), "send", "w7", "--runtime", "hermes", "pid")
    assert refused.returncode == 1 and "'hermes' is not allowed" in refused.stderr


# ------------------------------------------------------------------ remote


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def hs(sup, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hermes_sup.cli", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "HERMES_SUP_DATA_DIR": str(sup.data_dir)},
    )


@pytest.fixture
def remote(supervisor_factory, workdir):
    port = free_port()
    sup = supervisor_factory("--tcp", str(port))
    made = hs(sup, "keys", "generate", "web-eu", "--endpoint", f"127.0.0.1:{port}",
              "-o", str(workdir / "web-eu.json"))  # fmt: skip
    assert made.returncode == 0, made.stderr
    return sup, workdir / "web-eu.json", port


def test_an_allowed_curve_key_works_over_tcp(remote) -> None:
    sup, conn_file, port = remote
    assert oct(conn_file.stat().st_mode & 0o777) == "0o600"
    listening = {c.laddr.ip for c in __import__("psutil").Process(sup.pid).net_connections()
                 if c.laddr and c.laddr.port == port}  # fmt: skip
    assert listening == {"127.0.0.1"}  # loopback unless asked
    with Client.from_connection_file(conn_file) as client:
        assert client.ping().pid == sup.pid
        assert client.run("remote-1", "env HERMES_SESSION_KEY").text == "remote-1"

    async def go() -> str:
        async with AsyncClient.from_connection_file(conn_file) as aclient:
            return (await aclient.run("remote-2", "stream over curve")).text

    assert asyncio.run(go()) == "over curve"
    listed = hs(sup, "keys", "list")
    assert "web-eu" in listed.stdout
    status = hs(sup, "--state-dir", str(sup.state_dir), "status")
    assert f"tcp:       tcp://127.0.0.1:{port} (CURVE" in status.stdout
    conn_file.chmod(0o644)
    with pytest.raises(AccessDenied) as loose:
        Client.from_connection_file(conn_file)
    assert "readable by others" in str(loose.value) and "chmod 600" in str(loose.value)


def test_unknown_key_no_key_and_forged_hmac_are_refused(remote, workdir) -> None:
    sup, conn_file, port = remote
    good = Connection.from_file(conn_file)
    assert good.curve is not None
    # An unknown CURVE key: a clear refusal, on both sides.
    public, secret = zmq.curve_keypair()
    stranger = workdir / "stranger.json"
    write_connection_file(
        stranger, good.endpoint, good.key, good.curve.server_public, public.decode(),
        secret.decode(),
    )  # fmt: skip
    with Client.from_connection_file(stranger, timeout=3) as client:
        with pytest.raises(AccessDenied) as refused:
            client.ping()
    assert "not in the supervisor's allowlist" in str(refused.value)
    # Every command the refusal names is one that exists.
    named = re.findall(r"hermes-sup keys (\w+)", str(refused.value))
    assert named
    for command in named:
        assert hs(sup, "keys", command, "--help").returncode == 0, command
    assert "remote_client_refused" in sup.log() and public.decode() in sup.log()

    ctx = zmq.Context()
    try:
        # No CURVE at all: the handshake fails; nothing reaches the supervisor.
        plain = ctx.socket(zmq.DEALER)
        plain.linger = 0
        plain.connect(good.endpoint)
        plain.send_multipart(encode(Message(Kind.PING), good.key))
        assert not plain.poll(1500)
        plain.close()
        assert "remote_handshake_failed" in sup.log()
        # The right CURVE key but a forged signature: refused as bad_signature.
        forged = ctx.socket(zmq.DEALER)
        forged.linger = 0
        forged.curve_serverkey = good.curve.server_public.encode()
        forged.curve_publickey = good.curve.public.encode()
        forged.curve_secretkey = good.curve.secret.encode()
        forged.connect(good.endpoint)
        forged.send_multipart(encode(Message(Kind.PING), b"f" * 32))
        assert forged.poll(5000)
        answer = decode(forged.recv_multipart(), good.key)
        assert answer.kind is Kind.ERROR and answer.body["code"] == "bad_signature"
        # The local key is not a remote key: a connection file never grants more.
        local_key = bytes.fromhex((sup.state_dir / "hmac.key").read_text().strip())
        assert local_key != good.key
        forged.send_multipart(encode(Message(Kind.PING), local_key))
        assert forged.poll(5000)
        assert decode(forged.recv_multipart(), good.key).body["code"] == "bad_signature"
        forged.close()
    finally:
        ctx.term()

    # The supervisor kept serving everyone else, locally and remotely.
    with Client.from_connection_file(conn_file) as client:
        assert client.run("still-here", "pid").text.isdigit()
    with sup.client() as client:
        assert client.ping().pid == sup.pid

    # Revoking takes effect for the next connection, without a restart.
    assert hs(sup, "keys", "revoke", "web-eu").returncode == 0
    with Client.from_connection_file(conn_file, timeout=3) as client:
        with pytest.raises(AccessDenied):
            client.ping()


def test_bad_tcp_settings_are_refused_clearly(supervisor_factory, workdir) -> None:
    sup = supervisor_factory("--tcp", "*:7788", start=False)
    result = subprocess.run(
        [sys.executable, "-m", "hermes_sup.cli", "--state-dir", str(sup.state_dir), "serve",
         "--data-dir", str(sup.data_dir), "--tcp", "*:7788"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert result.returncode == 2 and "0.0.0.0" in result.stderr
    bad = hs(sup, "keys", "generate", "../x", "--endpoint", "127.0.0.1:1")
    assert bad.returncode == 1 and "client name" in bad.stderr


def test_the_docs_gateway_example_runs(supervisor, monkeypatch) -> None:
    """The embedding page's example, run as written: tokens, a command's
    output lines and replies all reach the chat."""
    page = (Path(__file__).parent.parent / "docs" / "embedding.md").read_text()
    code = page.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.setenv("HERMES_SUP_STATE_DIR", str(supervisor.state_dir))
    sent: list[tuple[str, str, str]] = []
    scope = {
        "stream_to_chat": lambda chat, text: sent.append(("token", chat, text)),
        "ask_user": lambda chat, command, choices: sent.append(("ask", chat, command)),
        "finish_chat_message": lambda chat, text: sent.append(("done", chat, text)),
    }
    exec(compile(code, "docs/embedding.md", "exec"), scope)
    try:
        scope["on_message"]("telegram", "42", "u7", "stream hi there")
        scope["on_message"]("slack", "C9", "u8", "env HERMES_SESSION_USER_ID")
        scope["on_message"]("slack", "C9", "u8", "sh echo printed")
    finally:
        scope["hs"].close()
    assert sent == [
        ("token", "42", "hi"),
        ("token", "42", " there"),
        ("done", "42", "hi there"),
        ("done", "C9", "u8"),
        ("token", "C9", "printed\n"),
        ("done", "C9", "exit 0"),
    ]


def test_watch_sees_every_clients_turns_typed(supervisor) -> None:
    from hermes_sup.client import StateChange, TurnStarted

    with supervisor.client() as watcher, supervisor.client() as other:
        other.run("w", "pid")
        stream = watcher.watch("w", replay=10)
        replayed = next(stream)
        assert replayed.replayed and replayed.session == "w"
        other.run("w", "sh echo watched")
        seen = []
        for event in stream:
            if not event.replayed:
                seen.append(event)
            if isinstance(event, Reply) and not event.replayed:
                break
        stream.close()  # sends unwatch
        types = [type(e).__name__ for e in seen]
        assert isinstance(seen[0], (StateChange, TurnStarted)), types
        assert any(isinstance(e, TurnStarted) and e.text == "sh echo watched" for e in seen)
        assert any(isinstance(e, Output) and e.line == "watched" for e in seen)
        assert seen[-1].text == "exit 0"
        assert watcher.ping().pid == supervisor.pid  # the socket is still usable

    async def awatch() -> list[str]:
        async with AsyncClient(supervisor.state_dir) as client:
            got: list[str] = []
            stream = client.watch("w")
            task = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0.3)
            await client.run("w", "stream a b")
            got.append(type(await task).__name__)
            async for event in stream:
                got.append(type(event).__name__)
                if isinstance(event, Reply):
                    break
            await stream.aclose()
            return got

    got = asyncio.run(awatch())
    assert "Token" in got and got[-1] == "Reply"


def test_a_request_made_while_the_supervisor_is_down_never_runs_later(remote, workdir) -> None:
    sup, conn_file, _port = remote
    late = workdir / "late.txt"
    with Client.from_connection_file(conn_file, timeout=2) as client:
        assert client.ping().pid == sup.pid
        sup.stop()
        # Over TCP the client cannot see the lock: it gets no answer in time.
        with pytest.raises(Timeout):
            client.run("late", f"sh echo ran > {late}")
        sup.start()
        time.sleep(1.0)  # room for a socket still holding the request to reconnect
        assert not late.exists()
        # The same client reconnects, and the refused turn was never delivered.
        assert client.run("after", "pid").text.isdigit()
        assert not late.exists()

    async def go() -> str:
        async with AsyncClient.from_connection_file(conn_file, timeout=2) as aclient:
            await aclient.ping()
            sup.stop()
            with pytest.raises(Timeout):
                await aclient.run("late", f"sh echo ran > {late}")
            sup.start()
            await asyncio.sleep(1.0)
            assert not late.exists()
            return (await aclient.run("after", "env HERMES_SESSION_KEY")).text

    assert asyncio.run(go()) == "after"
    assert not late.exists()


def test_a_turn_over_its_turn_timeout_is_cancelled(supervisor) -> None:
    with supervisor.client() as client:
        with pytest.raises(Timeout) as slow:
            client.run("slow", "sleep 30", turn_timeout=0.5)
        assert "it was cancelled" in str(slow.value)
        # Cancelled, not left running: the session answers at once.
        assert client.run("slow", "pid", turn_timeout=10).text.isdigit()

    async def go() -> str:
        async with AsyncClient(supervisor.state_dir) as aclient:
            with pytest.raises(Timeout) as aslow:
                await aclient.run("slow", "sleep 30", turn_timeout=0.5)
            assert "it was cancelled" in str(aslow.value)
            return (await aclient.run("slow", "cwd", turn_timeout=10)).text

    assert asyncio.run(go()).endswith("/workspace")


def test_one_async_client_serves_successive_event_loops(supervisor) -> None:
    client = AsyncClient(supervisor.state_dir)
    try:
        for i in range(3):  # each asyncio.run has a new loop; the client follows
            assert asyncio.run(client.run("loops", f"echo-{i}")).text == f"echo-{i}"
    finally:
        asyncio.run(client.close())


def test_a_request_that_timed_out_is_never_carried_out_later(supervisor) -> None:
    """A timeout is final even when other requests keep the client's socket
    open: the request carries its time to live and the supervisor, back from
    a stall, refuses it."""

    async def main() -> None:
        async with AsyncClient(supervisor.state_dir, timeout=15) as client:
            await client.ping()
            os.kill(supervisor.pid, signal.SIGSTOP)
            try:
                patient = asyncio.ensure_future(client.ping())  # shares the socket
                with pytest.raises(Timeout):
                    await client.open("late-async", timeout=0.5)
            finally:
                os.kill(supervisor.pid, signal.SIGCONT)
            assert (await patient).pid == supervisor.pid
            assert "late-async" not in [r["key"] for r in await client.sessions()]

    asyncio.run(main())
    with supervisor.client(timeout=0.5) as client:
        client.ping()
        os.kill(supervisor.pid, signal.SIGSTOP)
        pending = client.submit(Kind.PING)  # keeps this thread's socket in use
        try:
            with pytest.raises(Timeout):
                client.open("late-blocking")
        finally:
            os.kill(supervisor.pid, signal.SIGCONT)
        assert client.answer(pending, timeout=15).kind is Kind.PONG
        assert [r["key"] for r in client.sessions()] == []
    assert supervisor.log().count("code=expired") == 2
