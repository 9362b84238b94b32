"""Eviction classes of the blocks on the lower tiers (host and disk).

On the device the prefix cache evicts the least urgent priority first and
the least recently used within it (kv/radix_cache.py); a block it spills
down keeps the priority of the request that last released its path, and
each lower tier takes its blocks in the same order: of the blocks LRU may
take (none a paused session holds or a promotion is loading, the retained
last: kv/retention.py), those of the tier's least urgent class first, the
oldest within it. Under FCFS every block is of class 0 and nothing is
stored here: plain LRU.

Only blocks of a class other than 0 are recorded, with a count per tier and
class, so the least urgent class on a tier is known without a scan.
"""
from __future__ import annotations

from collections import Counter


class TierClasses:
    def __init__(self) -> None:
        self._of: dict[str, int] = {}  # key -> its class, where not 0
        self._count = {"host": Counter(), "disk": Counter()}  # tier -> class -> blocks there

    def set(self, key: str, priority: int) -> None:
        """The class a block keeps from now (before it is stored on a tier)."""
        if priority:
            self._of[key] = priority
        else:
            self._of.pop(key, None)

    def of(self, key: str) -> int:
        return self._of.get(key, 0)

    def moved(self, tier: str, stored: bool, key: str) -> None:
        """A block entered (stored) or left a tier."""
        p = self._of.get(key)
        if p is None:
            return
        c = self._count[tier]
        c[p] += 1 if stored else -1
        if c[p] <= 0:
            del c[p]

    def forget(self, key: str) -> None:
        """The block left the lower tiers (after it left its tier)."""
        self._of.pop(key, None)

    def worst(self, tier: str, blocks: int) -> int:
        """The least urgent class (the largest priority number) among a
        tier's `blocks` blocks."""
        c = self._count[tier]
        classes = list(c)
        if blocks > sum(c.values()):  # some are of class 0
            classes.append(0)
        return max(classes, default=0)

    def clear(self) -> None:
        self._of.clear()
        for c in self._count.values():
            c.clear()
