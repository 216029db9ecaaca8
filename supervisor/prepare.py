"""What is made for a session before its worker starts, and unmade when its
data is purged: its git worktree (worktrees.py) and its home seeded from
the operator's template.

A session that needs neither starts at once; one that needs either is
prepared first, off the loop where it waits on git or the disk, and its
worker is forked once that is done (lifecycle.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from hermes_sup.local.logfmt import kv

from .context import Context
from .git import GitRunner, WorktreeError
from .homes import home_is_empty, placeholder_values, seed_home
from .pool import WorkerPool
from .sealing import SESSIONS_GID
from .session import Session
from .table import SessionTable
from .worktrees import Worktrees, read_problem, worktree_ready

log = logging.getLogger("hermes_sup.supervisor")

COMMON_TMP = ("/tmp", "/var/tmp", "/dev/shm")


class Preparation:
    """A session's worktree and home, made before its worker starts."""

    def __init__(
        self, ctx: Context, table: SessionTable, pool: WorkerPool, hold_cull: Callable[[], None]
    ) -> None:
        self.ctx = ctx
        self.table = table
        self.pool = pool
        # git runs as our child: the pool holds its orphan cull meanwhile and
        # hands over the exit status if the supervisor's reaper took it.
        self.worktrees = Worktrees(
            GitRunner(
                ctx.environ,
                hold_cull,
                pool.forked,
                lambda pid: self.pool.unclaimed_exits.pop(pid, None),
            )
        )
        # Repositories sealed sessions were found to be able to read.
        self._read_checked: set[str] = set()

    def template_to_seed(self, session: Session) -> Path | None:
        """The template its home is to be copied from, if it has one and
        its home is still empty (a new session)."""
        template = self.ctx.settings.runtime_config.get("template_home")
        if not template or not home_is_empty(session.home):
            return None
        return Path(template)

    def needed(self, session: Session, template: Path | None) -> bool:
        """Whether the session has anything to be made before its worker."""
        return template is not None or (
            session.repo is not None and not worktree_ready(session.workspace)
        )

    async def prepare(self, session: Session, template: Path | None) -> None:
        """Make its worktree (if it works on a repository) and seed its
        home from `template` (if given). WorktreeError or OSError says why
        it cannot be."""
        if session.repo is not None and session.branch is not None:
            self._check_readable(session.repo)
            await self.worktrees.ensure(session.repo, session.workspace, session.branch)
        if template is not None:
            values = placeholder_values(session.key, session.options.session_env)
            await asyncio.to_thread(seed_home, template, session.home, values)

    def _check_readable(self, repo: str) -> None:
        """Refuse a repository sealed sessions could not read, with what to
        run (WorktreeError); checked until it passes."""
        if self.pool.sealing.mode != "root" or repo in self._read_checked:
            return
        settings = self.ctx.settings
        # What a sealed session sees as its own directories (worker/seal.py).
        mounted = [*COMMON_TMP, *settings.repo_roots, *settings.workspace_roots, settings.repo]
        problem = read_problem(repo, SESSIONS_GID, [m for m in mounted if m])
        if problem is not None:
            log.warning(kv("repo_not_readable_by_sessions", repo=repo, hint=problem))
            raise WorktreeError(problem)
        self._read_checked.add(repo)

    async def purge(self, session: Session, delete_branch: bool) -> str:
        """Delete a stopped session's data (kill --purge): first its
        worktree (git worktree remove, prune; its branch only if asked),
        then the rest. A note on what stayed, for the reply."""
        note = ""
        if session.key in self.table.purging:
            return " (by another kill, still removing its worktree)"
        if session.repo is not None and session.branch is not None:
            self.table.purging.add(session.key)
            try:
                problems = await self.worktrees.remove(
                    session.repo, session.workspace, session.branch, delete_branch
                )
            finally:
                self.table.purging.discard(session.key)
            if problems:
                note = " (" + "; ".join(problems) + ")"
            elif not delete_branch:
                note = f", branch {session.branch} kept"
            else:
                note = f", branch {session.branch} deleted"
        if self.table.get(session.key) is session:
            note += self.table.purge(session)
        return note
