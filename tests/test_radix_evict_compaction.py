"""Regression: eviction must see parents pushed after the heap was compacted
mid-call (a cascade's push can replace the heap list)."""
from trajserve.kv.block_pool import BlockPool
from trajserve.kv.radix_cache import RadixCache


def test_evict_reaches_every_dormant_block_after_heap_compaction():
    B = 2
    pool = BlockPool(300)
    cache = RadixCache(pool, B)
    # A 100-node chain (each insert one block deeper, so each is its own node).
    tokens = []
    for i in range(100):
        tokens += [i, i]
        ids = cache.match_prefix("ns", tokens).block_ids
        cache.insert("ns", tokens, ids + pool.allocate(1))
        pool.free(cache.match_prefix("ns", tokens).block_ids[-1:])  # the tree keeps its own reference
    other = [999, 999]
    cache.insert("ns", other, pool.allocate(1))
    pool.free(cache.match_prefix("ns", other).block_ids)
    for _ in range(150):  # stale heap entries pile up, so a push compacts the heap
        cache.match_prefix("ns", other)
    assert cache.num_evictable_blocks == 101
    assert cache.evict(101) == 101
    assert pool.num_free == pool.num_blocks
