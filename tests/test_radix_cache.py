"""Radix prefix cache (trajserve/kv/radix_cache.py): unit tests, a stateful
property test of the refcount invariants, and the spec's fork example.

Spec: kv-cache-management, "跨轮次前缀缓存", "最长前缀匹配", "动态基数树淘汰",
"通过写时复制分支实现零复制审慎推理", eq. 2."""
from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from trajserve.kv.block_pool import BlockPool
from trajserve.kv.radix_cache import RadixCache, RadixNode

B = 4
NS = ("model", None, "salt-a")


def seq(*labels: int, tail: int = 0) -> list[int]:
    """One B-token block per label (block x = [x*B, x*B+1, ...]) plus `tail`
    tokens of a partial block."""
    toks = [x * B + j for x in labels for j in range(B)]
    return toks + [10_000 + j for j in range(tail)]


def cache_with(num_blocks: int = 64) -> tuple[BlockPool, RadixCache]:
    pool = BlockPool(num_blocks)
    return pool, RadixCache(pool, B)


def put(pool: BlockPool, cache: RadixCache, labels: list[int], ns=NS, keep: bool = False):
    """A request that prefilled `labels` and finished: insert, then let go of
    its own references, so only the tree holds the blocks."""
    ids = pool.allocate(len(labels))
    res = cache.insert(ns, seq(*labels), ids)
    if not keep:
        pool.free(ids)
    return ids, res


# ------------------------------------------------------------------ unit tests

def test_match_on_empty_tree():
    _, cache = cache_with()
    m = cache.match_prefix(NS, seq(1, 2, 3))
    assert m.block_ids == [] and m.num_tokens == 0 and m.last_node.is_root
    cache.lock(m.last_node)  # locking the root is a harmless no-op
    cache.unlock(m.last_node)
    assert cache.num_nodes == 0 and cache.namespaces() == []  # lookups add no root
    with pytest.raises(ValueError):
        cache.insert_blocks(NS, cache.block_keys(seq(1, 2)), [0])  # 2 keys, 1 id


def test_insert_then_match_full_partial_diverging():
    pool, cache = cache_with()
    ids, res = put(pool, cache, [1, 2, 3])
    assert res.num_new_blocks == 3 and res.duplicates == [] and res.node.block_ids == ids
    assert [pool.ref_counts[b] for b in ids] == [1, 1, 1]  # tree only

    full = cache.match_prefix(NS, seq(1, 2, 3))
    assert full.block_ids == ids and full.num_tokens == 3 * B

    longer = cache.match_prefix(NS, seq(1, 2, 3, 4, 5))
    assert longer.block_ids == ids and longer.num_tokens == 3 * B

    partial = cache.match_prefix(NS, seq(1, 2))
    assert partial.block_ids == ids[:2] and partial.num_tokens == 2 * B

    diverging = cache.match_prefix(NS, seq(1, 7, 3))
    assert diverging.block_ids == ids[:1] and diverging.num_tokens == B

    first_differs = cache.match_prefix(NS, seq(9, 2, 3))
    assert first_differs.block_ids == [] and first_differs.last_node.is_root
    # Matching never takes references.
    assert [pool.ref_counts[b] for b in ids] == [1, 1, 1]


def test_split_in_the_middle_keeps_block_ids_in_order():
    pool, cache = cache_with()
    ids, res = put(pool, cache, [1, 2, 3, 4, 5, 6])
    leaf = res.node
    cache.lock(leaf)
    m = cache.match_prefix(NS, seq(1, 2, 3, 9))
    upper = m.last_node
    assert m.block_ids == ids[:3]
    assert upper.block_ids == ids[:3] and upper.key == [tuple(seq(x)) for x in (1, 2, 3)]
    # The deep end keeps its identity (a request's handle stays valid).
    assert leaf.block_ids == ids[3:] and leaf.parent is upper
    assert upper.children == {tuple(seq(4)): leaf}
    # The new upper node inherits the pin of the locked leaf.
    assert upper.ref_count == leaf.ref_count == 1
    assert cache.num_nodes == 2 and cache.num_cached_blocks == 6
    assert cache.match_prefix(NS, seq(1, 2, 3, 4, 5, 6)).block_ids == ids
    # Pool refcounts are unchanged by the split: still one tree ref each.
    assert [pool.ref_counts[b] for b in ids] == [1] * 6
    # Splitting again inside the lower part.
    m2 = cache.match_prefix(NS, seq(1, 2, 3, 4))
    assert m2.block_ids == ids[:4] and m2.last_node.block_ids == [ids[3]]
    assert leaf.block_ids == ids[4:]
    cache.unlock(leaf)
    assert upper.ref_count == m2.last_node.ref_count == leaf.ref_count == 0


def test_block_aligned_truncation():
    pool, cache = cache_with()
    ids, _ = put(pool, cache, [1, 2, 3])
    # 2 full blocks + 3 tokens that do match block 3's first tokens: the
    # partial block is a miss (spec: S_usable = floor(S_match / B) * B).
    toks = seq(1, 2) + seq(3)[:3]
    m = cache.match_prefix(NS, toks)
    assert m.num_tokens == 2 * B and m.block_ids == ids[:2]
    assert m.num_tokens % B == 0
    with pytest.raises(ValueError):
        cache.insert(NS, seq(1, 2, tail=1), pool.allocate(3))  # partial tail refused
    for node in cache.iter_nodes():
        assert all(len(k) == B for k in node.key)


def test_namespaces_isolate():
    pool, cache = cache_with()
    ids, _ = put(pool, cache, [1, 2, 3], ns=("m", None, "salt-a"))
    assert cache.match_prefix(("m", None, "salt-b"), seq(1, 2, 3)).num_tokens == 0
    assert cache.match_prefix(("m", "lora-1", "salt-a"), seq(1, 2, 3)).num_tokens == 0
    assert cache.match_prefix(("m", None, "salt-a"), seq(1, 2, 3)).block_ids == ids
    other, res = put(pool, cache, [1, 2, 3], ns=("m", None, "salt-b"))
    assert res.num_new_blocks == 3 and res.duplicates == []  # no sharing across salts
    assert set(other).isdisjoint(ids)
    # Invalidating one namespace leaves the other intact.
    cache.invalidate(("m", None, "salt-b"))
    assert cache.match_prefix(("m", None, "salt-a"), seq(1, 2, 3)).block_ids == ids
    assert cache.match_prefix(("m", None, "salt-b"), seq(1, 2, 3)).num_tokens == 0


def test_duplicate_insert_reports_and_does_not_double_incref():
    pool, cache = cache_with()
    a, _ = put(pool, cache, [1, 2, 3], keep=True)  # request A still holds its table
    assert [pool.ref_counts[x] for x in a] == [2, 2, 2]
    b = pool.allocate(4)  # request B computed the same 3 blocks privately
    res = cache.insert(NS, seq(1, 2, 3, 4), b)
    assert res.duplicates == [(0, a[0]), (1, a[1]), (2, a[2])]
    assert res.num_new_blocks == 1 and res.node.block_ids == [b[3]]
    assert [pool.ref_counts[x] for x in a] == [2, 2, 2]  # the tree kept its own
    assert [pool.ref_counts[x] for x in b] == [1, 1, 1, 2]  # only b[3] adopted
    # Re-inserting what the tree already holds (same ids) changes nothing.
    again = cache.insert(NS, seq(1, 2, 3), a)
    assert again.duplicates == [] and again.num_new_blocks == 0
    assert [pool.ref_counts[x] for x in a] == [2, 2, 2]
    assert again.node.block_ids == a  # ends exactly at the inserted prefix


def test_incremental_insert_adds_only_new_blocks():
    pool, cache = cache_with()
    ids = pool.allocate(5)
    r1 = cache.insert(NS, seq(1, 2), ids[:2])
    cache.lock(r1.node)
    r2 = cache.insert(NS, seq(1, 2, 3, 4, 5), ids)
    cache.lock(r2.node)
    cache.unlock(r1.node)
    assert r2.num_new_blocks == 3 and r2.node.parent is r1.node
    assert [pool.ref_counts[x] for x in ids] == [2] * 5  # table + tree, once each
    assert r1.node.ref_count == 1 and r2.node.ref_count == 1
    cache.unlock(r2.node)
    pool.free(ids)
    assert cache.evict(10) == 5 and pool.num_free == pool.num_blocks


def test_lru_order_of_eviction():
    pool, cache = cache_with()
    a, _ = put(pool, cache, [1, 1])
    b, _ = put(pool, cache, [2, 2])
    c, _ = put(pool, cache, [3, 3])
    cache.match_prefix(NS, seq(1, 1))  # a is now the most recent
    assert cache.evict(2) == 2
    assert pool.ref_counts[b[0]] == 0 and pool.ref_counts[a[0]] == 1 == pool.ref_counts[c[0]]
    assert cache.evict(1) == 2  # whole nodes go: c (2 blocks)
    assert pool.ref_counts[c[0]] == 0 and pool.ref_counts[a[0]] == 1
    assert cache.evict(1) == 2 and cache.num_cached_blocks == 0
    assert cache.evict(1) == 0  # nothing left
    assert cache.num_evicted_nodes == 3 and cache.num_evicted_blocks == 6
    pool.check()


def test_unlock_refreshes_lru_time():
    pool, cache = cache_with()
    a, ra = put(pool, cache, [1])
    cache.lock(ra.node)  # a long-running request uses [1] ...
    b, _ = put(pool, cache, [2])  # ... while [2] is cached and left alone
    cache.unlock(ra.node)  # [1] was in use until now: it is the recent one
    assert cache.evict(1) == 1
    assert pool.ref_counts[b[0]] == 0 and pool.ref_counts[a[0]] == 1


def test_the_least_urgent_release_goes_first_then_lru():
    """A path takes the priority of the request that last released it; the
    highest number (least urgent) is evicted first, least recently used within
    a priority, and an unlock without one leaves the path's class."""
    pool, cache = cache_with()
    urgent, ru = put(pool, cache, [1, 1])
    cache.lock(ru.node)
    cache.unlock(ru.node, priority=-5)  # released first: LRU alone would take it first
    bulk, rb = put(pool, cache, [2])
    cache.lock(rb.node)
    cache.unlock(rb.node, priority=7)
    plain, rp = put(pool, cache, [3])
    cache.lock(rp.node)
    cache.unlock(rp.node, priority=7)  # same class as bulk, more recent
    assert cache.evict(1) == 1 and pool.ref_counts[bulk[0]] == 0  # 7, older
    assert cache.evict(1) == 1 and pool.ref_counts[plain[0]] == 0  # 7, newer
    assert pool.ref_counts[urgent[0]] == 1  # -5: the last to go
    cache.lock(ru.node)
    cache.unlock(ru.node)  # an unlock that names no priority leaves the path's class
    assert ru.node.priority == -5
    assert cache.evict(5) == 2 and cache.num_cached_blocks == 0
    pool.check()


def test_a_split_upper_node_keeps_the_paths_priority():
    pool, cache = cache_with()
    ids, r = put(pool, cache, [1, 2, 3])
    cache.lock(r.node)
    cache.unlock(r.node, priority=3)
    other = pool.allocate(1)
    cache.insert(NS, seq(1, 9), [ids[0], other[0]])  # splits [1 2 3] after its first block
    assert r.node.parent.priority == 3 and r.node.priority == 3


def test_eviction_cascades_to_parent_only_after_its_children():
    pool, cache = cache_with()
    p, _ = put(pool, cache, [1, 2])
    x, _ = put(pool, cache, [1, 2, 3])
    y, _ = put(pool, cache, [1, 2, 4])
    # The two later inserts found [1, 2] cached: their copies were duplicates.
    assert cache.num_cached_blocks == 4 and pool.num_used == 4
    parent = cache.match_prefix(NS, seq(1, 2)).last_node
    # Make the parent the least recently used node: only leaves may go first.
    cache.match_prefix(NS, seq(1, 2, 3))
    cache.match_prefix(NS, seq(1, 2, 4))
    parent.last_access = -1  # even if it looked oldest, it is not a leaf
    assert cache.evict(1) == 1
    assert len(parent.children) == 1 and pool.ref_counts[p[0]] == 1
    assert cache.evict(1) == 1
    assert parent.children == {} and pool.ref_counts[p[0]] == 1  # now a leaf, still cached
    assert cache.evict(1) == 2  # the cascade: parent evicted as a whole node
    assert pool.num_free == pool.num_blocks and cache.num_nodes == 0
    assert cache.namespaces() == []


def test_locked_nodes_are_never_evicted():
    pool, cache = cache_with()
    ids, res = put(pool, cache, [1, 2, 3])
    other, _ = put(pool, cache, [5, 6])
    m = cache.match_prefix(NS, seq(1, 2))  # splits [1 2 | 3]
    cache.lock(m.last_node)
    freed = cache.evict(100)
    # [5 6] and the unpinned leaf [3] go; the pinned [1 2] stays.
    assert freed == 3 and cache.num_cached_blocks == 2
    assert [pool.ref_counts[b] for b in ids[:2]] == [1, 1]
    assert cache.match_prefix(NS, seq(1, 2, 3)).block_ids == ids[:2]
    # Pinning a deep node pins its ancestors as well.
    deep_ids = pool.allocate(1)
    deep = cache.insert(NS, seq(1, 2, 7), ids[:2] + deep_ids).node
    pool.free(deep_ids)
    cache.lock(deep)
    cache.unlock(m.last_node)
    assert m.last_node.ref_count == 1  # still pinned through `deep`
    assert cache.evict(100) == 0
    cache.unlock(deep)
    assert cache.evict(100) == 3 and pool.num_free == pool.num_blocks


def test_evict_counts_only_blocks_returned_to_the_free_list():
    pool, cache = cache_with()
    ids, res = put(pool, cache, [1, 2], keep=True)  # a table still holds them (fork child)
    assert cache.evict(2) == 0  # tree refs dropped, nothing freed
    assert cache.num_evicted_blocks == 2 and cache.num_freed_blocks == 0
    assert [pool.ref_counts[b] for b in ids] == [1, 1]
    with pytest.raises(ValueError):
        cache.lock(res.node)  # an evicted handle must be matched again
    pool.free(ids)
    assert pool.num_free == pool.num_blocks


def test_invalidate_under_a_prefix_removes_only_that_subtree():
    pool, cache = cache_with()
    sys_ids, _ = put(pool, cache, [1, 2])
    fa, _ = put(pool, cache, [1, 2, 30, 31])  # sys + old text of file A
    fb, _ = put(pool, cache, [1, 2, 40, 41])  # sys + file B
    fa2, _ = put(pool, cache, [1, 2, 30, 31, 32])  # a later turn over file A
    before = pool.num_used
    # The first stale token is the first token of file A's block 30.
    dropped = cache.invalidate(NS, seq(1, 2) + seq(30)[:1])
    assert dropped == 3  # [30 31] and [32]
    assert pool.num_used == before - 3
    assert cache.match_prefix(NS, seq(1, 2, 30, 31, 32)).block_ids == sys_ids  # system prompt kept
    assert cache.match_prefix(NS, seq(1, 2, 40, 41)).block_ids == sys_ids + fb[2:]  # file B kept
    # A partial first stale token only removes children that start with it.
    assert cache.invalidate(NS, seq(1, 2) + [999]) == 0
    # A block-aligned prefix whose last block is the first stale one.
    assert cache.invalidate(NS, seq(1, 2, 40)) == 2
    assert cache.match_prefix(NS, seq(1, 2, 40, 41)).num_tokens == 2 * B
    # Whole namespace.
    assert cache.invalidate(NS) == 2 and pool.num_free == pool.num_blocks
    assert cache.invalidate(NS) == 0


def test_invalidate_in_use_detaches_and_releases_on_unlock():
    pool, cache = cache_with()
    ids, res = put(pool, cache, [1, 2, 3], keep=True)  # the request keeps its table
    cache.lock(res.node)
    assert cache.invalidate(NS, seq(1)[:1]) == 3
    assert res.node.detached and cache.num_detached_blocks == 3
    assert cache.match_prefix(NS, seq(1, 2, 3)).num_tokens == 0  # never served again
    assert [pool.ref_counts[b] for b in ids] == [2, 2, 2]  # table + detached node
    # A fresh insert of the same tokens builds a new path (e.g. recomputed KV).
    new = pool.allocate(3)
    r = cache.insert(NS, seq(1, 2, 3), new)
    assert r.num_new_blocks == 3 and r.duplicates == []
    cache.unlock(res.node)
    assert cache.num_detached_blocks == 0 and [pool.ref_counts[b] for b in ids] == [1, 1, 1]
    pool.free(ids)
    pool.free(new)
    assert cache.clear() == 3 and pool.num_free == pool.num_blocks


def test_clear_keeps_nodes_in_use():
    pool, cache = cache_with()
    ids, res = put(pool, cache, [1, 2, 3])
    put(pool, cache, [4])
    m = cache.match_prefix(NS, seq(1, 2))
    cache.lock(m.last_node)
    assert cache.clear() == 2  # [3] and [4]
    assert cache.match_prefix(NS, seq(1, 2, 3)).block_ids == ids[:2]
    cache.unlock(m.last_node)
    assert cache.clear() == 2 and pool.num_free == pool.num_blocks and cache.namespaces() == []


def test_heap_is_not_rebuilt_per_call_and_stays_bounded():
    pool, cache = cache_with(256)
    nodes = [put(pool, cache, [i, i + 100])[1].node for i in range(50)]
    for _ in range(40):  # lock/unlock churn pushes an entry per unlock
        for n in nodes:
            cache.lock(n)
            cache.unlock(n)
    assert len(cache._heap) <= 2 * cache.num_nodes + 65
    # Every dormant leaf still has exactly one valid entry: LRU order holds.
    cache.match_prefix(NS, seq(0, 100))
    cache.evict(2 * 49)
    assert cache.num_nodes == 1 and cache.match_prefix(NS, seq(0, 100)).num_tokens == 2 * B


def test_fork_example_4_branches_share_a_95_block_prefix():
    """Spec "通过写时复制分支实现零复制审慎推理": forking copies block ids, not
    KV. 4 branches over a 95-block prefix, 9 private blocks each: 95 + 4*9 =
    131 physical blocks, where deep copies would need 4 * (95 + 9) = 416."""
    bs, prefix_blocks, branches, private = 16, 95, 4, 9
    pool = BlockPool(200)  # 416 would not even fit
    cache = RadixCache(pool, bs)
    prefix = list(range(prefix_blocks * bs))

    # (a) Explicit fork: child tables copy the parent's ids (incref).
    parent = pool.allocate(prefix_blocks)
    node = cache.insert("ns", prefix, parent).node
    cache.lock(node)
    tables = []
    for _ in range(branches):
        t = list(parent)
        pool.incref(t)
        cache.lock(node)
        t += pool.allocate(private)
        tables.append(t)
    pool.free(parent)  # the parent is pruned; its branches live on
    cache.unlock(node)
    assert pool.num_used == prefix_blocks + branches * private == 131
    assert len({b for t in tables for b in t}) == 131
    assert all(pool.ref_counts[b] == branches + 1 for b in tables[0][:prefix_blocks])  # + tree
    assert all(pool.ref_counts[b] == 1 for t in tables for b in t[prefix_blocks:])
    for t in tables:
        pool.free(t)
        cache.unlock(node)
    assert pool.num_used == prefix_blocks  # the tree keeps the prefix warm

    # (b) No explicit lineage: 4 new requests with the same prefix hit the tree.
    tables = []
    for i in range(branches):
        m = cache.match_prefix("ns", prefix + [10_000 + i] * (private * bs))
        assert m.num_tokens == prefix_blocks * bs and m.block_ids == parent
        pool.incref(m.block_ids)
        cache.lock(m.last_node)
        tables.append((m.block_ids + pool.allocate(private), m.last_node))
    assert pool.num_used == 131 and pool.num_used != branches * (prefix_blocks + private)
    for t, n in tables:
        pool.free(t)
        cache.unlock(n)
    assert cache.clear() == prefix_blocks and pool.num_free == pool.num_blocks
    pool.check()


# ------------------------------------------------------- stateful property test

SB = 2  # small blocks so short token lists span several
PREFIXES = [[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7], [1, 2, 9, 9], [7, 7, 7, 7, 7, 7]]
NAMESPACES = ["a", "b"]
tokens_st = st.lists(st.integers(0, 2), max_size=6)


class Req:
    __slots__ = ("ns", "tokens", "table", "node")

    def __init__(self, ns, tokens, table, node):
        self.ns, self.tokens, self.table, self.node = ns, tokens, table, node


class RadixMachine(RuleBasedStateMachine):
    """Requests drive the cache like the KV cache manager will: match, reuse,
    allocate, insert full blocks as they fill, fork, finish, cancel; eviction
    and invalidation interleave. The invariants tie pool refcounts, tables and
    tree together after every step."""

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(40)
        self.cache = RadixCache(self.pool, SB)
        self.reqs: dict[int, Req] = {}
        self.next_id = 0

    # --- helpers
    def _alloc(self, n: int) -> list[int] | None:
        if self.pool.num_free < n:
            free_before = self.pool.num_free
            freed = self.cache.evict(n - self.pool.num_free)
            assert self.pool.num_free == free_before + freed
        if self.pool.num_free < n:
            return None
        return self.pool.allocate(n)

    def _insert_full(self, r: Req, relock: bool) -> None:
        full = len(r.tokens) // SB
        res = self.cache.insert(r.ns, r.tokens[:full * SB], r.table[:full])
        assert res.node.depth_tokens(SB) == full * SB
        for i, cached in res.duplicates:
            # Switch to the cached block, drop our private copy.
            assert cached != r.table[i]
            self.pool.incref([cached])
            self.pool.free([r.table[i]])
            r.table[i] = cached
        if relock:
            self.cache.lock(res.node)
            if r.node is not None:
                self.cache.unlock(r.node)
            r.node = None if res.node.is_root else res.node

    def _release(self, r: Req) -> None:
        if r.node is not None:
            # Requests of three priority classes (and some that name none): eviction orders by them.
            self.cache.unlock(r.node, (None, -3, 0, 5)[len(r.tokens) % 4])
        self.pool.free(r.table)

    def _pick(self, data) -> int:
        return data.draw(st.sampled_from(sorted(self.reqs)))

    # --- rules
    @rule(ns=st.sampled_from(NAMESPACES), prefix=st.sampled_from(PREFIXES), suffix=tokens_st,
          insert_now=st.booleans())
    def add(self, ns, prefix, suffix, insert_now):
        tokens = prefix + suffix
        if not tokens:
            return
        m = self.cache.match_prefix(ns, tokens)
        assert m.num_tokens == len(m.block_ids) * SB <= len(tokens)
        assert m.block_ids == self._oracle_match(ns, tokens)
        self.pool.incref(m.block_ids)
        self.cache.lock(m.last_node)
        need = -(-len(tokens) // SB) - len(m.block_ids)
        rest = self._alloc(need)
        if rest is None:  # no room even after eviction: give it all back
            self.cache.unlock(m.last_node)
            self.pool.free(m.block_ids)
            return
        r = Req(ns, tokens, m.block_ids + rest, None if m.last_node.is_root else m.last_node)
        if r.node is None:
            self.cache.unlock(m.last_node)
        self.reqs[self.next_id] = r
        self.next_id += 1
        if insert_now:
            self._insert_full(r, relock=True)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), more=st.lists(st.integers(0, 2), min_size=1, max_size=5), insert=st.booleans())
    def append(self, data, more, insert):
        r = self.reqs[self._pick(data)]
        if len(r.tokens) % SB and self.pool.ref_counts[r.table[-1]] > 1:
            # Copy-on-write: the partial tail is shared with a fork.
            new = self._alloc(1)
            if new is None:
                return
            self.pool.free([r.table[-1]])
            r.table[-1] = new[0]
        need = -(-(len(r.tokens) + len(more)) // SB) - len(r.table)
        rest = self._alloc(need)
        if rest is None:
            return
        r.tokens = r.tokens + more
        r.table += rest
        if insert:
            self._insert_full(r, relock=True)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), lock=st.booleans())
    def fork(self, data, lock):
        r = self.reqs[self._pick(data)]
        self.pool.incref(r.table)
        node = None
        if lock and r.node is not None:
            self.cache.lock(r.node)
            node = r.node
        self.reqs[self.next_id] = Req(r.ns, list(r.tokens), list(r.table), node)
        self.next_id += 1

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finish(self, data):
        r = self.reqs.pop(self._pick(data))
        if not (r.node is not None and r.node.detached):  # don't re-cache stale text
            self._insert_full(r, relock=False)
        self._release(r)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def cancel(self, data):
        self._release(self.reqs.pop(self._pick(data)))

    @rule(k=st.integers(0, 12))
    def evict(self, k):
        free_before = self.pool.num_free
        dormant = [n for n in self.cache.iter_nodes() if n.ref_count == 0 and not n.children]
        first = max((n.priority for n in dormant), default=None)
        freed = self.cache.evict(k)
        if freed and first is not None:
            # The least urgent dormant leaf goes first: none of that class was kept while one of another went.
            gone = [n for n in dormant if n.detached]
            assert not gone or any(n.priority == first for n in gone)
        assert self.pool.num_free == free_before + freed
        # Short only when nothing dormant is left (the cascade reaches every
        # dormant node, since pins cover whole paths).
        assert freed >= k or self.cache.num_evictable_blocks == 0

    @rule(ns=st.sampled_from(NAMESPACES), prefix=st.sampled_from(PREFIXES), suffix=tokens_st)
    def match(self, ns, prefix, suffix):
        tokens = prefix + suffix
        m = self.cache.match_prefix(ns, tokens)
        assert m.block_ids == self._oracle_match(ns, tokens)
        assert m.last_node.is_root or m.last_node.depth_tokens(SB) == m.num_tokens

    @rule(ns=st.sampled_from(NAMESPACES), prefix=st.sampled_from(PREFIXES), extra=tokens_st,
          whole=st.booleans())
    def invalidate(self, ns, prefix, extra, whole):
        tokens = prefix + extra
        if whole or not tokens:
            self.cache.invalidate(ns)
            assert self.cache.match_prefix(ns, tokens).num_tokens == 0
            assert not list(self.cache.iter_nodes(ns))
            return
        self.cache.invalidate(ns, tokens)
        k = (len(tokens) - 1) // SB  # block holding the first stale token
        for r in self.reqs.values():
            if r.ns == ns and r.tokens[:len(tokens)] == tokens:
                assert self.cache.match_prefix(ns, r.tokens).num_tokens <= k * SB

    # --- oracle and invariants
    def _paths(self, ns) -> dict[tuple, int]:
        """Every cached block as (path of block keys) -> block id."""
        out = {}

        def walk(node, path):
            for i, key in enumerate(node.key):
                out[path + tuple(node.key[:i + 1])] = node.block_ids[i]
            for c in node.children.values():
                walk(c, path + tuple(node.key))
        root = self.cache._roots.get(ns)
        if root is not None:
            for c in root.children.values():
                walk(c, ())
        return out

    def _oracle_match(self, ns, tokens) -> list[int]:
        paths = self._paths(ns)
        blocks = [tuple(tokens[i * SB:(i + 1) * SB]) for i in range(len(tokens) // SB)]
        ids = []
        for i in range(len(blocks)):
            b = paths.get(tuple(blocks[:i + 1]))
            if b is None:
                break
            ids.append(b)
        return ids

    def _held_nodes(self) -> list[RadixNode]:
        """Attached nodes plus detached ones still pinned by a request."""
        seen: dict[int, RadixNode] = {id(n): n for n in self.cache.iter_nodes()}
        for r in self.reqs.values():
            n = r.node
            while n is not None and not n.is_root:
                seen.setdefault(id(n), n)
                n = n.parent
        return list(seen.values())

    @invariant()
    def refcounts_match_holders(self):
        pool, cache = self.pool, self.cache
        pool.check()
        assert pool.num_free + pool.num_used == pool.num_blocks
        holders = Counter(b for r in self.reqs.values() for b in r.table)
        nodes = self._held_nodes()
        tree = Counter(b for n in nodes for b in n.block_ids)
        # A detached node may share a block with a later re-insert of the same
        # table; among attached nodes a block is stored once.
        attached_refs = Counter(b for n in self.cache.iter_nodes() for b in n.block_ids)
        assert all(c == 1 for c in attached_refs.values()), "a block stored by two radix nodes"
        for b in range(pool.num_blocks):
            assert pool.ref_counts[b] == holders[b] + tree[b], f"block {b}"
        free = set(pool._free)
        assert not free & (set(holders) | set(tree)), "a free block is still referenced"
        attached = list(cache.iter_nodes())
        assert cache.num_cached_blocks == sum(n.num_blocks for n in attached)
        assert cache.num_evictable_blocks == sum(n.num_blocks for n in attached if n.ref_count == 0)
        assert cache.num_detached_blocks == sum(n.num_blocks for n in nodes if n.detached)
        assert cache.num_nodes == len(attached)

    @invariant()
    def pins_cover_paths(self):
        expected = Counter()
        for r in self.reqs.values():
            n = r.node
            while n is not None and not n.is_root:
                expected[id(n)] += 1
                n = n.parent
        for n in self._held_nodes():
            assert n.ref_count == expected[id(n)]
            if n.ref_count > 0:
                p = n.parent
                while not p.is_root:
                    assert p.ref_count > 0
                    p = p.parent

    @invariant()
    def tree_shape(self):
        heap_live = {id(e[3]): e for e in self.cache._heap if e[2] == e[3].heap_stamp}
        for root in self.cache._roots.values():
            assert root.block_ids == [] and root.ref_count == 0
        for n in self.cache.iter_nodes():
            assert not n.detached and not n.parent.detached  # no parent gone before a child
            assert n.parent.children[n.key[0]] is n
            assert len(n.key) == len(n.block_ids) >= 1
            assert all(len(k) == SB for k in n.key)  # never a partial block
            if n.ref_count == 0 and not n.children:
                # A dormant leaf is findable by eviction, at its priority and LRU time.
                e = heap_live.get(id(n))
                assert e is not None and e[:2] == (-n.priority, n.last_access)

    def teardown(self):
        for rid in list(self.reqs):
            r = self.reqs.pop(rid)
            if not (r.node is not None and r.node.detached):
                self._insert_full(r, relock=False)
            self._release(r)
        self.cache.clear()
        assert self.cache.num_cached_blocks == 0 and self.cache.num_detached_blocks == 0
        assert self.pool.num_free == self.pool.num_blocks
        self.pool.check()


RadixMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
test_radix_stateful = RadixMachine.TestCase
