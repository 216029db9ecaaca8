"""What clients are told of sessions and of the supervisor: the rows of
`list`, `status`, `inspect` and the node's own description, built from the
table, the pool and the settings (front.py sends them).
"""

from __future__ import annotations

import os
import resource
import time
from typing import Any

import psutil

from hermes_sup.local.version import version
from hermes_sup.protocol import PROTOCOL_VERSION

from . import model_gate, model_meter
from .cgroups import amend_limits
from .configfile import hermes_agent_version
from .context import Context
from .endpoints import Endpoints
from .environment import worker_env
from .limits import TreeUsage
from .pool import WorkerPool
from .sealing import describe_limits
from .session import LOG_FILE, Session, StoredSession
from .table import SessionTable
from .turns import Turns


class Reports:
    """Descriptions of sessions and of this supervisor, for clients."""

    def __init__(
        self,
        ctx: Context,
        table: SessionTable,
        turns: Turns,
        pool: WorkerPool,
        endpoints: Endpoints,
    ) -> None:
        self.ctx = ctx
        self.table = table
        self.turns = turns
        self.pool = pool
        self.endpoints = endpoints

    def session_rows(
        self,
        chosen: list[Session],
        stored: list[StoredSession],
        usage: dict[int, TreeUsage],
        now: float,
    ) -> list[dict[str, Any]]:
        """`list`'s rows, by key: the sessions `chosen`, with the memory,
        processes and CPU% of their workers' trees (`usage`, sampled at
        monotonic `now`), and sessions an earlier run left on disk."""
        rows = []
        for s in chosen:
            row = s.describe()
            row["node"] = self.ctx.node
            # The session's own runtime where it chose one, else the one its
            # worker was (or would be) started with.
            row["runtime"] = s.options.runtime or self.ctx.settings_for(s).runtime
            use = usage.get(s.pid) if s.pid is not None else None
            if use is None:
                row.update(rss=None, cpu_percent=None, procs=None)
            else:
                since = s.cpu_sample if s.cpu_sample is not None else (0.0, s.spawned_mono)
                elapsed = max(now - since[1], 1e-6)
                row.update(
                    rss=use.rss,
                    procs=use.procs,
                    cpu_percent=round(max(0.0, use.cpu - since[0]) / elapsed * 100, 1),
                )
                s.cpu_sample = (use.cpu, now)
            # The kernel's count against its limits, where it has a cgroup.
            row["cgroup"] = self.pool.cgroups.usage_dict(s.worker_id)
            # Model tokens through the model endpoint (None: not known here).
            meter = model_gate.current().meter(s.key)
            row["tokens"] = meter.tokens if meter is not None else None
            rows.append(row)
        default_runtime = self.ctx.settings.runtime
        for stored_session in stored:
            row = stored_session.describe()
            row.update(
                node=self.ctx.node,
                runtime=stored_session.runtime or default_runtime,
                rss=None,
                cpu_percent=None,
                procs=None,
                cgroup=None,
                tokens=None,
            )
            rows.append(row)
        rows.sort(key=lambda row: row["key"])
        return rows

    def supervisor_info(self) -> dict[str, Any]:
        """`status`: the supervisor itself."""
        ctx, endpoints, pool = self.ctx, self.endpoints, self.pool
        counts = self.table.counts_by_state()
        me = psutil.Process()
        with me.oneshot():
            rss, fds = me.memory_info().rss, me.num_fds()
        return {
            "pid": os.getpid(),
            "version": version(),
            "protocol": PROTOCOL_VERSION,
            "uptime": time.time() - ctx.started,
            "started": ctx.started,
            "runtime": ctx.settings.runtime,
            "hermes_agent": hermes_agent_version(),
            "endpoints": {
                "control": endpoints.control,
                "workers": endpoints.worker,
                "tcp": endpoints.tcp,
            },
            "state_dir": str(ctx.settings.state_dir),
            "data_dir": str(ctx.settings.data_dir),
            "zygote_pid": pool.zygote.pid if pool.zygote else None,
            "sessions": counts,
            "total_sessions": len(self.table),
            "max_sessions": ctx.max_sessions,
            "spare_workers": pool.spares.ready_count(),
            "queued": self.turns.queued_total,
            "rss": rss,
            "fds": fds,
            "fd_limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
            "accepting": ctx.accepting,
            "node": self.node_info(),
            # Whether sessions are sealed (worker/seal.py), how, and if not why.
            "sealed": pool.sealing.describe(),
            # The reserve for the supervisor's own state, and how each
            # session's disk bound is enforced (supervisor/disk.py).
            "disk": self.turns.disk_status(),
            # How each per-session limit is enforced here.
            "limits": amend_limits(
                describe_limits(ctx.settings, pool.sealing), ctx.settings, pool.cgroups
            ),
            # Whether each session has a kernel cgroup, which, and if not why.
            "cgroups": pool.cgroups.describe(),
            # What the sealed Hermes preload did (None: there was none).
            "preload": pool.preload,
            # Model use by HTTP key through the model endpoint, with budgets.
            "model_keys": model_gate.current().describe(),
        }

    def node_info(self) -> dict[str, object]:
        """This node, for `status` and `drain`: its name, whether it drains,
        its capacity (max_sessions) and the sessions it holds now (with a
        worker, or turns waiting for one)."""
        return {
            "name": self.ctx.node,
            "draining": self.ctx.draining,
            "capacity": self.ctx.max_sessions,
            "sessions": self.table.live_count(),
        }

    def session_details(self, session: Session) -> dict[str, Any]:
        """`inspect`: everything known about one session: directories, log,
        options, the names (never the values) of its worker's environment,
        state history, last exit."""
        settings = self.ctx.settings_for(session)
        options = session.options
        env = worker_env(
            self.ctx.base_env,
            settings.env,
            options,
            session.key,
            session.home,
            session.workspace,
            session.tmp,
            session.user,
        )
        logs = [session.log_path] + [
            session.log_path.with_name(f"{LOG_FILE}.{i}")
            for i in range(1, settings.log_backups + 1)
        ]
        history = [
            {k: body["data"].get(k) for k in ("state", "previous", "pid", "reason", "at")}
            for kind, body in session.history
            if kind == "state" and isinstance(body.get("data"), dict)
        ]
        return {
            **session.describe(),
            "created": session.created_at,
            "dir": str(session.dir),
            "workspace": str(session.workspace),
            "home": str(session.home),
            "tmp": str(session.tmp),
            "log": str(session.log_path),
            "log_files": [str(p) for p in logs if p.exists()],
            "runtime": options.runtime or settings.runtime,
            "options": {
                "session_env": dict(options.session_env),
                "env": sorted(options.env),  # names only: values may be secrets
                "agent": {k: v for k, v in options.agent.items() if "key" not in k.lower()},
                "workspace": options.workspace,
                "runtime": options.runtime,
                "label": options.label,
                "repo": options.repo,
            },
            "env_names": sorted(env),
            "current_turn": session.current.id if session.current is not None else None,
            "approvals_waiting": list(session.approvals),
            "state_history": history,
            # Background processes ended by the awake cap (health.py), and
            # bytes on disk at the disk sampler's last round (disk.py).
            "awake_capped": session.awake_capped,
            "disk_used": session.disk_used,
            # Its lease (see PROTOCOL.md, "Nodes"): held here, at which epoch.
            "node": self.ctx.node,
            "lease_epoch": session.lease.epoch if session.lease is not None else None,
            # Sealed, its worker runs as this uid (as root; None otherwise).
            "sealed": self.pool.sealing.mode is not None,
            "uid": self.pool.sealed_uids.get(session.key),
            # Its worker's cgroup: the kernel's count against its limits.
            "cgroup": self.pool.cgroups.usage_dict(session.worker_id),
            # A reload since its worker started applies at its next start.
            "settings_outdated": session.settings is not None
            and session.settings is not self.ctx.settings,
            # Its model use through the supervisor's model endpoint (None:
            # none yet, or its worker calls the model itself).
            "model": _model_use(session.key),
        }


def _model_use(session: str) -> dict[str, Any] | None:
    """A session's meter at the model endpoint, with its HTTP key's name."""
    meter = model_gate.current().meter(session)
    if meter is None:
        return None
    return {**meter.describe(), "http_key": model_meter.tenant_of(session)}
