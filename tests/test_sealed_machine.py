"""A session is sealed for the machine it runs on, not only for its files
and processes: tried from a session's own shell, in the default
configuration, as root and as an unprivileged service user.

- IPC: System V segments and POSIX queues are the session's own (an IPC
  namespace of its own): no other session sees them, the host never does,
  and none outlives the session.
- The host's files: nothing outside the session's own directories is
  writable (its view of / is read-only), its /run/lock is its own.
- Its worker's memory: not readable from the session's shell (the worker
  is not dumpable), so no secret the runtime holds is.
- The network: its loopback is its own; neither the host's 127.0.0.1
  services nor another session's listeners answer, and /proc/net shows no
  host socket.
- Two supervisors on one host never hand two live sessions one uid.
Real supervisors, real workers, real shells.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from hermes_sup.seal.calls import FAULT_ENV
from hermes_sup.supervisor.sealing import SEALED_UID_BASE, SEALED_UID_COUNT

from .test_hostile_session import NOBODY, Lab, python, refused, sealed_lab, tries
from .test_sealed import sh

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="starts supervisors as root and as nobody"),
]


@pytest.fixture(params=["root", "user"])
def lab(request, supervisor_factory, workdir):  # noqa: ANN001
    yield from sealed_lab(supervisor_factory, workdir, request.param)


def test_status_says_which_kernel_mechanisms_hold(lab: Lab) -> None:
    """An operator sees what holds on this host, without reading the code."""
    with lab.client() as client:
        sealed = client.status()["sealed"]
    assert sealed["ipc_namespace"] and sealed["network_namespace"], sealed
    assert sealed["network"] == "egress" and sealed["read_only_root"], sealed
    assert not sealed["workers_dumpable"] and not sealed["warning"], sealed


# ------------------------------------------------------------------- IPC

# What a session's shell makes: a SysV segment with a known key holding a
# secret, and a POSIX message queue; printed back as it sees them.
SHM_KEY = 0x4853_5550  # "HSUP"
MAKE_IPC = f"""
    import ctypes, os
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    shm = libc.shmget({SHM_KEY}, 4096, 0o1666)
    addr = libc.shmat(shm, None, 0)
    ctypes.memmove(addr, b"ipc-secret-91", 13)
    libc.shmdt(ctypes.c_void_p(addr))
    rt = ctypes.CDLL("librt.so.1", use_errno=True)
    q = rt.mq_open(b"/hsup-queue", os.O_CREAT | os.O_RDWR, 0o666, None)
    print("made", shm, q)
    """
LOOK_IPC = f"""
    import ctypes, os
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    shm = libc.shmget({SHM_KEY}, 0, 0)
    if shm >= 0:
        addr = libc.shmat(shm, None, 0)
        print("segment", ctypes.string_at(addr, 13))
    else:
        print("no segment", ctypes.get_errno())
    rt = ctypes.CDLL("librt.so.1", use_errno=True)
    q = rt.mq_open(b"/hsup-queue", os.O_RDWR, 0, None)
    print("queue" if q >= 0 else "no queue", ctypes.get_errno())
    print(open("/proc/sysvipc/shm").read().count(chr(10)) - 1, "segments listed")
    """


def _host_segment_keys() -> set[int]:
    rows = Path("/proc/sysvipc/shm").read_text().splitlines()[1:]
    return {int(row.split()[0]) for row in rows}


def test_ipc_objects_are_the_sessions_own_and_die_with_it(lab: Lab) -> None:
    """Session A's segment and queue: invisible to session B and to the
    host, gone after `kill` (a new worker of A finds nothing)."""
    with lab.client() as client:
        made = "\n".join(sh(client, "ipc-a", python(MAKE_IPC))[1])
        assert "made" in made and "made -1" not in made, made
        own = "\n".join(sh(client, "ipc-a", python(LOOK_IPC))[1])
        assert "segment b'ipc-secret-91'" in own and "queue 0" in own, own
        other = "\n".join(sh(client, "ipc-b", python(LOOK_IPC))[1])
        assert "no segment" in other and "no queue" in other, other
        assert "0 segments listed" in other, other
        assert SHM_KEY not in _host_segment_keys()
        assert not Path("/dev/mqueue/hsup-queue").exists()
        client.kill("ipc-a")
        again = "\n".join(sh(client, "ipc-a", python(LOOK_IPC))[1])
    assert "no segment" in again and "no queue" in again, again


# ---------------------------------------------------------- host's files


@pytest.fixture
def host_dirs(lab: Lab) -> Iterator[dict[str, Path]]:
    """Directories outside any session's own that a session's uid could
    write without a read-only view: one open to everyone (as /run/lock
    is), one the service's user owns (where its venv might live)."""
    base = Path(f"/srv/hsup-host-{os.getpid()}")
    lab.host_marks.append(base)
    shared, owned = base / "shared", base / "service-venv"
    shared.mkdir(parents=True)
    owned.mkdir()
    os.chmod(base, 0o755)
    os.chmod(shared, 0o1777)
    os.chown(owned, NOBODY if lab.mode == "user" else 0, NOBODY if lab.mode == "user" else 0)
    return {"shared": shared, "owned": owned}


def test_nothing_of_the_host_is_writable_and_lock_files_die_with_the_session(
    lab: Lab, host_dirs: dict[str, Path]
) -> None:
    """/run/lock and /var/lock are the session's own tmpfs; every other
    directory of the host is read-only in its view, even one its uid owns
    (a planted sitecustomize.py would run as the service next start)."""
    lock = Path(f"/run/lock/hsup-{os.getpid()}")
    lab.host_marks.append(lock)
    shared, owned = host_dirs["shared"], host_dirs["owned"]
    with lab.client() as client:
        got = tries(
            client,
            "planter",
            {
                "shared": f"echo x > {shared}/dropped",
                "owned": f"echo 'import os' > {owned}/sitecustomize.py",
                "etc": "echo x > /etc/hsup-planted",
            },
        )
        for name, lines in got.items():
            assert refused(lines), (name, lines)
            assert "Read-only file system" in "\n".join(lines) or lab.mode == "root", lines
        text, lines = sh(client, "planter", f"echo held > {lock} && cat {lock} && echo rc=$?")
        assert lines[-1] == "rc=0" and "held" in lines, lines
        # Its own directories stay writable.
        assert sh(client, "planter", "echo ok > here && cat here")[1] == ["ok"]
        assert not lock.exists()  # its own /run/lock, not the host's
        client.kill("planter")
    assert not lock.exists()
    assert not (shared / "dropped").exists() and not (owned / "sitecustomize.py").exists()
    assert not Path("/etc/hsup-planted").exists()


# ------------------------------------------------------- worker's memory


READ_WORKER = """
    import re
    for name in ("environ", "maps", "mem"):
        try:
            if name == "mem":
                maps = open("/proc/1/maps").read()
                start = int(maps.split("-")[0], 16)
                with open("/proc/1/mem", "rb") as f:
                    f.seek(start)
                    data = f.read(64)
            else:
                data = open(f"/proc/1/{name}", "rb").read()
            print(name, "read", len(data))
        except OSError as exc:
            print(name, "refused", exc.errno)
    """


def test_the_worker_is_not_dumpable_from_its_own_session(lab: Lab) -> None:
    """The session's shell runs as its worker's uid: only the worker being
    non-dumpable keeps its memory (and any key the runtime holds) out of
    the shell's reach."""
    with lab.client() as client:
        client.run("nosy", "setenv HSUP_WORKER_SECRET worker-held-3c1f")
        text, lines = sh(client, "nosy", python(READ_WORKER))
    out = "\n".join(lines)
    for name in ("environ", "maps", "mem"):
        assert f"{name} refused" in out, out
    assert "worker-held-3c1f" not in out


# ------------------------------------------------------------- network


@pytest.fixture
def host_service() -> Iterator[int]:
    """A secret-telling service on the host's 127.0.0.1 (as a Redis with no
    auth would be), until the test ends."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(b"host-service-secret\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield int(server.getsockname()[1])
    stop.set()
    thread.join()
    server.close()


CONNECT = """
    import socket
    try:
        with socket.create_connection(("127.0.0.1", PORT), timeout=10) as s:
            print("reached", s.recv(100))
    except OSError as exc:
        print("refused", exc.errno)
    """


def test_the_sessions_loopback_is_its_own(lab: Lab, host_service: int) -> None:
    """Neither the host's 127.0.0.1 service nor a neighbour session's
    listener answers; /proc/net lists no socket of the host's."""
    with lab.client() as client:
        # A listener in the neighbour session, held by a child of its own
        # once the shell's output is closed.
        listen = python("""
            import os, socket
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen()
            print(s.getsockname()[1], flush=True)
            if os.fork() == 0:
                os.setsid()
                for fd in (0, 1, 2):
                    os.close(fd)
                s.settimeout(120)
                conn, _ = s.accept()
                conn.sendall(b"neighbour-secret")
            """)
        port = int(sh(client, "neighbour", listen)[1][0])
        got = {
            "host": sh(client, "intruder", python(CONNECT.replace("PORT", str(host_service))))[1],
            "neighbour": sh(client, "intruder", python(CONNECT.replace("PORT", str(port))))[1],
        }
        text, rows = sh(client, "intruder", "cat /proc/net/tcp /proc/net/tcp6 /proc/net/unix")
    for name, lines in got.items():
        assert any(line.startswith("refused") for line in lines), (name, lines)
    seen = "\n".join(rows)
    assert "secret" not in str(got)
    # The host's listener (and its unix sockets, the supervisor's among
    # them) are not the session's to list.
    assert f":{host_service:04X}" not in seen, seen
    # Unix sockets: only its worker's own connection to the supervisor
    # (the kernel lists the accepted end in the connecting namespace).
    paths = [row.split()[7] for row in rows if row[:1] == "0" and len(row.split()) > 7]
    assert set(paths) <= {str(lab.state_dir / "workers.sock")}, paths


# ------------------------------------------------------------------- uids


def test_two_supervisors_on_one_host_never_share_a_sealed_uid(
    supervisor_factory,  # noqa: ANN001
    workdir: Path,
) -> None:
    """The same key in two supervisors (as two services on one host would
    have) runs as two uids: the uid a key maps to is taken host-wide."""
    if os.geteuid() != 0:
        pytest.skip("sealed sessions run as uids of their own only as root")
    uids = []
    for name in ("one", "two"):
        (workdir / name).mkdir()
        sup = supervisor_factory(root=workdir / name)
        with sup.client(timeout=60.0) as client:
            uids.append(int(sh(client, "same-key", "id -u")[1][0]))
    assert uids[0] != uids[1], uids
    for uid in uids:
        assert SEALED_UID_BASE <= uid < SEALED_UID_BASE + SEALED_UID_COUNT


def test_where_no_network_namespace_can_be_made_auto_says_so_and_on_refuses(
    supervisor_factory,  # noqa: ANN001
    workdir: Path,
    host_service: int,
) -> None:
    """A host that lets us seal but not make network namespaces: `auto`
    seals with the host's network, and says so at start and in `status`;
    `on` refuses to start, naming the cause and the setting to change."""
    env = {**os.environ, FAULT_ENV: "network"}
    sup = supervisor_factory(env=env)
    with sup.client(timeout=60) as client:
        sealed = client.status()["sealed"]
        assert sealed["mode"] and sealed["network"] == "host", sealed
        assert not sealed["network_namespace"] and "injected" in sealed["network_reason"]
        assert "host's network" in sealed["warning"], sealed
        reached = sh(client, "k", python(CONNECT.replace("PORT", str(host_service))))[1]
    assert any(line.startswith("reached") for line in reached), reached
    assert "sessions_share_host_network" in sup.log()
    (workdir / "on").mkdir()
    refusing = supervisor_factory("--sealed", "on", env=env, start=False, root=workdir / "on")
    refusing.start(wait=False)
    assert refusing.proc is not None and refusing.proc.wait(timeout=60) != 0
    assert 'network = "host"' in refusing.log() and "ready" not in refusing.log()
