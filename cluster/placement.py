"""Which node serves a session key: rendezvous hashing plus an override table.

Rendezvous (highest random weight) hashing scores every (key, node) pair
and picks the node with the highest score. A node that leaves takes only
its own keys with it: every other key keeps its highest-scoring node. A
node's score is weighted by its capacity (the weighted form of Schindelhauer
and Schomaker: `-capacity / ln(u)`, with `u` the pair's hash in (0, 1)), so
a node with twice the capacity is chosen for about twice as many keys.

The override table records where a session is known to live when that is
not where the hash would send it: a node answered `moved` and named the
node that holds the session's lease (after a drain, or a failover the hash
has since undone). An override is followed while its node is live, for
OVERRIDE_TTL seconds from when a node last said so: then the key goes where
the hash puts it again. If its session is still live where the override
pointed, that node's lease makes the hashed node answer `moved` and the
override is set anew (one hop more, once per OVERRIDE_TTL); if the session
went idle and let its lease go (hibernated, on a shared data directory),
the hashed node takes it: keys placed off their hash by a failover or a
restart come back to their nodes, and a node that joins gets its share of
the idle ones, not only new keys. The table is bounded (least recently
used first out) so that a stream of moved keys cannot grow the router
without limit. No I/O here (a clock).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

# 2^64: hashes are mapped into the open interval (0, 1).
_SCALE = float(1 << 64)
# Seconds an override is followed after a node last said the key is there.
OVERRIDE_TTL = 60.0


@dataclass(frozen=True)
class Candidate:
    """A node as placement sees it."""

    name: str
    capacity: float = 1.0
    live: bool = True
    draining: bool = False

    @property
    def eligible(self) -> bool:
        """Whether it may take keys by hash (new sessions)."""
        return self.live and not self.draining and self.capacity > 0


def score(key: str, node: str, capacity: float = 1.0) -> float:
    """The weighted rendezvous score of `key` on `node` (higher wins)."""
    digest = hashlib.blake2b(
        key.encode("utf-8"), digest_size=8, person=b"hsup-rdv", key=node.encode("utf-8")[:64]
    ).digest()
    # (h + 0.5) / 2^64 is never 0 or 1, so the log is finite and negative.
    u = (int.from_bytes(digest, "big") + 0.5) / _SCALE
    return -capacity / math.log(u)


def rendezvous(key: str, nodes: Iterable[Candidate]) -> str | None:
    """The eligible node with the highest score for `key` (None: there is none).

    Ties (practically impossible) go to the smaller name, so every router
    picks the same node."""
    best: tuple[float, str] | None = None
    for node in nodes:
        if not node.eligible:
            continue
        s = score(key, node.name, node.capacity)
        if best is None or s > best[0] or (s == best[0] and node.name < best[1]):
            best = (s, node.name)
    return best[1] if best else None


class Overrides:
    """Keys known to live elsewhere than their hash says, bounded (LRU),
    each for `ttl` seconds from when it was set."""

    def __init__(
        self,
        capacity: int = 100_000,
        ttl: float = OVERRIDE_TTL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.capacity = capacity
        self.ttl = ttl
        self.clock = clock
        self._table: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def set(self, key: str, node: str) -> None:
        """Record that `key` lives on `node` (now)."""
        self._table[key] = (node, self.clock())
        self._table.move_to_end(key)
        while len(self._table) > self.capacity:
            self._table.popitem(last=False)

    def get(self, key: str) -> str | None:
        """The node `key` was last said to live on, unless that is older than `ttl`."""
        held = self._table.get(key)
        if held is None:
            return None
        if self.clock() - held[1] > self.ttl:
            del self._table[key]
            return None
        return held[0]

    def forget(self, key: str) -> None:
        self._table.pop(key, None)

    def forget_node(self, node: str) -> int:
        """Drop every override naming `node` (it left); how many there were."""
        gone = [k for k, (n, _) in self._table.items() if n == node]
        for k in gone:
            del self._table[k]
        return len(gone)

    def __len__(self) -> int:
        return len(self._table)


class Placement:
    """The nodes a router knows and where each key goes."""

    def __init__(self, override_capacity: int = 100_000) -> None:
        self.nodes: dict[str, Candidate] = {}
        self.overrides = Overrides(override_capacity)

    def update(self, node: Candidate) -> None:
        """Add a node or change what is known of it."""
        self.nodes[node.name] = node

    def remove(self, name: str) -> None:
        """A node left the membership: its keys (and overrides to it) move."""
        self.nodes.pop(name, None)
        self.overrides.forget_node(name)

    def owner(self, key: str) -> str | None:
        """Where a request about `key` goes now (None: no live node).

        An override wins while its node is live, draining or not: a draining
        node still finishes the sessions it holds."""
        pinned = self.overrides.get(key)
        if pinned is not None:
            node = self.nodes.get(pinned)
            if node is not None and node.live:
                return pinned
        return rendezvous(key, self.nodes.values())

    def live(self) -> list[str]:
        """Names of the live nodes, sorted (the fan-out set)."""
        return sorted(n.name for n in self.nodes.values() if n.live)
