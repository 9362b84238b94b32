"""Prefixes a client asked to keep, each until its time-to-live ends.

Anthropic's `cache_control` breakpoints ask for the prompt up to each one
for 5 minutes (or an hour, `ttl: "1h"`), refreshed at every read; OpenAI's
`prompt_cache_retention: "24h"` for a whole prompt's prefix. Every computed
block is cached here anyway; what a retention changes is the eviction
order on every tier (kv/radix_cache.py on the device, kv/lower_tiers.py on
host and disk): other blocks go first, and a retained block leaves a tier
only when nothing else is left to take (then the device spills it to the
host tier as any other, the host demotes it to disk). So under pressure a
marked prefix still hits, from whichever tier holds it, where an unmarked
one was dropped; it is not pinned: a pool that needs its frames for
running requests still gets them.

Blocks are named by their chained hashes (kv/scope.py): a retention is
for one cache scope's blocks, and a client reaches only its own. The map is
bounded (MAX_ENTRIES, expired entries pruned first, then those that expire
soonest), so no client can grow it without limit."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable

MAX_ENTRIES = 1 << 20  # ~100 MB of dict at most; far more blocks than any tier of one machine holds
TTL_S = {"5m": 300.0, "1h": 3600.0, "24h": 86400.0}  # the ttl values the providers define


class Retention:
    def __init__(self, clock: Callable[[], float] = time.monotonic, max_entries: int = MAX_ENTRIES) -> None:
        self.clock, self.max_entries = clock, max_entries
        self._until: dict[bytes, float] = {}  # chained block hash -> when its retention ends
        self.num_deferred = 0  # evictions that took another block first

    def __len__(self) -> int:
        return len(self._until)

    def __bool__(self) -> bool:  # the evictors' fast path: nothing retained, nothing to ask
        return bool(self._until)

    def retain(self, hashes: Iterable[bytes], ttl_s: float) -> None:
        """Keep these blocks until now + ttl_s (a longer retention already there stays)."""
        until = self.clock() + ttl_s
        for h in hashes:
            if self._until.get(h, 0.0) < until:
                self._until[h] = until
        if len(self._until) > self.max_entries:
            self._shrink()

    def holds(self, block_hash: bytes) -> bool:
        """Whether this block is retained now (an expired entry is dropped here)."""
        until = self._until.get(block_hash)
        if until is None:
            return False
        if until < self.clock():
            del self._until[block_hash]
            return False
        return True

    def holds_any(self, hashes: Iterable[bytes]) -> bool:
        return any(self.holds(h) for h in hashes)

    def holds_hex(self, key: str) -> bool:
        """holds() for a lower tier's key (the hash in hex)."""
        return self.holds(bytes.fromhex(key))

    def _shrink(self) -> None:
        now = self.clock()
        self._until = {h: t for h, t in self._until.items() if t >= now}
        over = len(self._until) - self.max_entries
        if over > 0:  # still too many: those that would expire soonest go
            for h, _ in sorted(self._until.items(), key=lambda item: item[1])[:over]:
                del self._until[h]

    def clear(self) -> None:
        self._until.clear()

