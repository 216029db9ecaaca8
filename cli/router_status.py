"""`hermes-sup status` of a router: its own fields and one line per node
(`status` asked of a router answers with a merged map, cluster/merge.py,
which has no runtime, zygote or memory of its own)."""

from __future__ import annotations

from typing import Any

from .show import duration


def router_lines(info: dict[str, Any]) -> list[str]:
    """What `status` prints for a router's merged answer."""
    counts = ", ".join(f"{n} {s}" for s, n in sorted(info.get("sessions", {}).items())) or "none"
    nodes = info.get("nodes") or []
    answering = sum(1 for n in nodes if n.get("answered"))
    endpoints = info.get("endpoints") or {}
    lines = [
        f"hermes-sup router {info.get('version', '?')} (protocol {info.get('protocol', '?')}), "
        f"pid {info.get('pid', '?')}, up {duration(float(info.get('uptime', 0.0)))}",
        f"control:   {endpoints.get('control')}",
    ]
    if endpoints.get("tcp"):
        lines.append(f"tcp:       {endpoints['tcp']} (CURVE)")
    lines += [
        f"nodes:     {answering} of {len(nodes)} answering",
        f"sessions:  {info.get('total_sessions', 0)} ({counts}); at most "
        f"{info.get('max_sessions', 0)} live; {info.get('queued', 0)} turn(s) queued",
    ]
    for node in nodes:
        lines.append("  " + node_line(node))
    if not info.get("accepting", True):
        lines.append("no node is accepting turns")
    return lines


def node_line(node: dict[str, Any]) -> str:
    """One node: where it is, whether it answers, its weight and its sessions."""
    state = "answering" if node.get("answered") else ("linked" if node.get("live") else "DOWN")
    parts = [f"{node.get('name')}: {state}", str(node.get("endpoint", "?"))]
    if node.get("capacity") is not None:
        parts.append(f"weight {node['capacity']:g}")
    status = node.get("status") or {}
    if "total_sessions" in status:
        room = node.get("max_sessions", status.get("max_sessions"))
        parts.append(f"{status['total_sessions']} session(s), at most {room} live")
    if node.get("draining"):
        parts.append("DRAINING")
    return ", ".join(parts)
