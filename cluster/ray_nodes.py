"""What a Ray node is called and where its supervisor listens, from what
Ray says of it (ray.nodes()). No Ray import: plain dicts in, answers out.

A node's name must survive a raylet restart (a restarted raylet gets a new
NodeID), so that its supervisor comes back on the same state directory and
data directory (BASE/<name>) and finds its own sessions. It is, in order:

- the node's label `hermes-sup-node` (`ray start --labels hermes-sup-node=NAME`),
  for several raylets on one host, or a name of the operator's choosing;
- else the host's name, as its raylet reports it.

Two alive nodes with one name would share a state directory: the second is
refused, with a sentence that says how to name it. A node's capacity (its
weight for new sessions) may be set the same way, by `hermes-sup-capacity`.

With a resource named (`ray up --resource NAME`), only nodes that declare
it (`ray start --resources '{"NAME": 200}'`, or a node type's resources in
an autoscaler's config) get an agent, and the agent reserves all of it:
the amount is the node's capacity (its weight; a label still overrides
it). Ray then counts the node as in use while its agent lives, so an
autoscaler does not remove it under its sessions, and nodes of a type
that declares the resource are the ones it starts for hermes-sup.

The supervisor binds to the address Ray knows for its node (the raylet's
`--node-ip-address`), not to what a guess from inside a worker finds: on a
cluster started on 127.0.0.1 that guess was the host's public address.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .nodes import NAME_RE, NodeConfigError

NAME_LABEL = "hermes-sup-node"
CAPACITY_LABEL = "hermes-sup-capacity"


def node_name(node: dict[str, Any]) -> str:
    """The stable name of a node (ray.nodes() entry); NodeConfigError if
    neither its label nor its host name makes a usable one."""
    labels = node.get("Labels") or {}
    raw = labels.get(NAME_LABEL) or node.get("NodeManagerHostname") or ""
    name = str(raw).split(".")[0] if NAME_LABEL not in labels else str(raw)
    if not NAME_RE.fullmatch(name):
        raise NodeConfigError(
            f"Ray node {node.get('NodeID', '?')[:12]} has no usable name ({raw!r}): label it "
            f"with `ray start --labels {NAME_LABEL}=NAME` (letters, digits, ._@-)"
        )
    return name


def node_capacity(node: dict[str, Any], default: float) -> float:
    """The node's weight for new sessions: its label, else `default`."""
    raw = (node.get("Labels") or {}).get(CAPACITY_LABEL)
    if raw is None:
        return default
    try:
        capacity = float(raw)
    except ValueError:
        capacity = -1.0
    if not capacity > 0 or capacity == float("inf"):
        raise NodeConfigError(
            f"Ray node {node_name(node)!r}: label {CAPACITY_LABEL}={raw!r} is not a positive number"
        )
    return capacity


def node_address(nodes: list[dict[str, Any]], node_id: str) -> str:
    """The address Ray knows for node `node_id` (its raylet's --node-ip-address)."""
    for node in nodes:
        if node.get("NodeID") == node_id and node.get("NodeManagerAddress"):
            return str(node["NodeManagerAddress"])
    raise LookupError(f"Ray does not list node {node_id[:12]}")


def name_alive(nodes: list[dict[str, Any]]) -> tuple[dict[str, str], list[str]]:
    """Names for the alive nodes: ({NodeID: name}, problems). A node whose
    name another alive node has (sorted by NodeID, the first keeps it) or
    that has none is left out, and a problem says why."""
    named: dict[str, str] = {}
    by_name: dict[str, str] = {}
    problems: list[str] = []
    alive = sorted((n for n in nodes if n.get("Alive")), key=lambda n: str(n.get("NodeID")))
    for node in alive:
        node_id = str(node["NodeID"])
        try:
            name = node_name(node)
        except NodeConfigError as exc:
            problems.append(str(exc))
            continue
        if name in by_name:
            problems.append(
                f"Ray nodes {by_name[name][:12]} and {node_id[:12]} are both named {name!r} "
                f"(one host?): name each with `ray start --labels {NAME_LABEL}=NAME`"
            )
            continue
        by_name[name] = node_id
        named[node_id] = name
    return named, problems


@dataclass(frozen=True)
class AgentPlan:
    """An agent to start: on which node, under what name, with what weight,
    reserving what (Ray resources, for the actor's options)."""

    node_id: str
    name: str
    capacity: float
    reserve: dict[str, float]


def plan_agents(
    nodes: list[dict[str, Any]], capacity: float, resource: str | None = None
) -> tuple[list[AgentPlan], list[str]]:
    """The agents the alive nodes should have, and why any node has none
    (a name problem; without the named resource it is not a hermes-sup
    node, which is said too)."""
    named, problems = name_alive(nodes)
    by_id = {str(n.get("NodeID")): n for n in nodes}
    plans = []
    for node_id, name in named.items():
        node = by_id[node_id]
        reserve: dict[str, float] = {}
        weight = capacity
        if resource is not None:
            amount = (node.get("Resources") or {}).get(resource)
            if not amount or amount <= 0:
                problems.append(f"node {name!r} declares no {resource!r} resource: no agent there")
                continue
            reserve, weight = {resource: float(amount)}, float(amount)
        try:
            weight = node_capacity(node, weight)
        except NodeConfigError as exc:
            problems.append(str(exc))
            continue
        plans.append(AgentPlan(node_id, name, weight, reserve))
    return plans, problems
