"""Sealed sessions (--sealed, worker/seal.py): each worker in its own mount
namespace sees its own session's files and nothing of other sessions or of
the state directory's key; as root it runs as a uid of its own with no
capabilities, so its shell can neither undo the mounts nor reach another
worker. Real supervisors, real workers, real shells; these run as root."""

from __future__ import annotations

import ctypes
import importlib.util
import os
from functools import partial
from pathlib import Path

import psutil
import pytest

from hermes_sup.client import Output, SupervisorError
from hermes_sup.local import syscalls
from hermes_sup.protocol import WorkerExit, session_dir_name
from hermes_sup.seal import paths as seal_paths
from hermes_sup.seal.calls import FAULT_ENV

from . import waiting
from .test_spares import spare_pids

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="these tests start sealed supervisors as root"),
]

SESSIONS = 4


def sh(client, key: str, command: str) -> tuple[str, list[str]]:  # noqa: ANN001
    """Run `command` in the session's shell: its reply and output lines
    (an output event may hold several: streams are coalesced)."""
    reply = client.run(key, f"sh {command}")
    text = "\n".join(e.line for e in reply.events if isinstance(e, Output))
    return reply.text, text.split("\n") if text else []


wait_for = partial(waiting.wait_for, timeout=20.0)


def session_dir(sup, key: str) -> Path:  # noqa: ANN001
    return sup.data_dir / "sessions" / session_dir_name(key)


def check_isolation(sup, client, keys: list[str], own_uids: bool = True) -> dict[str, int]:  # noqa: ANN001
    """Every session writes a marker into its workspace, /tmp and HOME at
    once, then looks for everyone's: it finds only its own, and on the host
    each marker is in its own session's directory. Returns the pids."""
    paths = seal_paths.SealedPaths.for_data_dir(sup.data_dir)
    sends = [
        client.send(
            key,
            f"sh echo {key}-secret > marker && echo {key} > /tmp/t-{key} "
            f'&& echo {key} > "$HOME/h-{key}" && id -u',
        )
        for key in keys
    ]
    uids = {}
    for key, handle in zip(keys, sends, strict=True):
        reply = handle.collect()
        assert reply.text == "exit 0", reply
        uids[key] = int([e.line for e in reply.events if isinstance(e, Output)][-1].split()[-1])
    pids = {key: int(client.run(key, "pid").text) for key in keys}
    for key in keys:
        text, lines = sh(
            client,
            key,
            f"pwd; echo $HOME $HERMES_HOME $TMPDIR; ls /tmp; ls $HOME; cat marker; "
            f"ls {sup.data_dir}/sessions; ls {sup.data_dir}/sessions/{session_dir_name(key)}; "
            f"cat {sup.state_dir}/hmac.key; ls {sup.state_dir}",
        )
        out = "\n".join(lines)
        assert lines[0] == str(paths.workspace)
        assert lines[1] == f"{paths.user} {paths.home} /tmp"
        assert f"{key}-secret" in out and f"t-{key}" in out and f"h-{key}" in out
        for other in set(keys) - {key}:
            for mark in (f"{other}-secret", f"t-{other}", f"h-{other}", session_dir_name(other)):
                assert mark not in out, f"{key} saw {other}'s {mark}: {out}"
        # The state dir shows nothing: no key, no socket.
        assert "hmac.key: No such file" in out or "Permission denied" in out
        assert (sup.state_dir / "hmac.key").read_text().strip() not in out
        assert "workers.sock" not in out and "control.sock" not in out
    for key in keys:
        own = session_dir(sup, key)
        assert (own / "workspace" / "marker").read_text() == f"{key}-secret\n"
        assert (own / "user" / f"h-{key}").exists()
        # The session's /tmp is a tmpfs of its own (tmp_limit_mb), nowhere on disk.
        assert not (own / "tmp" / f"t-{key}").exists()
    # Nothing landed in the zygote's fixed paths or the shared /tmp.
    for fixed in (paths.workspace, paths.user):
        assert list(fixed.iterdir()) == []
    assert not any(Path("/tmp", f"t-{key}").exists() for key in keys)
    if own_uids:
        assert len(set(uids.values())) == len(keys) and 0 not in uids.values()
    return pids


def test_concurrent_sealed_sessions_each_see_only_their_own(supervisor_factory) -> None:
    sup = supervisor_factory("--sealed", "on")
    keys = [f"iso{i}x" for i in range(SESSIONS)]
    with sup.client(timeout=60) as client:
        pids = check_isolation(sup, client, keys)
        for key, pid in pids.items():
            uid = psutil.Process(pid).uids().real
            assert uid >= 200_000, (key, uid)  # a uid of its own, not root
            assert client.inspect(key)["uid"] == uid and client.inspect(key)["sealed"]
        sealed = client.status()["sealed"]
        assert sealed["sealed"] and sealed["mode"] == "root", sealed
    assert "sealed mode=root" in sup.log()


def test_escape_tries_from_a_sealed_shell_are_refused(supervisor_factory) -> None:
    sup = supervisor_factory("--sealed", "on")
    with sup.client(timeout=60) as client:
        assert client.run("victim", "setenv VICTIM_SECRET s3cr3t").ok
        victim = int(client.run("victim", "pid").text)
        sh(client, "victim", "echo v1ct1m-data > /tmp/victim-file")
        zygote = client.status()["zygote_pid"]
        tries = {
            "umount_tmp": "umount /tmp",
            "umount_data": f"umount {sup.data_dir}",
            "umount_state": f"umount {sup.state_dir}",
            "proc_root": f"cat /proc/{victim}/root/tmp/victim-file",
            "proc_environ": f"cat /proc/{victim}/environ",
            "proc_cwd": f"ls /proc/{victim}/cwd/",
            "kill_worker": f"kill -0 {victim}",
            "kill_zygote": f"kill -0 {zygote}",
            "kill_supervisor": f"kill -0 {sup.pid}",
            "mount": "mount -t tmpfs none /tmp",
            "setuid": "su -c true root </dev/null",
        }
        for name, command in tries.items():
            text, lines = sh(client, "attacker", f"{command} 2>&1; echo status=$?")
            assert lines[-1] != "status=0", f"{name} succeeded: {lines}"
            assert "s3cr3t" not in "\n".join(lines) and "v1ct1m-data" not in "\n".join(lines)
        # The mounts are all still there: its /tmp is still its own.
        text, lines = sh(client, "attacker", f"ls /tmp; ls {sup.data_dir}/sessions")
        assert "victim-file" not in lines and session_dir_name("victim") not in lines
        assert client.run("victim", "env VICTIM_SECRET").text == "s3cr3t"  # still alive


def test_a_failing_seal_step_fails_the_session_closed(supervisor_factory, workdir) -> None:
    env = {**os.environ, FAULT_ENV: "session"}
    sup = supervisor_factory("--sealed", "on", env=env)
    marker = workdir / "ran"
    with sup.client(timeout=60) as client:
        with pytest.raises(SupervisorError) as err:
            client.run("s", f"sh touch {marker}")
        assert "could not seal its session" in err.value.message
        assert "status 73" in err.value.message
        (row,) = client.sessions()
        assert "could not seal" in (row.get("last_exit") or "")
        # A seal that failed will fail again: given up at once, not retried
        # in a back-off loop, until the operator acts.
        assert row["state"] == "failed", row
    assert not marker.exists()  # nothing of the session ran
    log = (session_dir(sup, "s") / "worker.log").read_text()
    assert "seal failed session=s step=session" in log and "does not run unsealed" in log
    assert "worker start" not in log
    assert f"status {int(WorkerExit.SEAL_FAILED)}" in err.value.message


PR_CAPBSET_DROP = 24
CAP_SYS_ADMIN = 21


def without_cap_sys_admin() -> None:
    """As a container without CAP_SYS_ADMIN: gone from the bounding set, so
    the exec'd supervisor (root) does not have it."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_CAPBSET_DROP, CAP_SYS_ADMIN, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_CAPBSET_DROP")


def test_sealed_on_refuses_to_start_where_the_kernel_cannot(supervisor_factory) -> None:
    sup = supervisor_factory("--sealed", "on", start=False)
    sup.start(wait=False, preexec_fn=without_cap_sys_admin)
    assert sup.proc is not None
    assert sup.proc.wait(timeout=30) != 0
    log = sup.log()
    assert "sessions cannot be sealed here" in log and "CAP_SYS_ADMIN" in log
    assert "ready" not in log


def test_sealed_auto_runs_unsealed_where_the_kernel_cannot_and_says_why(
    supervisor_factory,
) -> None:
    sup = supervisor_factory("--sealed", "auto", start=False)
    sup.start(preexec_fn=without_cap_sys_admin)
    with sup.client(timeout=60) as client:
        cwd = client.run("a", "cwd").text
        assert cwd == str(session_dir(sup, "a") / "workspace")  # today's workers
    log = sup.log()
    assert "sealed_unavailable" in log and "CAP_SYS_ADMIN" in log and "running=unsealed" in log
    assert "sealed=no" in log


def test_sealed_sessions_on_spare_workers_are_sealed_as_well(supervisor_factory) -> None:
    sup = supervisor_factory("--sealed", "on", "--spare-workers", "2")
    keys = [f"spare{i}x" for i in range(3)]
    with sup.client(timeout=60) as client:
        wait_for(lambda: client.status()["spare_workers"] == 2)
        spares = spare_pids(sup)
        pids = check_isolation(sup, client, keys)
        assert len(set(pids.values()) & spares) == 2  # two of them were spares
        # An assigned spare is as locked down as a forked worker.
        for key in keys:
            text, lines = sh(client, key, "grep -E 'CapEff|CapBnd|NoNewPrivs' /proc/self/status")
            assert [line.split()[1] for line in lines] == ["0000000000000000"] * 2 + ["1"]
            text, lines = sh(client, key, "umount /tmp 2>&1; echo status=$?")
            assert lines[-1] != "status=0"


def as_nobody_with_the_interpreter_reachable() -> None:
    """Become uid 65534 (a service user). The test interpreter may live
    where such a user cannot reach (/root/.pyenv here): in a mount
    namespace of the supervisor's own, the directory above it is a tmpfs
    others may pass through, with only the interpreter bound back."""
    libc = ctypes.CDLL(None, use_errno=True)

    def mount(src: str | None, tgt: str, fs: str | None, flags: int, data: str | None) -> None:
        args = (
            src and src.encode(),
            tgt.encode(),
            fs and fs.encode(),
            flags,
            data and data.encode(),
        )
        if libc.mount(*args) != 0:
            raise OSError(ctypes.get_errno(), f"mount {tgt}")

    closed = sorted(
        seal_paths.closed_ancestors(seal_paths.code_paths()), key=lambda p: len(p.parts)
    )
    if closed:
        if libc.unshare(syscalls.CLONE_NEWNS) != 0:
            raise OSError(ctypes.get_errno(), "unshare")
        mount(None, "/", None, syscalls.MS_REC | syscalls.MS_PRIVATE, None)
        for top in closed:
            keep = [p for p in seal_paths.code_paths() if top in p.parents]
            fds = [os.open(p, os.O_PATH) for p in keep]
            mount("tmpfs", str(top), "tmpfs", 0, "mode=0711")
            for path, fd in zip(keep, fds, strict=True):
                os.makedirs(path, mode=0o711, exist_ok=True)
                mount(
                    f"/proc/self/fd/{fd}", str(path), None, syscalls.MS_BIND | syscalls.MS_REC, None
                )
    os.setgroups([])
    os.setresgid(65534, 65534, 65534)
    os.setresuid(65534, 65534, 65534)


def test_unprivileged_sealed_sessions(supervisor_factory, workdir) -> None:
    os.chown(workdir, 65534, 65534)
    env = {**os.environ, "HOME": "/nonexistent"}
    # One spare: the first session gets it, the others are forked.
    sup = supervisor_factory("--sealed", "on", "--spare-workers", "1", env=env, start=False)
    sup.start(preexec_fn=as_nobody_with_the_interpreter_reachable)
    keys = ["uiso0x", "uiso1x", "uiso2x"]
    with sup.client(timeout=60) as client:
        wait_for(lambda: client.status()["spare_workers"] == 1)
        spares = spare_pids(sup)
        pids = check_isolation(sup, client, keys, own_uids=False)
        assert len(set(pids.values()) & spares) == 1
        assert {psutil.Process(p).uids().real for p in pids.values()} == {65534}
        other = pids["uiso1x"]
        scoped = syscalls.landlock_abi() >= syscalls.LANDLOCK_SCOPE_ABI
        for command, refused in (
            ("umount /tmp", True),
            (f"cat /proc/{other}/environ", True),
            (f"ls /proc/{other}/root/", True),
            # Same uid: only Landlock's signal scope (Linux 6.12+) stops it.
            (f"kill -0 {other}", scoped),
            (f"kill -0 {sup.pid}", scoped),
        ):
            text, lines = sh(client, "uiso0x", f"{command} 2>&1; echo status=$?")
            assert (lines[-1] != "status=0") == refused, (command, lines)
        # The service's code is read-only in a session's view: its uid may
        # be the code's owner, and the next supervisor runs that code.
        package = Path(seal_paths.__file__).resolve().parent.parent
        text, lines = sh(
            client, "uiso0x", f"awk '$5 == \"{package}\" {{print $6}}' /proc/self/mountinfo"
        )
        assert lines and lines[-1].split(",")[0] == "ro", lines
    assert "sealed mode=user" in sup.log()


def test_a_git_worktree_workspace_keeps_its_repository_visible(supervisor_factory, workdir) -> None:
    import subprocess

    roots = workdir / "roots"
    repos = workdir / "repos"
    repo = repos / "repo"
    roots.mkdir()
    repos.mkdir()
    run = {"check": True, "capture_output": True}
    subprocess.run(["git", "init", "-q", "-b", "main", str(repo)], **run)
    subprocess.run(
        [
            "git",
            "-C",
            str(repo),
            "-c",
            "user.email=t@t",
            "-c",
            "user.name=t",
            "commit",
            "-q",
            "--allow-empty",
            "-m",
            "sealed-first-commit",
        ],
        **run,
    )
    tree = roots / "wt"
    subprocess.run(["git", "-C", str(repo), "worktree", "add", "-q", str(tree)], **run)
    (roots / "another").mkdir()
    (roots / "another" / "secret.txt").write_text("n0t-yours")
    sup = supervisor_factory(
        "--sealed", "on", "--workspace-root", str(roots), "--repo-root", str(repos)
    )
    with sup.client(timeout=60) as client:
        # A `.git` file naming another session's directory shows it nothing.
        client.open("victim")
        victim = session_dir(sup, "victim")
        (roots / "liar").mkdir()
        (roots / "liar" / ".git").write_text(f"gitdir: {victim}\n")
        client.open("liar", workspace=str(roots / "liar"))
        text, lines = sh(client, "liar", f"ls {victim} 2>&1; ls {repos} 2>&1")
        assert "workspace" not in "\n".join(lines) and "repo" not in lines
        client.open("g", workspace=str(tree))
        text, lines = sh(
            client,
            "g",
            f"git -c safe.directory='*' log --format=%s; ls {roots}; cat {roots}/another/secret.txt",
        )
        out = "\n".join(lines)
        assert "sealed-first-commit" in out  # the common git dir is there
        assert "n0t-yours" not in out and "another" not in out.replace("another/", "")


@pytest.mark.skipif(
    importlib.util.find_spec("run_agent") is None, reason="hermes-agent is not installed"
)
def test_hermes_preloaded_with_sealed_auto_is_refused_where_it_runs_unsealed(
    supervisor_factory,
) -> None:
    sup = supervisor_factory("--sealed", "auto", "--preload", "run_agent", start=False)
    sup.start(wait=False, preexec_fn=without_cap_sys_admin)
    assert sup.proc is not None
    assert sup.proc.wait(timeout=30) != 0
    log = sup.log()
    assert "run_agent belong to hermes-agent" in log and "sessions run unsealed here" in log
    assert "zygote_ready" not in log


def test_the_operators_template_home_stays_readable_and_read_only(
    supervisor_factory, workdir
) -> None:
    template = workdir / "template"
    template.mkdir(mode=0o755)
    (template / "SOUL.md").write_text("t3mplate\n")
    (template / "SOUL.md").chmod(0o644)
    agent = workdir / "agent.toml"
    agent.write_text(f'template_home = "{template}"\n')
    sup = supervisor_factory("--sealed", "on", "--agent-config", str(agent))
    with sup.client(timeout=60) as client:
        text, lines = sh(
            client, "t", f"cat {template}/SOUL.md; echo x >> {template}/SOUL.md; echo status=$?"
        )
        assert lines[0] == "t3mplate" and lines[-1] != "status=0"
    assert (template / "SOUL.md").read_text() == "t3mplate\n"


def test_sealed_sessions_on_one_repository_read_their_peers(supervisor_factory, workdir) -> None:
    """As root each sealed worker runs as its own uid: the peers file the
    supervisor writes into its worktree must still be readable to it (and
    not writable: the supervisor's list is not the session's to change)."""
    import subprocess

    repo = workdir / "repo"
    run = {"check": True, "capture_output": True}
    subprocess.run(["git", "init", "-q", "-b", "main", str(repo)], **run)
    subprocess.run(
        ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
        + ["commit", "-q", "--allow-empty", "-m", "first"],
        **run,
    )
    sup = supervisor_factory("--sealed", "on", "--repo", str(repo))
    with sup.client(timeout=60) as client:
        client.open("left")
        client.open("right")
        reply = client.run("left", "peers")
        assert reply.text.split()[0] == "right", reply.text
        text, lines = sh(client, "left", "echo x >> .hermes-sup/peers; echo rc=$?")
        assert lines[-1] != "rc=0", lines
