"""Shell completion of session keys, which nearly always hold a ':'
(`telegram:-100123`), typed into a real interactive bash and zsh on a
pseudo-terminal (issue 18 item 6). bash splits words at ':' (COMP_WORDBREAKS);
zsh's `_describe` reads ':' as the start of a description."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pexpect
import pytest

BIN = Path(sys.executable).parent
KEYS = ("tg:-100123:alice", "tg:-100123:albert", "web:bob")


@pytest.fixture
def keyed(supervisor):
    with supervisor.client() as client:
        for key in KEYS:
            client.open(key)
    return supervisor


def shell(sup, argv: list[str]) -> pexpect.spawn:
    if not (BIN / "hermes-sup").exists():
        pytest.skip(f"no hermes-sup script in {BIN} (install the package)")
    env = {
        "PATH": f"{BIN}:{os.environ['PATH']}",
        "HOME": str(sup.root),
        "TERM": "dumb",
        "HERMES_SUP_STATE_DIR": str(sup.state_dir),
        "LANG": "C.UTF-8",
    }
    return pexpect.spawn(argv[0], argv[1:], env=env, encoding="utf-8", timeout=20, cwd=sup.root)


def completed_line(child: pexpect.spawn, typed: str, prompt: str) -> str:
    """Type `typed`, press TAB, and read back the line as the shell has it
    (by running it through echo)."""
    child.send(typed + "\t")
    child.send("\x01echo :\r")  # to the start of the line, prefix `echo :`
    child.expect(r"\r\n:(hermes-sup [^\r\n]*)\r\n")
    line = child.match.group(1)
    child.expect_exact(prompt)
    return line.rstrip()


def test_bash_completes_keys_with_colons(keyed) -> None:
    if not shutil.which("bash"):
        pytest.skip("no bash")
    child = shell(keyed, ["bash", "--norc", "--noprofile", "-i"])
    try:
        child.sendline("PS1='> '; bind 'set bell-style none'")
        child.sendline('eval "$(hermes-sup completion bash)"; echo rea""dy')
        child.expect("ready")
        child.expect_exact("> ")
        assert completed_line(child, "hermes-sup kill tg:-100123:ali", "> ") == (
            "hermes-sup kill tg:-100123:alice"
        )
        assert completed_line(child, "hermes-sup attach we", "> ") == "hermes-sup attach web:bob"
        # Two keys share the prefix: it completes as far as they agree.
        assert completed_line(child, "hermes-sup logs tg:-1", "> ") == (
            "hermes-sup logs tg:-100123:al"
        )
        child.sendline("exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)


def test_zsh_completes_keys_with_colons(keyed) -> None:
    if not shutil.which("zsh"):
        pytest.skip("no zsh")
    child = shell(keyed, ["zsh", "-f", "-i"])
    try:
        child.sendline("PROMPT='> '; unsetopt beep; autoload -U compinit; compinit -u")
        child.sendline('eval "$(hermes-sup completion zsh)"; echo rea""dy')
        child.expect("ready")
        child.expect_exact("> ")
        assert completed_line(child, "hermes-sup kill tg:-100123:ali", "> ") == (
            "hermes-sup kill tg:-100123:alice"
        )
        assert completed_line(child, "hermes-sup attach we", "> ") == "hermes-sup attach web:bob"
        child.sendline("exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)


@pytest.mark.parametrize("shell_name", ["bash", "zsh", "fish"])
def test_completion_prints_the_script_click_would_source(shell_name: str) -> None:
    """`hermes-sup completion SHELL` is the script `_HERMES_SUP_COMPLETE=SHELL_source`
    prints (ours for bash and zsh), so either way of installing it works."""
    import subprocess

    script = BIN / "hermes-sup"
    if not script.exists():
        pytest.skip(f"no hermes-sup script in {BIN} (install the package)")
    printed = subprocess.run(
        [script, "completion", shell_name], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    sourced = subprocess.run(
        [script],
        env={**os.environ, "_HERMES_SUP_COMPLETE": f"{shell_name}_source"},
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert printed == sourced
    assert "_HERMES_SUP_COMPLETE" in printed
    if shell_name == "bash":
        assert "COMP_LINE" in printed  # ours, which reads keys with ':' whole


def test_completion_refuses_an_unknown_shell() -> None:
    from click.testing import CliRunner

    from hermes_sup.cli.main import cli

    result = CliRunner().invoke(cli, ["completion", "tcsh"])
    assert result.exit_code == 2
    assert "'tcsh' is not one of 'bash', 'zsh', 'fish'" in result.output
