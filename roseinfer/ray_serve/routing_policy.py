"""Which replica should take a request: prefix affinity with a load guard, or round-robin.

Pure Python (no Ray), so the policy is tested on its own; ``router.py`` adapts it to
Ray Serve's ``RequestRouter``.

``prefix`` (the default): an ``AffinityTable`` remembers, for each prefix block hash,
the replica that was last sent a prompt containing that block. A request goes to the
replica owning its longest remembered prefix, unless that replica has more than
``imbalance_threshold`` requests in flight above the least loaded one: then load
wins. A prompt with no remembered prefix goes to the least loaded replica, ties
broken by the fewest remembered blocks, so new prefixes spread evenly over the
replicas instead of piling onto the first.

``round_robin``: replicas in turn, whatever the prompt (the baseline the tests and
the benchmark compare with).
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

RoutingMode = Literal["prefix", "round_robin"]
ROUTING_MODES: tuple[RoutingMode, ...] = ("prefix", "round_robin")
DEFAULT_TABLE_CAPACITY = 200_000  # remembered block hashes (~16 bytes of state each)


class AffinityTable:
    """Block hash -> the replica last sent a prompt with that block (LRU-bounded)."""

    def __init__(self, capacity: int = DEFAULT_TABLE_CAPACITY) -> None:
        self.capacity = capacity
        self._owner: OrderedDict[int, str] = OrderedDict()
        self._owned: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._owner)

    def owned(self, replica: str) -> int:
        return self._owned[replica]

    def record(self, replica: str, hashes: Iterable[int]) -> None:
        for h in hashes:
            previous = self._owner.pop(h, None)
            if previous is not None:
                self._owned[previous] -= 1
            self._owner[h] = replica
            self._owned[replica] += 1
        while len(self._owner) > self.capacity:
            _, evicted = self._owner.popitem(last=False)
            self._owned[evicted] -= 1

    def longest_match(self, hashes: Sequence[int], alive: Iterable[str]) -> tuple[str | None, int]:
        """(replica, blocks) of the longest prefix of ``hashes`` remembered on a live replica.

        Hashes chain, so block i names the whole prefix up to it: the deepest hit wins.
        """
        live = set(alive)
        for depth in range(len(hashes), 0, -1):
            owner = self._owner.get(hashes[depth - 1])
            if owner is not None and owner in live:
                return owner, depth
        return None, 0

    def forget(self, replica: str) -> None:
        """Drop a replica that died or left (its cache is gone with it)."""
        for h in [h for h, owner in self._owner.items() if owner == replica]:
            del self._owner[h]
        self._owned.pop(replica, None)


@dataclass
class RoutingPolicy:
    mode: RoutingMode = "prefix"
    imbalance_threshold: int = 4
    table: AffinityTable = field(default_factory=AffinityTable)
    _turn: itertools.count = field(default_factory=itertools.count, repr=False)

    def __post_init__(self) -> None:
        if self.mode not in ROUTING_MODES:
            raise ValueError(f"routing must be one of {ROUTING_MODES}, got {self.mode!r}")
        if self.imbalance_threshold < 0:
            raise ValueError("imbalance_threshold must be >= 0")

    def rank(self, replicas: Sequence[str], loads: Mapping[str, int],
             hashes: Sequence[int] = ()) -> list[str]:
        """``replicas`` in order of preference for a request with these prefix hashes."""
        if not replicas:
            return []
        ordered = sorted(replicas)
        if self.mode == "round_robin":
            start = next(self._turn) % len(ordered)
            return ordered[start:] + ordered[:start]
        by_load = sorted(ordered, key=lambda r: (loads.get(r, 0), self.table.owned(r)))
        owner, depth = self.table.longest_match(hashes, ordered)
        if owner is None or depth == 0:
            return by_load
        least = loads.get(by_load[0], 0)
        if loads.get(owner, 0) - least > self.imbalance_threshold:
            return by_load  # the owner is busy: balance load instead
        return [owner] + [r for r in by_load if r != owner]

    def routed(self, replica: str, hashes: Sequence[int]) -> None:
        """A request with these prefix hashes was accepted by ``replica``."""
        if self.mode == "prefix" and hashes:
            self.table.record(replica, hashes)

    def forget(self, replica: str) -> None:
        self.table.forget(replica)
