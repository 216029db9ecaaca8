"""The one build step pyproject.toml cannot declare: the man pages and the
shell completion scripts.

`build_man` runs as part of `build` (so of every wheel), after build_py has
laid out the hermes_sup package in build/lib: it runs
`python -m hermes_sup.cli.manpages` there with the version being built, and
the pages it writes become the wheel's data files under share/man/man1. An
install then puts them in the environment's share/man/man1, where
`man hermes-sup` finds them (MANPATH, or man's own search beside PATH) and
`man -l` opens them by path. The completion scripts (`hermes-sup completion
SHELL`, written the same way) go where each shell's own completion loader
looks under a prefix: share/bash-completion/completions,
share/zsh/site-functions and share/fish/vendor_completions.d.

The pages are made from the commands' own help: loading every command needs
click and msgpack, and writing the pages click-man, which pyproject.toml's
[build-system] requires. An editable install gets no data files from
setuptools, so it skips the step (`make man` writes the pages in a checkout).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from setuptools import Command, setup
from setuptools.command.build import build

MAN_SECTION = "share/man/man1"
# Where each shell's completion loader looks under an install prefix, and
# the file name it looks for.
COMPLETIONS = {
    "bash": ("share/bash-completion/completions", "hermes-sup"),
    "zsh": ("share/zsh/site-functions", "_hermes-sup"),
    "fish": ("share/fish/vendor_completions.d", "hermes-sup.fish"),
}


class build_man(Command):
    """Write a man page for every command, for the wheel's share/man/man1."""

    description = "write the man pages from the commands' own help"
    user_options: list[tuple[str, str | None, str]] = []

    def initialize_options(self) -> None:
        self.build_base: str | None = None
        # setuptools sets this on every build sub-command of an editable install.
        self.editable_mode = False

    def finalize_options(self) -> None:
        self.set_undefined_options("build", ("build_base", "build_base"))

    def run(self) -> None:
        if self.editable_mode:
            return
        self.run_command("build_py")
        build_lib = Path(self.get_finalized_command("build_py").build_lib).resolve()
        assert self.build_base is not None
        target = Path(self.build_base) / "man"
        for stale in target.glob("*.1"):
            stale.unlink()  # a page of a command removed since the last build
        # Run from build/lib so that `-m` imports the package just laid out
        # there; PYTHONPATH is kept, as pip's isolated build puts the
        # [build-system] requirements on it.
        subprocess.run(
            [
                sys.executable,
                "-m",
                "hermes_sup.cli.manpages",
                "--version",
                self.distribution.get_version(),
                str(target.resolve()),
            ],
            cwd=build_lib,
            env=os.environ.copy(),
            check=True,
        )
        pages = sorted(str(page) for page in target.glob("*.1"))
        if not pages:
            raise RuntimeError(f"no man pages were written into {target}")
        self.distribution.data_files = [(MAN_SECTION, pages), *self._completions(build_lib)]

    def _completions(self, build_lib: Path) -> list[tuple[str, list[str]]]:
        """Each shell's completion script, as `hermes-sup completion SHELL`
        prints it, for where that shell's loader looks."""
        assert self.build_base is not None
        made = []
        for shell, (where, name) in COMPLETIONS.items():
            script = subprocess.run(
                [sys.executable, "-m", "hermes_sup.cli", "completion", shell],
                cwd=build_lib,
                env=os.environ.copy(),
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            if "hermes-sup" not in script and "hermes_sup" not in script.lower():
                raise RuntimeError(f"`hermes-sup completion {shell}` printed no script")
            path = Path(self.build_base, "completion", shell, name).resolve()
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(script)
            made.append((where, [str(path)]))
        return made

    def get_outputs(self) -> list[str]:
        assert self.build_base is not None
        base = Path(self.build_base)
        return sorted(
            str(p) for p in [*(base / "man").glob("*.1"), *(base / "completion").glob("*/*")]
        )


class build_with_man(build):
    """setuptools' build, then the man pages."""

    sub_commands = [*build.sub_commands, ("build_man", None)]


setup(cmdclass={"build": build_with_man, "build_man": build_man})
