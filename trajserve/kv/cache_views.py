"""What the KV manager shows the rest of the engine: counts, typed snapshots
and the few questions the scheduler, sessions and the simulator ask.

The pool, the radix tree, the block tables and the admission holds are the
KV manager's own (kv/cache_manager.py); no module outside kv/ reads them
(tests/test_import_graph.py checks). These are the answers instead:

    stats() / prefix_stats()   typed snapshots (U_KV's parts, the tree's counters)
    block_ids(rid), has_table  a request's block table, for the step's chunks
    cold_blocks(hit)           a match's blocks nobody holds (admitting makes them active)
    block_keys(tokens)         a history chunked into block keys, once
    borrowed(n)                free blocks lent for a measurement, given back after
    subscribe(sink)            blocks entering and leaving the tree (the cluster's directory)

A mixin of KVCacheManager: it works on the manager's pool, tree and tables.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from trajserve.kv.radix_node import BlockKey, MatchResult

DeviceEventSink = Callable[[bool, list[bytes]], None]  # (stored, chained hashes) as blocks enter or leave the tree


@dataclass(frozen=True, slots=True)
class KVStats:
    """The device pool, now (kv-cache-management eq. 8: U_KV = used / num_blocks)."""
    num_blocks: int
    free_blocks: int
    used_blocks: int          # allocated, cold cache included (it is reclaimable)
    reclaimable_blocks: int   # cached blocks nobody holds
    cow_copies: int           # copy-on-write block copies so far
    reclaimed_blocks: int     # blocks paused state gave up under pressure so far
    promoted_blocks: int      # blocks a match loaded back from the lower tiers so far

    @property
    def active_blocks(self) -> int:
        return self.used_blocks - self.reclaimable_blocks


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """The radix tree's contents and counters so far."""
    cached_blocks: int
    evicted_blocks: int
    spilled_blocks: int       # evicted into the lower tiers instead of dropped


class CacheViews:
    def stats(self) -> KVStats:
        pool = self.pool
        return KVStats(pool.num_blocks, pool.num_free, pool.num_used, self.num_reclaimable, self.num_cow_copies,
                       self.num_reclaimed_blocks, self.num_promoted_blocks)

    def prefix_stats(self) -> PrefixCacheStats | None:
        """None without prefix caching."""
        r = self.radix
        return None if r is None else PrefixCacheStats(r.num_cached_blocks, r.num_evicted_blocks,
                                                       r.num_spilled_blocks)

    @property
    def prefix_caching(self) -> bool:
        return self.radix is not None

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used

    def page_map(self):
        """A window model's pool (kv/window_pool.py): each block's page per
        layer, [ids, layers] (-1: none), the live array; None otherwise."""
        return getattr(self.pool, "page_of", None)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (the live list: valid until the next allocation or release)."""
        return self.tables[request_id].block_ids

    def has_table(self, request_id: str) -> bool:
        return request_id in self.tables

    def cold_blocks(self, hit: MatchResult | None) -> int:
        """Blocks of a match that no request or pin holds (cold in the tree,
        or just promoted from a lower tier): admitting makes them active."""
        return self.radix.num_cold_blocks(hit.last_node) if hit is not None and self.radix is not None else 0

    def block_keys(self, token_ids: list[int]) -> list[BlockKey]:
        """token_ids' full blocks as the tree keys them: chunk a long history
        once and pass the keys to the path calls (pin, evict_prefix, ...)."""
        return self.radix.block_keys(token_ids)

    @contextmanager
    def borrowed(self, num_blocks: int) -> Iterator[list[int]]:
        """Up to num_blocks free blocks (fewer if fewer are free), given back
        when the block ends: a measurement's scratch (engine/calibration.py)."""
        ids = self.pool.allocate(min(num_blocks, self.pool.num_free))
        try:
            yield ids
        finally:
            self.pool.free(ids)

    def subscribe(self, sink: DeviceEventSink) -> None:
        """sink(stored, chained hashes) as blocks enter the tree or leave it
        (the cluster's prefix directory follows a replica's tree with it)."""
        if self.radix is None:
            raise ValueError("device KV events come from the prefix cache: enable prefix caching")
        if self.radix.on_event is not None:
            raise ValueError("this KV manager already has an event sink")
        self.radix.on_event = sink
