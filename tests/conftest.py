"""Shared fixtures: a real supervisor, and checks that tests leave nothing behind.

Every end-to-end test runs its supervisor on a short private directory under
/tmp (unix socket paths are limited to 107 bytes). After the test, any
process whose command line, working directory or environment mentions that
directory is a leak: the test fails, and the leaked processes (ours, found
by pid) are killed so they do not poison the next test.

A supervisor that a test starts dies with the test's process (a parent-death
signal), and one that does not get ready is killed with everything under
it. Waits for readiness allow for a loaded machine: their deadline grows
with the run queue per CPU, and moves on while the supervisor still uses
CPU (starting slowly, not stuck).

A test that uses a fixture which starts real processes of ours (a
supervisor, and so its zygote and workers) is marked e2e here, whether it
says so or not: `pytest -m "not e2e"` then starts none of them.

Hypothesis runs under one of two profiles: `full` (the default, what CI
runs) hunts with many examples, `fast` (`make test-fast`,
`--hypothesis-profile fast`) with few, so that a property test costs the
fast tier about what a plain test does, loaded machine or not.

A suite started with SIGINT ignored (`nohup make test &`, a job runner, a
background job of a script) would hand that ignore to every process a test
starts, and a test that stops a command with SIGINT would wait for it in
vain: the ignore is replaced here by a handler, which exec resets to the
default in every child.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path

import psutil
import pytest
import zmq

from hermes_sup.client import Client, NotRunning, Timeout
from hermes_sup.local.prctl import PR_SET_PDEATHSIG, prctl
from hermes_sup.supervisor.cgroups import clear_left_groups

from .waiting import load_factor

# Fixtures that start a real supervisor or other real processes of ours,
# used directly or through another fixture (`supervisor`, `remote`, `web`
# and `hermes` all stand on `supervisor_factory`). `bench` (test_bench.py)
# starts the benchmark's supervisor and its peers' forked workers;
# `service_python` (test_service.py) builds a venv to run `serve` as
# another user.
E2E_FIXTURES = frozenset({"supervisor_factory", "bench", "service_python"})

# For a module of tests of the real Hermes agent. Its package is looked up,
# not imported: every run collects these modules, and Hermes's import takes
# a second that a run which deselects them should not pay.
needs_hermes = pytest.mark.skipif(
    find_spec("run_agent") is None, reason="hermes-agent is not installed"
)

# Examples per property test in each tier. `full` keeps what the property
# tests asked for before profiles (300-400); `fast` finds the common bugs
# and leaves the long hunt to the full tier.
FULL_EXAMPLES = 300
FAST_EXAMPLES = 25


# tryfirst: the profiles must exist before hypothesis's own plugin loads
# the one `--hypothesis-profile` names.
@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Register the hypothesis profiles, and give children SIGINT's default."""
    register_hypothesis_profiles()
    let_children_take_sigint()


def register_hypothesis_profiles() -> None:
    """`full` (loaded by default) and `fast`; `--hypothesis-profile` picks one.

    Neither has a deadline, and neither fails a test for slow data
    generation: both measure the machine's load, not the code."""
    # Before any test module: a property test takes the profile loaded when
    # its module is imported (hypothesis reads the default at decoration).
    from hypothesis import HealthCheck, settings

    common = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
    settings.register_profile("full", max_examples=FULL_EXAMPLES, **common)
    settings.register_profile("fast", max_examples=FAST_EXAMPLES, **common)
    settings.load_profile("full")  # the plugin loads --hypothesis-profile after this


def let_children_take_sigint() -> None:
    """Replace an inherited SIGINT ignore by a handler that does nothing.

    This process still ignores SIGINT, as whoever started it wanted; a
    caught signal, unlike an ignored one, is reset to the default by exec,
    so a command a test starts and then stops with SIGINT stops."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, ignore_signal)


def ignore_signal(signum: int, frame: object) -> None:
    """A SIGINT to the test process itself, which its starter ignored."""


# tryfirst: the marks must be on before `-m` deselects by them.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark e2e every test whose fixtures (their whole closure) start real processes."""
    for item in items:
        if E2E_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.e2e)


def processes_mentioning(marker: str) -> list[psutil.Process]:
    """Live (non-zombie) processes whose cmdline, cwd or environment contains `marker`."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        if proc.pid == os.getpid() or proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            cmdline = " ".join(proc.info["cmdline"] or [])
            if marker in cmdline or marker in proc.cwd():
                found.append(proc)
                continue
            if any(marker in v for v in proc.environ().values()):
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def wait_gone(marker: str, timeout: float) -> list[psutil.Process]:
    """Wait until no process mentions `marker`; return the survivors."""
    deadline = time.monotonic() + timeout
    while True:
        left = processes_mentioning(marker)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def cpu_seconds(pids: list[int]) -> float:
    """CPU time used by these processes and their descendants (those still there)."""
    total = 0.0
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            for p in [proc, *proc.children(recursive=True)]:
                t = p.cpu_times()
                total += t.user + t.system
        except psutil.Error:
            continue
    return total


def kill_tree(pid: int, marker: str | None = None) -> None:
    """SIGKILL a process of ours and everything under it, and every process
    that mentions `marker` (a test's own directory: serve's HTTP keeper is
    double-forked away from the supervisor). Each is stopped before its
    children are listed, so that none forks a child we do not see."""
    found: dict[int, psutil.Process] = {}
    todo: list[psutil.Process] = []
    with contextlib.suppress(psutil.Error):
        todo.append(psutil.Process(pid))
    if marker is not None:
        todo += processes_mentioning(marker)
    while todo:
        proc = todo.pop()
        if proc.pid in found:
            continue
        found[proc.pid] = proc
        try:
            proc.suspend()
            todo += proc.children()
        except psutil.Error:
            continue
    for proc in found.values():
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(list(found.values()), timeout=5)


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A short private directory for one test; fails the test if any process
    that mentions it outlives the test."""
    path = Path(tempfile.mkdtemp(prefix="hst-", dir="/tmp"))
    yield path
    survivors = wait_gone(str(path), timeout=5.0)
    for proc in survivors:
        try:
            proc.kill()
        except psutil.Error:
            pass
    shutil.rmtree(path, ignore_errors=True)
    if survivors:
        names = ", ".join(f"{p.pid}" for p in survivors)
        pytest.fail(f"processes outlived the test: {names}")


@pytest.fixture
def zmq_context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    """A zmq context that must terminate within 5 s at teardown (sockets closed, linger 0)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    done = threading.Event()

    def term() -> None:
        ctx.term()
        done.set()

    threading.Thread(target=term, daemon=True).start()
    if not done.wait(5.0):
        pytest.fail("zmq context did not terminate: a socket was left open")


class Supervisor:
    """A real `hermes-sup serve` process for one test."""

    def __init__(self, root: Path, args: list[str], env: dict[str, str] | None) -> None:
        self.root = root
        self.state_dir = root / "s"
        self.data_dir = root / "d"
        self.log_path = root / "supervisor.log"
        self.args = args
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, wait: bool = True, preexec_fn=None) -> Supervisor:  # noqa: ANN001
        """Start the supervisor and wait until it answers a ping."""
        env = dict(os.environ if self.env is None else self.env)
        cmd = [
            sys.executable,
            "-m",
            "hermes_sup.cli",
            "--state-dir",
            str(self.state_dir),
            "serve",
            "--data-dir",
            str(self.data_dir),
            *self.args,
        ]
        self._log = open(self.log_path, "ab")  # noqa: SIM115

        def prepare() -> None:
            if preexec_fn is not None:
                preexec_fn()
            # After it: a change of user clears the parent-death signal. A
            # test killed outright takes its supervisor with it, and the
            # supervisor's workers and keeper follow it.
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)

        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, preexec_fn=prepare
        )
        if wait:
            try:
                self.wait_ready()
            except BaseException:
                self.kill()
                raise
        return self

    def wait_ready(self, timeout: float = 20.0) -> None:
        """Block until the supervisor answers, or fail with its log.

        `timeout` is for an idle machine: it is stretched by the load
        (`load_factor`), and past it the wait goes on, up to four times
        longer, as long as the supervisor's processes keep using CPU."""
        assert self.proc is not None
        started = time.monotonic()
        deadline = started + timeout * load_factor()
        last_cpu = cpu_seconds([self.proc.pid])
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"supervisor exited early:\n{self.log()}")
            try:
                with Client(self.state_dir, timeout=1.0) as c:
                    c.ping()
                return
            except (NotRunning, Timeout):
                time.sleep(0.02)
            now = time.monotonic()
            if now < deadline:
                continue
            cpu = cpu_seconds([self.proc.pid])
            if cpu > last_cpu and now - started < 4 * timeout * load_factor():
                last_cpu, deadline = cpu, now + 1.0  # still working: a second more
                continue
            raise AssertionError(
                f"supervisor did not get ready in {now - started:.0f}s:\n{self.log()}"
            )

    def kill(self) -> None:
        """SIGKILL the supervisor and everything it started (ours only, by pid)."""
        if self.proc is None:
            return
        kill_tree(self.proc.pid, str(self.root))
        self.proc.wait()
        self._log.close()

    def client(self, timeout: float = 15.0) -> Client:
        """A new client of this supervisor (close it, or use `with`)."""
        return Client(self.state_dir, timeout=timeout)

    def log(self) -> str:
        """Everything the supervisor printed."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM and wait; a supervisor that does not stop fails the test."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"supervisor did not stop on SIGTERM:\n{self.log()}") from None
        finally:
            self._log.close()


@pytest.fixture
def supervisor_factory(workdir: Path) -> Iterator[object]:
    """Make (and always stop) real supervisors: factory(*serve_args, env=None)."""
    made: list[Supervisor] = []

    def make(
        *args: str, env: dict[str, str] | None = None, start: bool = True, root: Path | None = None
    ) -> Supervisor:
        sup = Supervisor(root or workdir, list(args), env)
        made.append(sup)
        return sup.start() if start else sup

    yield make
    for sup in made:
        sup.stop()
    # A supervisor a test killed outright, its zygote with it, leaves its
    # (empty) cgroups until the next start on its data dir, which for a
    # test's never comes: removed as that start would.
    for sup in made:
        clear_left_groups(sup.data_dir)


@pytest.fixture
def supervisor(supervisor_factory: object) -> Supervisor:
    """One running supervisor with the probe runtime."""
    return supervisor_factory()  # type: ignore[operator,no-any-return]
