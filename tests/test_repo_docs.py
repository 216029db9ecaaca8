"""docs/repositories.md, run as it is written: its first-time commands, line
by line, against a real supervisor sealed as root and as an unprivileged
service user, on a repository nothing was done to; and a repository sealed
sessions cannot read is refused with the command that lets them, which
works once run."""

from __future__ import annotations

import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from hermes_sup.client import SupervisorError
from hermes_sup.supervisor.worktrees import branch_for

from .test_hostile_session import NOBODY, require_sealed, start_lab
from .test_repo_hostile import operator
from .test_worktrees import heads, make_repo, subjects

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="starts supervisors as root and as nobody"),
]

DOC = Path(__file__).parent.parent / "docs" / "repositories.md"
OPERATOR_UID = 4242  # an account of the operator's, no session's
OPERATOR = ["setpriv", f"--reuid={OPERATOR_UID}", f"--regid={OPERATOR_UID}", "--clear-groups"]


def first_time_lines() -> list[str]:
    """The commands of the doc's first block, comments left out."""
    block = DOC.read_text().split("```sh\n", 1)[1].split("```", 1)[0]
    lines = [re.sub(r"\s+# [^'\"]*$", "", line).strip() for line in block.splitlines()]
    return [line for line in lines if line]


@pytest.mark.parametrize("mode", ["root", "user"])
def test_the_first_time_commands_work_as_written(
    supervisor_factory, workdir: Path, mode: str
) -> None:
    lines = first_time_lines()
    serve, rest = lines[0], lines[1:]
    assert serve.startswith("hermes-sup serve ")
    home = workdir / "home"
    repo = make_repo(home / "src" / "webapp")
    bin_dir = workdir / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "hermes-sup"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m hermes_sup.cli "$@"\n')
    shim.chmod(0o755)
    if mode == "root":
        # The operator's repository, of the operator's account, not root's.
        os.chmod(workdir, 0o755)
        for root, dirs, files in os.walk(home):
            for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
                os.lchown(name, OPERATOR_UID, OPERATOR_UID)
    args = [a.replace("~", str(home)) for a in shlex.split(serve)[2:]]
    lab = start_lab(supervisor_factory, workdir, mode, *args)
    require_sealed(lab)
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "HOME": str(home),
        "HERMES_SUP_STATE_DIR": str(lab.state_dir),
        "HERMES_SUP_DATA_DIR": str(lab.data_dir),
        "LC_ALL": "C",
    }
    said: dict[str, str] = {}
    for line in rest:
        as_operator = line.startswith("git ") and mode == "root"
        done = subprocess.run(
            [*(OPERATOR if as_operator else []), "sh", "-c", line],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            preexec_fn=operator(mode),
        )
        assert done.returncode == 0, (line, done.stdout, done.stderr)
        said[line.split()[1]] = done.stdout
        if line.startswith("hermes-sup send"):
            # The session fetches the operator's branches, whoever owns them.
            fetched = subprocess.run(
                ["hermes-sup", "send", "fix-login", "sh git fetch -q shared && echo fetched"],
                capture_output=True,
                text=True,
                timeout=120,
                env=env,
                preexec_fn=operator(mode),
            )
            assert "fetched" in fetched.stdout, (fetched.stdout, fetched.stderr)
    assert said["-C"].strip() == "fix login"
    assert "fix-login" in said["repo"] or "fix-login" in said["kill"]
    # Taken as asked, and kept by the purge as the session's branch.
    assert subjects(repo, "fix-login")[0] == "fix login"
    assert subjects(repo, branch_for("fix-login"))[0] == "fix login"
    assert subjects(repo, "main") == ["first"]
    # What the supervisor and `repo take` wrote there, root, is the operator's.
    owners = {os.lstat(os.path.join(r, n)).st_uid for r, d, f in os.walk(repo) for n in d + f}
    assert owners == {OPERATOR_UID if mode == "root" else NOBODY}


def test_a_repository_sessions_cannot_read_is_refused_with_what_to_run(
    supervisor_factory, workdir: Path
) -> None:
    repo = make_repo(workdir / "repo")
    common = repo / ".git"
    os.chmod(common, 0o700)  # as a umask of 077 leaves it
    sup = supervisor_factory("--repo", str(repo))
    with sup.client() as client:
        with pytest.raises(SupervisorError) as err:
            client.run("a", "pid")
        assert err.value.code == "session_failed"
        message = str(err.value)
        assert f"cannot read {common}" in message
        found = re.search(r"chgrp -R 199999 \S+ && chmod -R g\+rX \S+", message)
        assert found is not None, message
        command = found.group(0)
        done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert stat.S_IMODE(os.stat(common).st_mode) & 0o050 == 0o050
        client.kill("a")
        reply = client.run("a", "sh git commit -q --allow-empty -m mine && git log -1 --format=%s")
        assert reply.text == "exit 0"
    assert list(heads(repo)) == ["main"]
