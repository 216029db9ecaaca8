"""`hermes-sup repo`: the operator's side of a repository sessions work on.
`list` shows each session's branches against the repository's HEAD (ahead,
behind), its uncommitted changes and the files it changed, and which files
more than one session changes; `take` brings a session's branch into the
repository. Both read the data directory (as `logs --data-dir` does) and
run git on this machine: the supervisor need not be up
(supervisor/repos.py says how a session's repository is read safely).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import click

from hermes_sup.local.statedir import DATA_DIR_ENV, default_data_dir

if TYPE_CHECKING:
    from hermes_sup.supervisor.repos import SessionWork

DATA_DIR = click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    envvar=DATA_DIR_ENV,
    help=f"The supervisor's data directory [env {DATA_DIR_ENV}; default: the one "
    "`hermes-sup serve` uses as this user].",
)


def _data_dir(given: Path | None) -> Path:
    data_dir = given if given is not None else default_data_dir()
    if not (data_dir / "sessions").is_dir():
        raise click.ClickException(
            f"{data_dir} holds no sessions: give the supervisor's data directory with "
            "--data-dir (hermes-sup inspect SESSION names a session's directory in it)"
        )
    return data_dir


@click.group(name="repo")
def repo() -> None:
    """What sessions do on a repository: their branches and files, and
    their work brought into it.

    Each session works in a repository of its own, on its own branch,
    whose objects come from the repository it was opened on; none of its
    commits is in that repository until it is taken, or the session purged.

    \b
    Examples:
      hermes-sup repo list
      hermes-sup repo list --repo ~/src/webapp --json
      hermes-sup repo take fix-login
      hermes-sup repo take fix-login --as fix-login
    """


@repo.command(name="list")
@click.option("--repo", "repo_path", default=None, help="Only the sessions on this repository.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object: sessions and overlaps.")
@DATA_DIR
def list_(repo_path: str | None, as_json: bool, data_dir: Path | None) -> None:
    """Each session's branches (commits ahead of and behind the
    repository's HEAD), its uncommitted changes, and the files that more
    than one session changes."""
    # Imported here: `hermes-sup --help` lists this command without git's
    # machinery (asyncio and the supervisor's modules).
    from hermes_sup.supervisor.repos import RepoError, overlaps, survey

    where = _data_dir(data_dir)
    try:
        works = survey(where, str(Path(repo_path).absolute()) if repo_path else None)
    except RepoError as exc:
        raise click.ClickException(str(exc)) from None
    shared = overlaps(works)
    if as_json:
        click.echo(
            json.dumps({"sessions": [w.describe() for w in works], "overlaps": shared}, indent=2)
        )
        return
    if not works:
        click.echo("no session works on a repository")
        return
    for line in _table(works):
        click.echo(line)
    for repository, files in shared.items():
        click.echo(f"\nfiles more than one session on {repository} changes:")
        for path, keys in files.items():
            click.echo(f"  {path}: {', '.join(keys)}")


def _table(works: list[SessionWork]) -> list[str]:
    """One line a session branch: session, branch, ahead, behind, dirty."""
    rows = [("SESSION", "BRANCH", "AHEAD", "BEHIND", "UNCOMMITTED", "REPOSITORY")]
    for work in works:
        dirty = "?" if work.dirty is None else str(len(work.dirty))
        if work.problem is not None:
            rows.append((work.key, work.branch, "-", "-", "-", f"{work.repo} ({work.problem})"))
            continue
        if not work.branches:
            rows.append((work.key, "(no branch)", "-", "-", dirty, work.repo))
        for i, branch in enumerate(work.branches):
            rows.append(
                (
                    work.key,
                    branch.name,
                    str(branch.ahead),
                    str(branch.behind),
                    dirty if i == 0 else "",
                    work.repo,
                )
            )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return [
        "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:-1])) + "  " + row[-1]
        for row in rows
    ]


@repo.command(name="take")
@click.argument("session")
@click.option(
    "--as",
    "as_branch",
    default=None,
    help="The branch to bring it in as (default: the session's own branch's name).",
)
@DATA_DIR
def take_(session: str, as_branch: str | None, data_dir: Path | None) -> None:
    """Bring SESSION's branch into its repository as a branch: a
    fast-forward only, so no branch there loses a commit."""
    from hermes_sup.supervisor.repos import RepoError, take  # see list_

    where = _data_dir(data_dir)
    try:
        work, branch, commit = take(where, session, as_branch)
    except RepoError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"{work.repo}: branch {branch} at {commit[:12]}, from session {session}")
