"""The router's front door is a supervisor's (door/fronts.py), with its
promises: a cap on client connections, a slow front end told what it
missed and given every answer, and sockets read in bounded batches, so
that one front end's flood keeps nobody else waiting. Real processes: one
supervisor on TCP + CURVE behind a real router process."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest

from hermes_sup.client import Client, Overloaded, Timeout
from hermes_sup.protocol import Kind, Message

from . import waiting
from .test_cli_remote import hs
from .test_clients import free_port
from .test_route import RouterProcess, router_over
from .test_slow_consumer import answers_to

wait_for = partial(waiting.wait_for, timeout=120.0, every=0.05)

RouterFactory = Callable[..., RouterProcess]


@pytest.fixture
def one_node(supervisor_factory, workdir: Path) -> Iterator[RouterFactory]:
    """factory(*route_options): a router over one supervisor, node `a`
    (one event a line: counts are exact)."""
    port = free_port()
    root = workdir / "a"
    root.mkdir()
    config = root / "node.toml"
    config.write_text('node = "a"\nstream_coalesce_ms = 0\n')
    sup = supervisor_factory("--tcp", str(port), "--config", str(config), root=root)
    conn = workdir / "router-a.json"
    made = hs("keys", "generate", "router", "--endpoint", f"127.0.0.1:{port}",
              "-o", str(conn), "--data-dir", str(sup.data_dir))  # fmt: skip
    assert made.returncode == 0, made.stderr
    lines = [f'[[node]]\nname = "a"\nconnection = "{conn}"\n']
    with contextlib.ExitStack() as stack:
        yield lambda *extra: stack.enter_context(router_over(workdir, lines, *extra, nodes=("a",)))


def pings(client: Client) -> bool:
    """Whether a ping is answered (a connection the gate counted late may
    have been refused and made again)."""
    try:
        client.ping(timeout=5)
        return True
    except (Overloaded, Timeout):
        return False


def test_a_connection_over_the_routers_cap_is_told_why(one_node: RouterFactory) -> None:
    # With --tcp, the local socket gets half of --max-clients.
    router = one_node("--max-clients", "4")
    assert "client_limit local=2 tcp=2" in router.log()
    held = [Client(router.state_dir, timeout=10) for _ in range(2)]
    try:
        for client in held:
            wait_for(partial(pings, client), what="a front end within the cap to be served")
        message = None
        for _ in range(20):  # a request before the gate counted its connection is served
            with Client(router.state_dir, timeout=5) as late:
                try:
                    late.ping()
                except Overloaded as exc:
                    message = exc.message
                    break
                except Timeout:
                    pass
        assert message is not None, "no front end over the cap was told why"
        assert "the router already has 2 client connections on its control socket" in message
        for client in held:  # those within the cap are served as before
            assert client.ping().pid == router.proc.pid
    finally:
        for client in held:
            client.close()


def test_a_slow_front_end_is_told_what_it_missed_and_gets_its_reply(
    one_node: RouterFactory,
) -> None:
    router = one_node("--client-queue", "100")
    lines = 20_000
    with Client(router.state_dir, timeout=60) as slow, Client(router.state_dir) as other:
        assert slow.run("slow", "pid").ok  # its worker is up
        req = slow.submit(Kind.SEND, {"text": f"sh seq 1 {lines}"}, session="slow")
        # It does not read while the turn streams through the router.
        wait_for(lambda: "slow_consumer " in router.log(), what="the front end to lag")
        wait_for(
            lambda: any(
                r["key"] == "slow" and r["turns"] >= 2 and r["state"] == "idle"
                for r in other.sessions()
            ),
            what="the unread turn to end",
        )
        # It reads again: what it got, then how many it missed, then its reply.
        answers = answers_to(slow, req)
        assert answers[-1].kind is Kind.REPLY and answers[-1].body["text"] == "exit 0"
        events = [m.body for m in answers[:-1]]
        got = [int(b["data"]) for b in events if b["type"] == "output"]
        dropped = [b["data"] for b in events if b["type"] == "dropped"]
        assert dropped and all(d["reason"] == "slow_consumer" for d in dropped)
        assert got == sorted(got) and len(set(got)) == len(got)
        assert len(got) + sum(d["count"] for d in dropped) == lines  # every line accounted for
        assert slow.run("slow", "pid").ok  # and it is served as before
    assert "slow_consumer_caught_up" in router.log()


def test_a_lagging_front_end_gets_an_answer_to_every_request(one_node: RouterFactory) -> None:
    router = one_node("--client-queue", "4")
    sessions, per_session = 4, 150
    with Client(router.state_dir, timeout=120) as slow, Client(router.state_dir) as watcher:
        asked = {
            slow.submit(Kind.SEND, {"text": "x" * 2000}, session=f"s{n}")
            for n in range(sessions)
            for _ in range(per_session)
        }
        # Not read until every turn is over.
        wait_for(
            lambda: (
                sum(r["turns"] for r in watcher.sessions()) >= sessions * per_session
                and all(r["state"] == "idle" for r in watcher.sessions())
            ),
            timeout=300,
            what="every turn to end",
        )
        answered: dict[str | None, Message] = {}
        while len(answered) < len(asked):
            msg = slow.next(timeout=60)
            if msg.kind is not Kind.EVENT:
                answered[msg.re] = msg
        assert set(answered) == asked
        assert {m.kind for m in answered.values()} <= {Kind.REPLY, Kind.ERROR}
    assert "slow_consumer " in router.log()


FLOODER = """
import select, sys, time
import zmq
from hermes_sup.local import statedir
from hermes_sup.protocol import Kind, Message, encode
from pathlib import Path

state = Path(sys.argv[1])
ctx = zmq.Context()
sock = ctx.socket(zmq.DEALER)
sock.setsockopt(zmq.LINGER, 0)
sock.connect(statedir.endpoint(state, statedir.CONTROL_SOCKET))
# One ping, sent again and again: the router reads, checks and answers each
# (`replayed`) as fast as it can, and never catches up with the copies.
frames = encode(Message(Kind.PING, {}), statedir.read_key(state))
sent, end = 0, time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    for _ in range(1000):
        sock.send_multipart(frames)
    sent += 1000
    if sent == 20_000:
        print("flooding", flush=True)
    if select.select([sys.stdin], [], [], 0)[0]:
        break
print(sent, flush=True)
sock.close(0)
ctx.term()
"""


def test_a_front_end_that_floods_the_router_keeps_nobody_waiting(
    one_node: RouterFactory,
) -> None:
    """The router reads a socket in bounded batches (door/channel.py): with
    one front end sending faster than it can answer, the node's answers to
    everyone else are still read between batches, not once the flood stops."""
    router = one_node()
    with Client(router.state_dir, timeout=150) as c:
        assert c.run("busy", "pid").ok  # the worker is up
        flooder = subprocess.Popen(
            [sys.executable, "-c", FLOODER, str(router.state_dir), "120"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert flooder.stdout is not None and flooder.stdin is not None
            assert flooder.stdout.readline().strip() == "flooding"
            reply = c.run("busy", "env HERMES_SESSION_KEY")
            # Answered while the flood goes on: its deadline is far off.
            flooding = flooder.poll() is None
            flooder.stdin.close()
            sent = int(flooder.stdout.readline())
        finally:
            if flooder.poll() is None:
                flooder.kill()
            flooder.wait(30)
        assert reply.text == "busy"
        assert flooding, f"the reply waited for the flood to end ({sent} messages)"
        assert c.ping().pid == router.proc.pid
