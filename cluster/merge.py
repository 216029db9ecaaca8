"""Merging the answers of many nodes into one answer, as one supervisor
would have given it. No I/O.

`list`: every node's rows, each with `node` (the node that reported it,
unless the supervisor named its node itself). On a shared data directory
every node lists the sessions it finds on disk as `exited`, so one key can
come from several nodes of one data directory: of those, every row that is
not `exited` is kept (two would be one key live on two nodes: shown, never
hidden), else one: the row of the node the key is placed on, then the first
by node name. Nodes with data directories of their own (`data_of`) each
hold their own history of a key, so a key listed by two of them is listed
twice, once per node: a key with two histories (`route reconcile` finds
them).

`status`: the router's own fields, session counts summed over the nodes,
and one row per node (`nodes`), with what that node said of itself.

`reload`: what changed anywhere, and what needs a restart anywhere; if
every node that answered refused it, the first refusal.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from hermes_sup.protocol import Kind, Message

EXITED = "exited"


def merge_sessions(
    answers: Mapping[str, list[dict[str, Any]]],
    owner: Callable[[str], str | None] = lambda key: None,
    data_of: Callable[[str], str] = lambda node: "",
) -> list[dict[str, Any]]:
    """One `sessions` list from each node's rows, sorted by key then node:
    per key, one row per data directory, and every row that is not `exited`."""
    live: list[dict[str, Any]] = []
    best: dict[tuple[str, str], tuple[tuple[int, str], dict[str, Any]]] = {}
    for node in sorted(answers):
        for raw in answers[node]:
            if not isinstance(raw, dict) or not isinstance(raw.get("key"), str):
                continue  # a node's bad row is left out, never fatal to the list
            row = dict(raw)
            row.setdefault("node", node)
            key = row["key"]
            if row.get("state") != EXITED:
                live.append(row)
                continue
            rank = (0 if owner(key) == node else 1, node)
            held = best.get((key, data_of(node)))
            if held is None or rank < held[0]:
                best[(key, data_of(node))] = (rank, row)
    # An exited row stands for its data directory's history only where no
    # node serving that directory has the key live.
    live_at = {(row["key"], data_of(str(row["node"]))) for row in live}
    rows = live + [row for where, (_, row) in best.items() if where not in live_at]
    return sorted(rows, key=lambda row: (row["key"], str(row["node"])))


def sum_counts(counts: list[Mapping[str, Any]]) -> dict[str, int]:
    """Sessions by state, summed over nodes (non-integer values ignored)."""
    total: dict[str, int] = {}
    for one in counts:
        for state, n in one.items():
            if isinstance(n, int) and not isinstance(n, bool):
                total[state] = total.get(state, 0) + n
    return total


def merge_status(
    router: dict[str, Any],
    answers: Mapping[str, dict[str, Any] | None],
    nodes: Mapping[str, dict[str, Any]],
) -> dict[str, Any]:
    """The router's `info` map: its own fields, totals, and `nodes`.

    `answers` maps a node to its `supervisor` map (None: it did not answer);
    `nodes` maps a node to what the router knows of it (endpoint, live,
    draining, capacity)."""
    answered = {n: a for n, a in answers.items() if a is not None}
    info = dict(router)
    info["sessions"] = sum_counts(
        [a["sessions"] for a in answered.values() if isinstance(a.get("sessions"), dict)]
    )
    for field in ("total_sessions", "max_sessions", "queued", "spare_workers"):
        info[field] = sum(
            v
            for a in answered.values()
            if isinstance(v := a.get(field), int) and not isinstance(v, bool)
        )
    info["accepting"] = any(a.get("accepting") is True for a in answered.values())
    rows = []
    for name in sorted(set(nodes) | set(answers)):
        row: dict[str, Any] = {"name": name, **nodes.get(name, {})}
        reply = answers.get(name)
        row["answered"] = reply is not None
        if reply is not None:
            row["status"] = reply
            # A supervisor that knows its node says so: whether it drains,
            # and how many sessions it may hold (its `capacity`, not the
            # router's weight for it, which is the row's `capacity`).
            own = reply.get("node")
            if isinstance(own, dict):
                if "draining" in own:
                    row["draining"] = own["draining"]
                if "capacity" in own:
                    row["max_sessions"] = own["capacity"]
        rows.append(row)
    info["nodes"] = rows
    return info


def merge_reloads(answers: Mapping[str, Message | None], re: str) -> Message:
    """One answer to a `reload` from each node's (None: it did not answer)."""
    ok = [m for m in answers.values() if m is not None and m.kind is not Kind.ERROR]
    errors = [m for m in answers.values() if m is not None and m.kind is Kind.ERROR]
    if not ok and errors:
        return Message(Kind.ERROR, errors[0].body, re=re)  # e.g. every node refused it
    changed = {str(x) for m in ok for x in m.body.get("changed", [])}
    restart = {str(x) for m in ok for x in m.body.get("restart_needed", [])}
    return Message(
        Kind.RELOADED, {"changed": sorted(changed), "restart_needed": sorted(restart)}, re=re
    )
