"""Where each key's history lives: its home, recorded where every router sees it.

A session's history is its directory in a data directory. Nodes that share
one data directory (`shared_data`, nodes.py) can each serve its sessions;
a node with a data directory of its own is the only one that can. If a
router started a key anew on another node while that node was away, the
key would have two histories, and which one a turn reached would depend
on which node was up: turns made meanwhile would vanish when it came back.

So the first time a router places a key it records the key's home: the
data directory its history is made in (`NodeSpec.data`: the shared data
directory's id, else the node's own name). From then on every router sends
the key only to a node serving that data directory, and answers
`home_unavailable`, naming the node, while none is live. A home is claimed,
never overwritten: of two routers placing one key at once, both end up
with whichever was recorded first.

A store does blocking I/O (the router calls it from an executor); the
routing table (routing.py) only sees what it answered. `MemoryHomes` serves
one router alone (a `--nodes` router, tests); `RayHomes` keeps the table
in the Ray cluster's GCS key-value store, which every router of the
cluster reads and which outlives any one actor.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Protocol

# What a home is called for a node that has its data directory to itself
# (NodeSpec.data): the node's name, marked so that no shared data
# directory's id can be taken for it.
OWN_DATA = "node:"


def home_node(data: str) -> str | None:
    """The node a home names when its data is that node's own, else None."""
    return data[len(OWN_DATA) :] if data.startswith(OWN_DATA) else None


def describe_home(data: str) -> str:
    """A home for a sentence: 'node a' or 'shared data directory 3f2a...'."""
    node = home_node(data)
    return f"node {node}" if node is not None else f"shared data directory {data}"


class HomeStore(Protocol):
    """A table of key -> home that every router of a cluster shares."""

    def claim(self, key: str, data: str) -> str:
        """Record `data` as the key's home unless it has one; the home it
        has now (maybe another router's, or an older one)."""

    def claim_many(self, homes: Iterable[tuple[str, str]]) -> dict[str, str]:
        """`claim` for many keys: each key's home now."""


class MemoryHomes:
    """The table in this process: for one router on its own, and tests."""

    def __init__(self) -> None:
        self.table: dict[str, str] = {}

    def claim(self, key: str, data: str) -> str:
        return self.table.setdefault(key, data)

    def claim_many(self, homes: Iterable[tuple[str, str]]) -> dict[str, str]:
        return {key: self.claim(key, data) for key, data in homes}


class RayHomes:
    """The table in the Ray cluster's GCS key-value store (one entry per
    key). A put that does not overwrite is atomic in the GCS, so two
    routers claiming one key agree. Call after ray.init (ray_agents.connect)."""

    NAMESPACE = "hermes-sup-homes"

    def claim(self, key: str, data: str) -> str:
        from ray.experimental import internal_kv

        name = key.encode()
        internal_kv._internal_kv_put(name, data.encode(), overwrite=False, namespace=self.NAMESPACE)
        held = internal_kv._internal_kv_get(name, namespace=self.NAMESPACE)
        return held.decode() if held is not None else data

    def claim_many(self, homes: Iterable[tuple[str, str]]) -> dict[str, str]:
        return {key: self.claim(key, data) for key, data in homes}


# Homes a router keeps (least recently used first out); one it does not
# is looked up again, at the cost of one round trip to the store.
HOMES_CACHED = 200_000


class KnownHomes:
    """The homes a router has learned from its store, bounded: the table's
    memory of them (no I/O; the store is asked for what is not here)."""

    def __init__(self, limit: int = HOMES_CACHED) -> None:
        self.known: OrderedDict[str, str] = OrderedDict()
        self.limit = limit

    def learn(self, key: str, home: str) -> None:
        self.known[key] = home
        self.known.move_to_end(key)
        while len(self.known) > self.limit:
            self.known.popitem(last=False)

    def get(self, key: str) -> str | None:
        """The key's home if known (and now the most recently used)."""
        home = self.known.get(key)
        if home is not None:
            self.known.move_to_end(key)
        return home
