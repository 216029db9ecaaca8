"""A session is hostile. Its agent has a shell, steered by text that
strangers write; here that shell tries, as an attacker would, to reach
other sessions, the supervisor and the host, in the default configuration,
run as root and as an unprivileged service user. Every try must be
refused: nothing of another session, the supervisor or the host is
readable, writable or signalable from a session. Real supervisors, real
workers, real shells."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from hermes_sup.client import Client
from hermes_sup.local.syscalls import LANDLOCK_SCOPE_ABI, landlock_abi
from hermes_sup.protocol import session_dir_name
from hermes_sup.seal.calls import FAULT_ENV
from hermes_sup.worker import seal

from .test_sealed import as_nobody_with_the_interpreter_reachable, sh
from .waiting import wait_for

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="starts supervisors as root and as nobody"),
]

NOBODY = 65534
# In the supervisor's environment: no session may ever read them.
OPERATOR_SECRET = "operator-secret-7f3a9c"
MODEL_KEY = "sk-model-key-5e1d0b"


@dataclass
class Lab:
    """A supervisor in the default configuration, and what an attacker may
    know of it (its directories, its pids, its ports)."""

    sup: object
    mode: str  # "root" or "user": who the supervisor runs as
    tcp_port: int
    host_marks: list[Path]  # files an attack would leave on the host

    def client(self, timeout: float = 60.0) -> Client:
        return self.sup.client(timeout=timeout)  # type: ignore[attr-defined,no-any-return]

    @property
    def state_dir(self) -> Path:
        return self.sup.state_dir  # type: ignore[attr-defined,no-any-return]

    @property
    def data_dir(self) -> Path:
        return self.sup.data_dir  # type: ignore[attr-defined,no-any-return]

    def workspace(self, key: str) -> Path:
        return self.data_dir / "sessions" / session_dir_name(key) / "workspace"

    def mark(self, name: str) -> Path:
        """A host path an attack would create, removed after the test."""
        path = Path(name)
        self.host_marks.append(path)
        return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_lab(supervisor_factory, workdir: Path, mode: str, *args: str) -> Lab:  # noqa: ANN001
    """A supervisor with nothing but its defaults (and a CURVE port), the
    operator's secrets in its environment and a home of the operator's
    with a memory provider's config in it."""
    operator_home = workdir / "operator-home"
    (operator_home / ".honcho").mkdir(parents=True)
    (operator_home / ".honcho" / "config.json").write_text(
        json.dumps({"apiKey": OPERATOR_SECRET, "workspace": "operator", "peerName": "operator"})
    )
    env = {
        **os.environ,
        "HOME": str(operator_home),
        "OPERATOR_SECRET": OPERATOR_SECRET,
        "OPENAI_API_KEY": MODEL_KEY,
    }
    port = free_port()
    sup = supervisor_factory("--tcp", f"127.0.0.1:{port}", *args, env=env, start=False)
    if mode == "user":
        for root, dirs, files in os.walk(workdir):
            for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
                os.lchown(name, NOBODY, NOBODY)
        sup.start(preexec_fn=as_nobody_with_the_interpreter_reachable)
    else:
        sup.start()
    return Lab(sup, mode, port, [])


def require_sealed(lab: Lab) -> None:
    """Fail before any attack where sessions are not sealed: unsealed, as
    root, they would succeed against this very machine (kill -KILL -1)."""
    with lab.client() as client:
        sealed = client.status().get("sealed") or {}
    if not sealed.get("mode"):
        pytest.fail(f"sessions are not sealed here, so the attacks are not run: {sealed}")


def test_the_default_configuration_is_sealed(lab: Lab) -> None:
    """What every other test here runs against: no sealing flag, sealed."""
    with lab.client() as client:
        sealed = client.status()["sealed"]
    assert sealed["mode"] == lab.mode and sealed["asked"] == "auto", sealed
    assert sealed["pid_namespaces"] and sealed["syscall_filter"] and not sealed["warning"]
    assert f"sealed mode={lab.mode}" in lab.sup.log()  # type: ignore[attr-defined]


def sealed_lab(supervisor_factory, workdir: Path, mode: str) -> Iterator[Lab]:  # noqa: ANN001
    """A sealed Lab for a test, and the host paths its attacks left removed
    after it (the body of every `lab` fixture)."""
    made = start_lab(supervisor_factory, workdir, mode)
    require_sealed(made)
    yield made
    for path in made.host_marks:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


@pytest.fixture(params=["root", "user"])
def lab(request, supervisor_factory, workdir):  # noqa: ANN001
    yield from sealed_lab(supervisor_factory, workdir, request.param)


def refused(lines: list[str]) -> bool:
    """The `echo rc=$?` a command line ends with says it failed."""
    return bool(lines) and lines[-1].startswith("rc=") and lines[-1] != "rc=0"


def tries(client, key: str, commands: dict[str, str]) -> dict[str, list[str]]:  # noqa: ANN001
    """Run each command in the session's shell; name -> its output lines,
    the last being rc=<its exit status>."""
    return {
        name: sh(client, key, f"{{ {command}\n}} 2>&1; echo rc=$?")[1]
        for name, command in commands.items()
    }


def python(code: str) -> str:
    """A shell command running `code` with the service's own interpreter
    (the one place a session's view shows it)."""
    return f"{sys.executable} - <<'EOF'\n{textwrap.dedent(code)}\nEOF"


# ------------------------------------------------------------ the supervisor


def test_the_supervisors_key_sockets_and_state_are_out_of_reach(lab: Lab) -> None:
    """Without the key and the control socket no session can drive another
    (today's unsealed default let a session's shell run `hermes-sup send
    victim ...`)."""
    state = lab.state_dir
    with lab.client() as client:
        assert client.run("victim", "write secret.txt victim-data").ok
        got = tries(
            client,
            "attacker",
            {
                "key": f"cat {state}/hmac.key",
                "listing": f"ls -A {state} | grep .",
                # What status believes of a supervisor still starting (statedir.py).
                "starting": f'echo \'{{"stage": "forged"}}\' > {state}/starting.json '
                f"&& cat {state}/starting.json",
                "control": f"{sys.executable} -m hermes_sup.cli --state-dir {state} "
                "send victim 'sh cat secret.txt > stolen.txt'",
                "connect": python(f"""
                    import socket, sys
                    for name in ("control.sock", "workers.sock"):
                        s = socket.socket(socket.AF_UNIX)
                        try:
                            s.connect("{state}/" + name)
                        except OSError as exc:
                            print(name, exc)
                        else:
                            sys.exit(name + " connected")
                    sys.exit(1)
                    """),
            },
        )
        for name, lines in got.items():
            assert refused(lines), (name, lines)
        key = (state / "hmac.key").read_bytes()
        assert key.hex() not in str(got) and key.decode(errors="replace") not in str(got)
    assert not (lab.workspace("victim") / "stolen.txt").exists()


def test_no_environment_but_its_own_is_readable(lab: Lab) -> None:
    """The operator's secrets and the model's key are in the supervisor's
    environment; no process a session can see holds them."""
    with lab.client() as client:
        zygote = client.status()["zygote_pid"]
        text, lines = sh(
            client,
            "nosy",
            "cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n' | sort -u; "
            f"cat /proc/{lab.sup.pid}/environ /proc/{zygote}/environ 2>&1; "  # type: ignore[attr-defined]
            "env; cat ~/.honcho/config.json 2>&1",
        )
    out = "\n".join(lines)
    assert OPERATOR_SECRET not in out and MODEL_KEY not in out, out
    assert "HERMES_SESSION_KEY=nosy" in out  # it read what it may: its own


# ---------------------------------------------------------- other sessions


VICTIM_ARGS = "victim-password-31337"


def test_other_sessions_files_and_processes_are_invisible(lab: Lab) -> None:
    """`ps`, /proc and the data directory show a session nothing of another:
    not its key, its files, its command lines or its environment."""
    with lab.client() as client:
        assert client.run("victim", "write secret.txt victim-data").ok
        client.open("victim2", options={"env": {"VICTIM_TOKEN": "victim-env-42"}})
        assert client.run("victim2", f"sh sleep 300 {VICTIM_ARGS} >/dev/null 2>&1 &").ok
        pids = {r["key"]: r["pid"] for r in client.sessions()}
        commands = {
            "sessions": f"ls {lab.data_dir}/sessions",
            "files": f"cat {lab.workspace('victim')}/secret.txt",
        }
        for name, pid in (("victim", pids["victim"]), ("victim2", pids["victim2"])):
            commands[f"{name}-root"] = f"ls /proc/{pid}/root/"
            commands[f"{name}-environ"] = f"cat /proc/{pid}/environ"
            commands[f"{name}-cmdline"] = f"cat /proc/{pid}/cmdline"
            commands[f"{name}-mem"] = f"head -c 64 /proc/{pid}/mem"
        got = tries(client, "attacker", commands)
        # What ps and /proc show it, whole.
        text, lines = sh(
            client,
            "attacker",
            "ps axww; cat /proc/[0-9]*/cmdline /proc/[0-9]*/environ | tr '\\0' ' '; "
            "echo; ls /proc | grep -c '^[0-9]'",
        )
    # The sessions' directory shows it nothing, or only its own directory.
    listed = got.pop("sessions")
    assert refused(listed) or listed == [session_dir_name("attacker"), "rc=0"], listed
    for name, attempt in got.items():
        assert refused(attempt), (name, attempt)
    seen = "\n".join(lines + [line for attempt in got.values() for line in attempt])
    for secret in ("victim-data", VICTIM_ARGS, "victim-env-42", "worker victim"):
        assert secret not in seen, (secret, seen)
    # Its own processes only: the worker (its PID namespace's 1), the shell,
    # ps, cat, ls and grep.
    assert int(lines[-1]) < 10, seen


def test_a_session_cannot_rewrite_what_became_of_its_turns(lab: Lab) -> None:
    """The turn journal (what makes a repeat of a turn id answered, never
    run again) is in the session's own directory, which its shell sees
    read-only: no record can be forged, dropped or replaced from there."""
    own = lab.data_dir / "sessions" / session_dir_name("forger")
    with lab.client() as client:
        assert client.run("forger", "echo first", turn_id="forger-1").ok
        got = tries(
            client,
            "forger",
            {
                "append": f"printf '\\x83' >> {own}/turns",
                "truncate": f"truncate -s 0 {own}/turns",
                "remove": f"rm -f {own}/turns",
                "replace": f"cp /dev/null {own}/t && mv -f {own}/t {own}/turns",
            },
        )
        for name, attempt in got.items():
            assert refused(attempt), (name, attempt)
        state = client.turn_status("forger", "forger-1")
        assert state["state"] == "ended" and state["outcome"]["body"]["text"] == "echo first"


def test_nothing_outside_the_session_can_be_signalled_or_traced(lab: Lab) -> None:
    with lab.client() as client:
        client.run("victim", "pid")
        pids = {r["key"]: r["pid"] for r in client.sessions()}
        targets = {
            "supervisor": lab.sup.pid,  # type: ignore[attr-defined]
            "zygote": client.status()["zygote_pid"],
            "victim": pids["victim"],
        }
        commands = {f"kill-{n}": f"kill -0 {pid}" for n, pid in targets.items()}
        commands.update(
            {
                f"trace-{n}": python(f"""
                    import ctypes, os, sys
                    libc = ctypes.CDLL(None, use_errno=True)
                    if libc.ptrace(16, {pid}, 0, 0) != 0:  # PTRACE_ATTACH
                        sys.exit(os.strerror(ctypes.get_errno()))
                    """)
                for n, pid in targets.items()
            }
        )
        # Everything it may signal: its own processes (kill -1 skips the
        # caller and, inside the namespace, its init: the worker).
        commands["kill-all"] = "kill -KILL -1; false"
        got = tries(client, "attacker", commands)
        for name, lines in got.items():
            assert refused(lines), (name, lines)
        # Its own worker ignores what its shell sends it (a PID namespace's
        # init gets only the signals it handles), and lives on.
        own = [r["pid"] for r in client.sessions() if r["key"] == "attacker"][0]
        sh(client, "attacker", "kill -KILL 1; kill -STOP 1; echo sent")
        assert client.run("attacker", "pid").text == str(own)
        assert client.run("victim", "pid").text == str(pids["victim"])
        assert client.ping().pid == lab.sup.pid  # type: ignore[attr-defined]


def test_home_tmp_and_shm_are_each_sessions_own(lab: Lab) -> None:
    """One shared ~/.gitconfig held every session's `git config --global`:
    one chat's commit identity became everyone's."""
    name = f"a-mark-{os.getpid()}"
    marks = (f"/tmp/{name}", f"/dev/shm/{name}", f"/var/tmp/{name}", "~/a-home")
    for mark in marks[:3]:
        lab.mark(mark)  # removed after the test, should the attack succeed
    with lab.client() as client:
        text, lines = sh(
            client,
            "a",
            "git config --global user.name A-only; "
            + "; ".join(f"echo a > {m}" for m in marks)
            + "; git config --global user.name; "
            + "; ".join(f"test -e {m} && echo has {i}" for i, m in enumerate(marks)),
        )
        assert lines == ["A-only", *(f"has {i}" for i in range(len(marks)))], lines  # its own
        text, lines = sh(
            client,
            "b",
            "git config --global user.name; "
            + "; ".join(f"test -e {m} && echo has {i}" for i, m in enumerate(marks))
            + "; echo done",
        )
    assert lines == ["done"], lines
    for mark in marks[:3]:
        assert not Path(mark).exists(), mark
    assert not (lab.data_dir.parent / "operator-home" / ".gitconfig").exists()


# ------------------------------------------------------------ descriptors


FLOOD = """
import os, socket
# The supervisor's unix sockets, as the machine lists them (/proc/net/unix
# is the network namespace's, which sessions share), and the descriptors of
# every process this session can see (its worker's).
paths = set()
with open("/proc/net/unix") as f:
    next(f)
    for line in f:
        fields = line.split()
        if len(fields) > 7 and fields[7].startswith(STATE):
            paths.add(fields[7])
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                paths.add(f"/proc/{pid}/fd/{fd}")
        except OSError:
            pass
held, opened = [], 0
for path in sorted(paths):
    for _ in range(50):
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(path)
        except OSError:
            s.close()
            break
        opened += 1
        held.append(s)
print("supervisor-sockets", sum(STATE in p for p in paths))
print("connected", opened)
"""


def test_no_descriptor_of_the_supervisor_can_be_taken_from_a_session(lab: Lab) -> None:
    """A session flooding the workers' socket with connections took the
    supervisor past its descriptor limit: libzmq aborted and every session
    died. From inside a session no supervisor socket is reachable at all,
    its TCP port included (the session's network is its own)."""
    sup = psutil.Process(lab.sup.pid)  # type: ignore[attr-defined]
    with lab.client() as client:
        client.run("victim", "pid")
        client.run("attacker", "pid")
        spares = client.status()["spare_workers"]  # made again behind the two
        wait_for(lambda: client.status()["spare_workers"] >= spares, 30.0, what="spares")
        before = sup.num_fds()
        text, lines = sh(
            client, "attacker", python(FLOOD.replace("STATE", repr(str(lab.state_dir))))
        )
        out = "\n".join(lines)
        # It found the supervisor's sockets listed, and reached none of them.
        assert "connected 0" in out and "supervisor-sockets 0" not in out, out
        # The TCP port (reachable on purpose by remote front ends) is not
        # the session's to reach: its loopback is its own network's.
        text, lines = sh(
            client,
            "attacker",
            python(f"""
                import socket
                try:
                    socket.create_connection(("127.0.0.1", {lab.tcp_port}), timeout=10)
                except OSError as exc:
                    print("refused", exc.errno)
                else:
                    print("connected")
                """),
        )
        assert "refused" in "\n".join(lines), lines
        assert client.run("victim", "pid").ok and client.ping().pid == sup.pid
        wait_for(lambda: sup.num_fds() <= before + 8, 30.0, what="the supervisor's fds to settle")


ABSTRACT = b"\0hermes-sup-hostile-"


def test_abstract_sockets_outside_the_session_are_out_of_reach(lab: Lab) -> None:
    """Abstract unix sockets have no path to hide: Landlock's scope (Linux
    6.12+) refuses a session's connect to one made outside it."""
    if landlock_abi() < LANDLOCK_SCOPE_ABI:
        pytest.skip("this kernel has no Landlock scope (docs/security.md)")
    name = ABSTRACT + str(os.getpid()).encode()
    with socket.socket(socket.AF_UNIX) as host:
        host.bind(name)
        host.listen()
        with lab.client() as client:
            got = tries(
                client,
                "attacker",
                {
                    "abstract": python(f"""
                        import socket
                        socket.socket(socket.AF_UNIX).connect({name!r})
                        """)
                },
            )
    assert refused(got["abstract"]), got


# ------------------------------------------------------------ the kernel


def test_kernel_facilities_and_the_host_are_refused(lab: Lab) -> None:
    code = Path(seal.__file__).resolve().parent
    etc = lab.mark(f"/etc/hermes-sup-hostile-{os.getpid()}")
    usr = lab.mark(f"/usr/hermes-sup-hostile-{os.getpid()}")
    in_code = lab.mark(str(code / f"hostile-{os.getpid()}.py"))
    with lab.client() as client:
        got = tries(
            client,
            "attacker",
            {
                "mount": "mkdir -p m && mount -t tmpfs none m",
                "unshare-user": "unshare -r true",
                "unshare-mount": "unshare -m true",
                "keyctl": python("""
                    import ctypes, os, sys
                    libc = ctypes.CDLL(None, use_errno=True)
                    # keyctl(KEYCTL_GET_KEYRING_ID, KEY_SPEC_USER_KEYRING, 0)
                    if libc.syscall(250 if os.uname().machine == "x86_64" else 219,
                                    0, -4, 0) < 0:
                        sys.exit(os.strerror(ctypes.get_errno()))
                    """),
                "setuid": "su -c id root </dev/null",
                "proc-sys": "echo 1 > /proc/sys/vm/drop_caches",
                "etc": f"echo x > {etc}",
                "usr": f"echo x > {usr}",
                "code": f"echo x > {in_code}",
                "data": f"echo x > {lab.data_dir}/planted",
                "dmesg": "dmesg | head -1 | grep .",
            },
        )
    for name, lines in got.items():
        assert refused(lines), (name, lines)
    for path in (etc, usr, in_code, lab.data_dir / "planted"):
        assert not path.exists(), path


def test_a_fork_bomb_and_a_runaway_write_are_stopped_by_the_kernel(
    supervisor_factory, workdir: Path
) -> None:
    """A fork bomb got 1,002 processes before the sampler recycled it, and
    a session wrote 1 GiB in 4 s. Now the kernel refuses the fork past
    max_procs, a file past file_size_limit_mb, and /tmp past tmp_limit_mb;
    everyone else is served meanwhile."""
    lab = start_lab(
        supervisor_factory,
        workdir,
        "root",
        "--max-procs",
        "40",
        "--file-size-limit",
        "8",
        "--tmp-limit",
        "16",
    )
    require_sealed(lab)
    with lab.client() as client:
        client.run("victim", "pid")
        worker = int(client.run("bomb", "pid").text)
        text, lines = sh(client, "bomb", "for i in $(seq 100); do sleep 60 & done; echo spawned")
        assert "Cannot fork" in "\n".join(lines), lines
        # Counted from the host: its processes and threads, the worker's
        # own among them, stay within the limit.
        tree = psutil.Process(worker).children(recursive=True)
        assert len(tree) < 40, len(tree)
        assert client.run("victim", "pid").ok
        client.kill("bomb")
        got = tries(
            client,
            "writer",
            {
                "file": "head -c 20000000 /dev/zero > big",
                "tmp": "head -c 7000000 /dev/zero > /tmp/one; head -c 7000000 /dev/zero > "
                "/tmp/two; head -c 7000000 /dev/zero > /dev/shm/three",
            },
        )
        assert refused(got["file"]) and "File size limit exceeded" in "\n".join(got["file"])
        assert refused(got["tmp"]) and "No space left" in "\n".join(got["tmp"])
        big = lab.workspace("writer") / "big"
        assert big.stat().st_size <= 8 * 1024 * 1024
        assert client.run("victim", "pid").ok
    log = lab.sup.log()  # type: ignore[attr-defined]
    assert 'processes="40, kernel' in log and 'tmp="16 MiB, kernel' in log


# ---------------------------------------------------------------- git


# ---------------------------------------------------------------- memory


@pytest.mark.skipif(
    importlib.util.find_spec("run_agent") is None, reason="hermes-agent is not installed"
)
def test_the_operators_memory_provider_config_is_not_a_sessions(lab: Lab) -> None:
    """A session without its own honcho.json fell back to the operator's
    ~/.honcho/config.json: every session used the operator's Honcho
    workspace and key. Hermes's own resolution, run in a session, now finds
    nothing of the operator's."""
    with lab.client() as client:
        text, lines = sh(
            client,
            "memory",
            python("""
                from plugins.memory.honcho.client import HonchoClientConfig, resolve_config_path
                config = HonchoClientConfig.from_global_config()
                print("path", resolve_config_path(), "exists", resolve_config_path().exists())
                print("key", config.api_key, "workspace", config.workspace_id)
                """),
        )
    out = "\n".join(lines)
    assert OPERATOR_SECRET not in out and "workspace operator" not in out, out
    assert "exists False" in out, out


# ------------------------------------------------------------- the boundary


def test_a_supervisor_that_cannot_seal_says_so_everywhere(supervisor_factory) -> None:
    """Where sessions cannot be sealed, auto runs them unsealed: start,
    status and list say so, naming the cause and the fix."""
    env = {**os.environ, FAULT_ENV: "unshare"}
    sup = supervisor_factory(env=env)
    with sup.client() as client:
        warning = client.status()["sealed"]["warning"]
        client.run("s", "pid")
    assert "sessions run unsealed" in warning and "injected failure" in warning
    assert "sealed_unavailable" in sup.log()
    listed = subprocess.run(
        [sys.executable, "-m", "hermes_sup.cli", "--state-dir", str(sup.state_dir), "list"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert listed.returncode == 0 and "warning: sessions run unsealed" in listed.stderr
    status = subprocess.run(
        [sys.executable, "-m", "hermes_sup.cli", "--state-dir", str(sup.state_dir), "status"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "WARNING:" in status.stdout and "sessions run unsealed" in status.stdout


def test_sealed_on_refuses_where_a_pid_namespace_cannot_be_made(supervisor_factory) -> None:
    """Nothing starts half-sealed: a kernel that refuses the session's own
    /proc fails sealed = on at start, naming the step."""
    env = {**os.environ, FAULT_ENV: "proc"}
    sup = supervisor_factory("--sealed", "on", env=env, start=False)
    sup.start(wait=False)
    assert sup.proc.wait(60) != 0  # type: ignore[attr-defined]
    assert "proc failed" in sup.log() and "sealed = on" in sup.log()
