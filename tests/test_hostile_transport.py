"""What one client or one session sends cannot take the supervisor down,
stall it, or make it drop what it owes others: connection floods at a low
descriptor limit, floods of failed handshakes, answers over the frame limit,
and spawn requests at the documented maximum of options. Real supervisor,
real processes, real sockets."""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
import zmq
import zmq.auth
from hypothesis import given
from hypothesis import strategies as st

from hermes_sup.client import Overloaded, SupervisorError, Timeout
from hermes_sup.protocol import Kind, Message

from . import waiting
from .test_spares import spare_pids

wait_for = partial(waiting.wait_for, timeout=15.0)


# ------------------------------------------------------- options at the limit


def largest_options() -> dict[str, dict[str, str]]:
    """`env` and `session_env` at the documented maximum: 64 entries of
    4,096 characters each (supervisor/environment.py)."""
    return {
        "env": {f"HS_BIG_{i:02d}": f"{i:02d}" * 2048 for i in range(64)},
        "session_env": {f"big{i:02d}": f"{i:02x}" * 2048 for i in range(64)},
    }


def test_a_message_of_any_size_goes_as_parts_and_comes_back_whole() -> None:
    from hermes_sup.local.datagrams import DATAGRAM_SIZE, Joiner, PartsError, split

    joiner = Joiner()
    for size in (0, 1, 32 * 1024 - 1, 32 * 1024, 32 * 1024 + 1, 3_000_000):
        message = os.urandom(size)
        parts = split(message)
        assert all(len(p) <= DATAGRAM_SIZE for p in parts)
        assert [joiner.add(p) for p in parts[:-1]] == [None] * (len(parts) - 1)
        assert joiner.add(parts[-1]) == message
    with pytest.raises(PartsError):
        joiner.add(b"\x07oops")


def test_options_whose_environment_could_not_start_a_program_are_refused() -> None:
    from hermes_sup.protocol import RemoteProtocolError
    from hermes_sup.supervisor.environment import MAX_ENVIRONMENT_BYTES, parse_options

    largest = largest_options()
    assert len(parse_options(largest).env) == 64  # the documented maximum is accepted
    wide = {name: "\U0001f600" * 4096 for name in largest["env"]}  # 4 bytes a character
    with pytest.raises(RemoteProtocolError) as err:
        parse_options({"env": wide, "session_env": largest["session_env"]})
    assert err.value.code.value == "bad_field"
    assert f"at most {MAX_ENVIRONMENT_BYTES}" in err.value.message
    assert "env and session_env" in err.value.message
    # A list among the agent options is held to the same limits.
    assert parse_options({"agent": {"toolsets": ["t"] * 64}}).agent["toolsets"] == ["t"] * 64
    for toolsets in (["t"] * 65, ["t" * 4097], ["a\0b"]):
        with pytest.raises(RemoteProtocolError) as err:
            parse_options({"agent": {"toolsets": toolsets}})
        assert "at most 64 strings of at most 4096 characters" in err.value.message


def connected_spares(sup, count: int) -> set[int]:  # noqa: ANN001
    """The spares' pids once `count` of them are connected to the supervisor."""
    pids = spare_pids(sup)
    connected = {pid for pid in pids if _has_unix_connection(pid)}
    return connected if len(connected) == count else set()


def _has_unix_connection(pid: int) -> bool:
    """Whether `pid` holds a connected unix socket. Read in its own network
    namespace (/proc/PID/net/unix): a sealed worker's is not ours, where
    psutil looks."""
    try:
        inodes = {
            link[len("socket:[") : -1]
            for fd in os.listdir(f"/proc/{pid}/fd")
            if (link := os.readlink(f"/proc/{pid}/fd/{fd}")).startswith("socket:[")
        }
        with open(f"/proc/{pid}/net/unix") as rows:
            next(rows)
            # Num RefCount Protocol Flags Type St(ate) Inode [Path]; 03 is connected.
            return any(r.split()[5] == "03" and r.split()[6] in inodes for r in rows)
    except OSError:
        return False


@pytest.mark.parametrize("spares", [0, 2])
def test_a_session_with_the_largest_options_starts_and_answers(supervisor_factory, spares) -> None:
    sup = supervisor_factory("--spare-workers", str(spares))
    options = largest_options()
    with sup.client(timeout=30) as client:
        ready = wait_for(lambda: connected_spares(sup, spares)) if spares else set()
        time.sleep(0.5)  # for the supervisor to read their `spare`
        client.open("big", **options)
        reply = client.run("big", "env HS_BIG_63")
        assert reply.text == options["env"]["HS_BIG_63"]
        assert client.run("big", "env HERMES_SESSION_BIG07").text == "07" * 2048
        # Its programs start too: the environment fits exec(2)'s limit.
        ran = client.run("big", "sh echo started")
        assert [e.data for e in ran.events if e.type == "output"] == ["started"]
        (row,) = client.sessions()
        if spares:
            assert row["pid"] in ready  # the request went to a spare, over zmq
        # And everyone else is served as before.
        assert client.run("small", "env HERMES_SESSION_KEY").text == "small"
    assert "Message too long" not in sup.log()


# ------------------------------------------------------ answers over the limit

RUNTIMES = str(Path(__file__).parent / "runtimes")
SMALL_FRAMES = 64 * 1024


@pytest.fixture
def small_frames(supervisor_factory):  # noqa: ANN001, ANN201
    """A supervisor with a 64 KiB frame limit and a runtime that answers as
    large as asked."""
    env = dict(os.environ, PYTHONPATH=RUNTIMES)
    return supervisor_factory(
        "--agent",
        "hs_big:make",
        "--max-frame-size",
        str(SMALL_FRAMES),
        "--heartbeat-timeout",
        "1",
        env=env,
    )


@pytest.mark.parametrize("size", [SMALL_FRAMES + 100, 5 * SMALL_FRAMES])
def test_a_reply_over_the_frame_limit_ends_its_turn_with_an_error(small_frames, size) -> None:
    sup = small_frames
    with sup.client() as client:
        pid = client.run("big", "pid").text
        with pytest.raises(SupervisorError) as err:
            client.run("big", f"reply {size}")
        assert err.value.code == "too_large"
        assert f"{SMALL_FRAMES}-byte frame limit" in err.value.message
        # The worker is healthy and stays: beyond the hang timeout, the
        # same process still answers, with a reply that fits.
        time.sleep(2.5)
        assert client.run("big", "pid").text == pid
        assert client.run("big", f"reply {SMALL_FRAMES // 2}").text == "r" * (SMALL_FRAMES // 2)
    assert "hung" not in sup.log()


def test_an_event_over_the_frame_limit_is_replaced_by_a_notice(small_frames) -> None:
    sup = small_frames
    with sup.client() as client:
        reply = client.run("big", f"event {3 * SMALL_FRAMES}")
        assert reply.text == "done"
        notice, small = [(e.type, e.data) for e in reply.events if e.type != "status"]
        assert notice[0] == "too_large"
        assert notice[1]["event"] == "output" and notice[1]["limit"] == SMALL_FRAMES
        assert notice[1]["bytes"] > 3 * SMALL_FRAMES
        assert small == ("output", "small")


def test_a_worker_told_the_limit_sends_a_notice_instead(workdir, zmq_context) -> None:
    from hermes_sup.protocol import decode as decode_frames
    from hermes_sup.worker.loop import Link

    endpoint = f"ipc://{workdir}/w.sock"
    router = zmq_context.socket(zmq.ROUTER)
    router.linger = 0
    router.bind(endpoint)
    token = b"t" * 32
    link = Link({"worker_id": b"w1", "endpoint": endpoint, "token": token, "max_frame_size": 4096})
    try:
        reply = Message(Kind.REPLY, {"text": "x" * 10_000, "ok": True}, session="s", re="turn-1")
        event = Message(
            Kind.EVENT, {"type": "token", "data": "y" * 10_000}, session="s", re="turn-1"
        )
        fits = Message(Kind.EVENT, {"type": "token", "data": "z" * 1000}, session="s", re="turn-1")
        for msg in (event, fits, reply):
            link.send(msg)
        got = []
        for _ in range(3):
            assert router.poll(5000)
            got.append(decode_frames(router.recv_multipart()[1:], token))
        assert got[0].kind is Kind.EVENT and got[0].body["type"] == "too_large"
        assert got[0].body["data"]["event"] == "token" and got[0].body["data"]["limit"] == 4096
        assert got[1].body == fits.body
        assert got[2].kind is Kind.ERROR and got[2].re == "turn-1"
        assert (
            got[2].body["code"] == "too_large" and "4096-byte frame limit" in got[2].body["message"]
        )
    finally:
        link.sock.close(0)
        link.ctx.term()


# ------------------------------------------------------- connection floods

LOW_FDS = 512
FLOOD_SECONDS = 5.0  # a flooder gives up after this long

FLOOD = r"""
import resource, socket, sys, time
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
kind, target, count, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
held, blocked = [], 0
deadline = time.monotonic() + seconds
while len(held) < count and time.monotonic() < deadline:
    if kind == "ipc":
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        address = target
    else:
        s = socket.socket()
        address = ("127.0.0.1", int(target))
    s.settimeout(0.5)
    try:
        s.connect(address)
    except OSError:  # made to wait, or refused for now
        s.close()
        blocked += 1
        continue
    held.append(s)
print(len(held), blocked, flush=True)
sys.stdin.read()  # hold them all until told
"""


def low_fd_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (LOW_FDS, LOW_FDS))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def flood(kind: str, target: str, count: int, processes: int = 1):  # noqa: ANN201
    """Other processes, each holding up to `count` connections to the
    supervisor; yields what each held and how often it was made to wait."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", FLOOD, kind, target, str(count), str(FLOOD_SECONDS)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(processes)
    ]
    try:
        counts = []
        for proc in procs:
            assert proc.stdout is not None
            held, blocked = proc.stdout.readline().split()
            counts.append((int(held), int(blocked)))
        yield counts
    finally:
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.close()
        for proc in procs:
            proc.wait(20)


def test_client_caps_take_what_sessions_leave_of_the_fd_limit() -> None:
    from hermes_sup.door.gate import BASE_FDS, BURST_FDS
    from hermes_sup.supervisor.endpoints import client_caps
    from hermes_sup.supervisor.limits import FD_RESERVE

    local, tcp = client_caps(1024, 0, None, None, tcp=False)
    assert tcp == 0 and 0 < local <= FD_RESERVE - BASE_FDS - BURST_FDS + 5
    assert client_caps(1024, 0, None, None, tcp=True) == (local // 2, local - local // 2)
    assert client_caps(1024, 0, None, 10, tcp=False) == (10, 0)  # fewer, if asked
    assert client_caps(1024, 0, None, 100_000, tcp=False) == (local, 0)  # never more
    # Sessions capped lower leave their descriptors to clients.
    assert client_caps(1024, 0, 10, None, tcp=False)[0] > local + 500


def test_a_throttle_writes_the_first_line_then_a_count() -> None:
    import logging

    from hermes_sup.door.throttle import Throttle

    now = [100.0]
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("hermes_sup.test-throttle")
    logger.addHandler(Keep())
    logger.propagate = False
    throttle = Throttle(logger, "noisy", interval=10.0, clock=lambda: now[0])
    for i in range(1000):
        throttle.warning(f"noisy n={i}")
    assert lines == ["noisy n=0"]
    throttle.flush(only_due=True)  # not yet: the interval is still running
    assert lines == ["noisy n=0"]
    now[0] += 10.0
    throttle.flush(only_due=True)
    assert lines == ["noisy n=0", "log_throttled kind=noisy suppressed=999 seconds=10"]
    throttle.warning("noisy n=1000")  # a new interval: verbatim again
    assert lines[-1] == "noisy n=1000"


def test_a_connection_over_the_cap_is_told_why(supervisor_factory, workdir) -> None:
    config = workdir / "config.toml"
    config.write_text("max_clients = 4\n")
    sup = supervisor_factory("--config", str(config))
    clients = [sup.client(timeout=5) for _ in range(4)]
    try:
        for client in clients:
            client.ping()
        message = told_why(sup)
        assert "4 client connections" in message and "max_clients" in message
        # The four are served as before; one gone, a new one is too.
        assert clients[0].run("kept", "env HERMES_SESSION_KEY").text == "kept"
        clients.pop().close()
        with sup.client(timeout=5) as later:
            assert wait_for(lambda: _pings(later))
    finally:
        for client in clients:
            client.close()
    assert "client_refused socket=control connections=4 limit=4" in sup.log()


def told_why(sup) -> str:  # noqa: ANN001
    """A new client's request is answered `overloaded`; its message. (A
    request that arrives before the gate's thread has counted its
    connection is served, and the connection shut after: try again.)"""
    for _ in range(20):
        with sup.client(timeout=5) as late:
            try:
                late.ping()
            except Overloaded as exc:
                return exc.message
            except Timeout:
                pass
        time.sleep(0.2)
    raise AssertionError("no client over the cap was told why")


def _pings(client) -> bool:  # noqa: ANN001
    try:
        client.ping(timeout=2)
        return True
    except (Overloaded, Timeout):
        return False


def test_a_connection_flood_at_a_low_fd_limit_is_refused_not_fatal(supervisor_factory) -> None:
    sup = supervisor_factory(start=False)
    sup.start(preexec_fn=low_fd_limit)
    control = str(sup.state_dir / "control.sock")
    with sup.client() as early:
        before = early.run("before", "pid").text
        # Three processes, each trying for more connections than the limit.
        with flood("ipc", control, LOW_FDS + 100, processes=3) as counts:
            held = sum(h for h, _ in counts)
            assert held >= 100  # the cap's worth at least got in
            # The rest were made to wait by the closed door, not accepted.
            assert any(blocked for _, blocked in counts)
            # Alive, and serving: the client that was connected before, its
            # session's worker, and a new session (whose worker's connection
            # needs a descriptor too).
            assert early.run("before", "pid").text == before
            assert early.run("during", "env HERMES_SESSION_KEY").text == "during"
        # Once the flood is gone, new clients are served again.
        with sup.client() as after:
            assert wait_for(lambda: _pings(after))
            assert after.run("before", "pid").text == before
    assert sup.proc.poll() is None
    log = sup.log()
    assert "Too many open files" not in log
    assert "client_refused socket=control" in log
    assert "client_door_closed socket=control" in log and "client_door_opened" in log
    assert sum("client_refused socket" in line for line in log.splitlines()) <= 2  # throttled


def test_a_tcp_connection_flood_never_locks_local_clients_out(supervisor_factory) -> None:
    port = free_port()
    sup = supervisor_factory("--tcp", str(port), start=False)
    sup.start(preexec_fn=low_fd_limit)
    with flood("tcp", str(port), LOW_FDS + 200) as counts:
        assert counts[0][0] > 100  # past the TCP socket's cap (half of about 130)
        with sup.client() as local:
            assert local.run("local", "env HERMES_SESSION_KEY").text == "local"
    assert sup.proc.poll() is None
    log = sup.log()
    assert "Too many open files" not in log
    assert "client_refused socket=tcp" in log


# --------------------------------------------------- failed handshake floods

# A ZMTP 3.0 greeting offering the NULL mechanism: a CURVE server refuses it.
NULL_GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32)

HANDSHAKE_FLOOD = r"""
import socket, sys, time, zmq
port, seconds, greeting = int(sys.argv[1]), float(sys.argv[2]), bytes.fromhex(sys.argv[3])
ctx = zmq.Context()
strangers = []
deadline = time.monotonic() + seconds
sent = 0
while time.monotonic() < deadline:
    # Not CURVE at all: the handshake fails.
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(5)
    s.sendall(greeting)
    while s.recv(1024):  # until the supervisor hangs up on it
        pass
    s.close()
    # CURVE, with a key nobody allowed: ZAP refuses it.
    public, secret = zmq.curve_keypair()
    d = ctx.socket(zmq.DEALER)
    d.linger = 0
    d.curve_serverkey, d.curve_publickey, d.curve_secretkey = sys.argv[4].encode(), public, secret
    d.connect(f"tcp://127.0.0.1:{port}")
    strangers.append(d)
    if len(strangers) > 20:
        strangers.pop(0).close()
    sent += 1
for d in strangers:
    d.close()
ctx.term()
print(sent, flush=True)
"""


def test_a_flood_of_failed_handshakes_writes_a_bounded_log(supervisor_factory) -> None:
    port = free_port()
    sup = supervisor_factory("--tcp", str(port))
    server_public, _ = zmq.auth.load_certificate(str(sup.data_dir / "curve" / "server.key"))
    lines_before = len(sup.log().splitlines())
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            HANDSHAKE_FLOOD,
            str(port),
            "3",
            NULL_GREETING.hex(),
            server_public.decode(),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    attempts = int(done.stdout)
    assert attempts > 50
    with sup.client() as client:  # still serving
        assert client.ping()
    sup.stop()  # writes what the throttles still hold
    lines = sup.log().splitlines()[lines_before:]
    failed = [line for line in lines if "remote_handshake_failed" in line]
    refused = [line for line in lines if "remote_client_refused" in line]
    # The first of each kind verbatim, then counts: not one line per attempt.
    assert any("remote_handshake_failed peer=" in line for line in failed)
    assert any("remote_client_refused key=" in line for line in refused)
    assert len(failed) <= 4 and len(refused) <= 4
    assert len(lines) < 40
    summed = sum(
        int(line.split("suppressed=")[1].split()[0])
        for line in lines
        if "log_throttled kind=remote_handshake_failed" in line
    )
    assert summed >= attempts // 2


# ------------------------------------------------ refusals that leave no trace


def hs(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hermes_sup.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_serve_refuses_a_socket_path_too_long_before_making_any_directory(workdir) -> None:
    state = workdir / ("s" * 60) / ("t" * 60)
    data = workdir / "data"
    done = hs("--state-dir", str(state), "serve", "--data-dir", str(data))
    assert done.returncode != 0
    assert "over the 107-byte limit of unix sockets" in done.stderr
    assert "Traceback" not in done.stderr
    assert not state.exists() and not state.parent.exists() and not data.exists()


@pytest.mark.parametrize("name", ["../x", "a/b", ".hidden", ""])
def test_keys_generate_refuses_a_bad_name_before_making_any_directory(workdir, name) -> None:
    data = workdir / "data"
    out = workdir / "out" / "conn.json"
    done = hs(
        "keys", "generate", name, "--endpoint", "127.0.0.1:7788",
        "--data-dir", str(data), "-o", str(out),
    )  # fmt: skip
    assert done.returncode != 0
    assert "client name" in done.stderr and "Traceback" not in done.stderr
    assert not data.exists() and not out.parent.exists()
    assert not (workdir / "x").exists() and not (workdir / "x.key").exists()


def test_keys_generate_refuses_an_existing_output_before_making_any_directory(workdir) -> None:
    data = workdir / "data"
    out = workdir / "conn.json"
    out.write_text("{}")
    done = hs(
        "keys", "generate", "web", "--endpoint", "127.0.0.1:7788",
        "--data-dir", str(data), "-o", str(out),
    )  # fmt: skip
    assert done.returncode != 0 and "exists" in done.stderr
    assert not data.exists() and out.read_text() == "{}"


# ------------------------------------- the supervisor's short path for events

EVENT_KEY = os.urandom(32)
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(),
    st.text(max_size=70),
    st.binary(max_size=8),
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)
_GOOD_EVENT = {
    "id": "m1",
    "kind": "event",
    "ts": 1.5,
    "session": "s",
    "re": "t1",
    "body": {"type": "token", "data": "hi"},
}


def _signed(envelope: dict) -> list[bytes]:  # type: ignore[type-arg]
    import msgpack

    from hermes_sup.protocol import MAGIC, sign

    payload = msgpack.packb(envelope, use_bin_type=True)
    return [b"worker-id", MAGIC, sign(EVENT_KEY, payload), payload]


def _short_path(frames: list[bytes], limit: int = 1 << 20):
    """What the supervisor's back makes of a worker's frames by the short
    path: verified and unpacked once, then event_of."""
    from hermes_sup.protocol import Limits, RemoteProtocolError
    from hermes_sup.protocol.wire import unpack, verify
    from hermes_sup.supervisor.back import event_of

    try:
        envelope = unpack(verify(frames[1:], EVENT_KEY, Limits(limit)))
    except RemoteProtocolError:
        return None
    return event_of(envelope, "s")


def _check_short_path(frames: list[bytes]) -> None:
    """What the short path accepts, decode accepts, as the same message."""
    from hermes_sup.protocol import RemoteProtocolError, decode

    fast = _short_path(frames)
    if fast is None:
        return
    try:
        slow = decode(frames[1:], EVENT_KEY)
    except RemoteProtocolError as exc:
        raise AssertionError(f"the short path took what decode refuses: {exc}") from None
    import msgpack

    def fields(m: object) -> bytes:
        # Compared encoded: a NaN in the body is the same message, though
        # NaN != NaN.
        return msgpack.packb(
            [m.kind.value, m.body, m.session, m.re, m.id, m.ts, m.ttl]  # type: ignore[attr-defined]
        )

    assert fields(fast) == fields(slow)


@given(
    field=st.sampled_from(["id", "kind", "ts", "session", "re", "body", "ttl", "extra"]),
    value=_VALUES,
    body_field=st.sampled_from(["type", "data", "turn", "replayed", "other"]),
    body_value=_VALUES,
)
def test_the_short_path_for_events_accepts_only_what_decode_accepts(
    field: str, value: object, body_field: str, body_value: object
) -> None:
    envelope = {**_GOOD_EVENT, field: value}
    _check_short_path(_signed(envelope))
    body = {**_GOOD_EVENT["body"], body_field: body_value}
    _check_short_path(_signed({**_GOOD_EVENT, "body": body}))


def test_the_short_path_takes_good_events_and_leaves_the_rest_to_decode() -> None:
    good = _signed(_GOOD_EVENT)
    assert _short_path(good) is not None
    _check_short_path(good)
    forged = [*good[:2], bytes(32), good[3]]
    other_session = _signed({**_GOOD_EVENT, "session": "t"})
    reply = _signed({**_GOOD_EVENT, "kind": "reply", "body": {"text": "x", "ok": True}})
    no_type = _signed({**_GOOD_EVENT, "body": {"data": "x"}})
    for frames in (forged, other_session, reply, no_type):
        assert _short_path(frames) is None
    assert _short_path(good, limit=len(good[3]) - 1) is None  # over the limit
