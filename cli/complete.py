"""Shell completion that works for session keys, which nearly always hold a
':' (`telegram:-100123`).

bash splits the word being completed at every character of
COMP_WORDBREAKS, ':' and '=' among them, so click's stock script sees
`telegram`, `:`, `-100` and offers full keys for the last piece only; bash
then puts `telegram:telegram:-100123` on the line. Our bash script sends the
line as typed (COMP_LINE up to COMP_POINT) and the shell's word breaks, so
the word is read whole, and each answer is cut to what bash replaces: the
part after the word's last break character.

zsh does not split words at ':', but its `_describe` reads ':' as the
separator between a value and its description, so colons in values are
escaped there (`telegram\\:-100123`).

Both register under click's names (bash, zsh): `_HERMES_SUP_COMPLETE=bash_source`
prints our script, as `hermes-sup completion bash` does (fish: click's own).
"""

from __future__ import annotations

import os
from typing import Any

import click
from click.shell_completion import (
    BashComplete,
    CompletionItem,
    ZshComplete,
    add_completion_class,
    get_completion_class,
    split_arg_string,
)

PROG_NAME = "hermes-sup"
COMPLETE_VAR = "_HERMES_SUP_COMPLETE"
SHELLS = ("bash", "zsh", "fish")

DEFAULT_WORDBREAKS = " \t\n\"'><=;|&(:"

_SOURCE_BASH = """\
%(complete_func)s() {
    local IFS=$'\\n'
    local response
    response=$(env COMP_LINE="$COMP_LINE" COMP_POINT="$COMP_POINT" \\
COMP_WORDBREAKS="$COMP_WORDBREAKS" COMP_WORDS="${COMP_WORDS[*]}" COMP_CWORD=$COMP_CWORD \\
%(complete_var)s=bash_complete $1)
    for completion in $response; do
        IFS=',' read type value <<< "$completion"
        if [[ $type == 'dir' ]]; then
            COMPREPLY=()
            compopt -o dirnames
        elif [[ $type == 'file' ]]; then
            COMPREPLY=()
            compopt -o default
        elif [[ $type == 'plain' ]]; then
            COMPREPLY+=("$value")
        fi
    done
    return 0
}

%(complete_func)s_setup() {
    complete -o nosort -F %(complete_func)s %(prog_name)s
}

%(complete_func)s_setup;
"""


class KeyBashComplete(BashComplete):
    """bash completion that reads the current word whole, ':' and all."""

    source_template = _SOURCE_BASH

    def get_completion_args(self) -> tuple[list[str], str]:
        line = os.environ.get("COMP_LINE")
        if line is None:  # an older script: only the split words
            return super().get_completion_args()
        point = int(os.environ.get("COMP_POINT", len(line)))
        before = line[:point]
        words = split_arg_string(before)
        if before and not before[-1].isspace() and words:
            incomplete = words.pop()
        else:
            incomplete = ""
        self._incomplete = incomplete
        return words[1:], incomplete

    def format_completion(self, item: CompletionItem[Any]) -> str:
        value = str(item.value)
        incomplete = getattr(self, "_incomplete", "")
        breaks = os.environ.get("COMP_WORDBREAKS", DEFAULT_WORDBREAKS)
        cut = max((incomplete.rfind(ch) for ch in breaks), default=-1)
        if cut >= 0 and value.startswith(incomplete[: cut + 1]):
            value = value[cut + 1 :]  # bash replaces only what follows the break
        return f"{item.type},{value}"


class KeyZshComplete(ZshComplete):
    """zsh completion with ':' in values escaped for `_describe`."""

    def format_completion(self, item: CompletionItem[Any]) -> str:
        help_ = item.help or "_"
        value = str(item.value)
        if help_ != "_":  # `_describe` splits value and help at the first bare ':'
            value = value.replace(":", r"\:")
        return f"{item.type}\n{value}\n{help_}"


def install() -> None:
    """Use these classes for bash and zsh (click's own for other shells)."""
    add_completion_class(KeyBashComplete, "bash")
    add_completion_class(KeyZshComplete, "zsh")


@click.command()
@click.argument("shell", type=click.Choice(SHELLS))
@click.pass_context
def completion(ctx: click.Context, shell: str) -> None:
    """Print the shell completion script for SHELL (bash, zsh or fish).

    Completes commands, options and session keys (asked of the running
    supervisor).

    \b
    Examples:
      eval "$(hermes-sup completion bash)"        # in ~/.bashrc
      eval "$(hermes-sup completion zsh)"         # in ~/.zshrc
      hermes-sup completion fish > ~/.config/fish/completions/hermes-sup.fish
    """
    root = ctx.find_root().command
    found = get_completion_class(shell)
    if found is None:  # not reached: SHELLS are all registered
        raise click.ClickException(f"no completion for {shell}")
    click.echo(found(root, {}, PROG_NAME, COMPLETE_VAR).source(), nl=False)
