"""Radix prefix cache: block-aligned prefix tree over physical KV blocks.

Spec: kv-cache-management, "跨轮次前缀缓存" (cross-turn prefix caching),
"最长前缀匹配" (longest prefix match, block-aligned truncation),
"动态基数树淘汰" (leaf-first LRU eviction) and eq. 2 (H_prefix).

The cache holds no tensors: it maps token prefixes to physical block ids of a
`BlockPool` and holds one pool reference per block it stores. A block id is
therefore referenced by its request block tables plus (at most) one radix
node, and returns to the free list only when all of them let go.

Layout (block size B = 4, one namespace)::

    root ─┬─ [s0 s1 s2 s3 | s4 s5 s6 s7]  blocks (3, 9)      system prompt
          │        ├─ [u0 u1 u2 u3]                blocks (4,)   turn A
          │        └─ [v0 v1 v2 v3 | v4 v5 v6 v7]  blocks (5, 1) turn B
          └─ ...

    request  s0..s7 v0..v7 w0 w1          (18 tokens)
    match    |<--- 4 full blocks --->|    16 tokens; w0 w1 is a partial
                                          block: never matched, never stored

Each node stores a whole number of blocks: its edge label is a list of
B-token tuples and `block_ids[i]` holds the KV of `key[i]`. Children are keyed
by their first block of tokens, so a lookup hashes B tokens, never one.

Namespaces: everything that determines the KV state besides the tokens
(model, adapter, tenant salt) selects a separate root, so two salts never
share a block even for identical system prompts (DESIGN.md invariants).

Reference counting, two kinds:
  * `pool.ref_counts[b]`: holders of physical block b (block tables + the
    one radix node that stores it).
  * `RadixNode.ref_count`: requests currently using the node or a descendant
    (`lock` pins the whole path to the root). A node with ref_count > 0 is
    never evicted, and every ancestor of a pinned node is pinned.

Eviction (spec "动态基数树淘汰"): dormant leaves (ref_count 0, no children) sit
in a heap ordered by priority, then `last_access`: a path takes the
priority of the request that last released it (`unlock(node, priority)`),
and the least urgent go first (the highest number; all 0 under FCFS, plain
LRU), so a high-priority conversation's blocks are the last to be dropped;
entries are invalidated lazily by a per-node stamp, so
lock/unlock/match/insert push at most one entry each and `evict` never
rebuilds the heap. When a leaf goes and its parent becomes a dormant leaf,
the parent is pushed (cascade): a parent is never evicted before its
children.

Lower tiers (hierarchical cache, "分层辅助存储"): with a `spill` set, LRU
eviction hands each leaf's blocks to it before they are freed, under their
chained block hashes (hash of the namespace, then of each block's tokens
chained through every block before it), so a block's hash names its whole
prefix. The KV manager looks those hashes up when a match stops short and
loads what the tiers hold back into the tree (KVCacheManager.match).
"""
from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Iterator, Sequence

from trajserve.kv.block_pool import BlockPool
from trajserve.kv.radix_invalidate import Invalidation
from trajserve.kv.radix_node import (BlockKey, InsertResult, MatchResult, RadixNode, Spill, chain_hash,  # noqa: F401
                                     namespace_hash)
from trajserve.kv.retention import Retention

class RadixCache(Invalidation):
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.pool = pool
        self.block_size = block_size
        self._roots: dict[Hashable, RadixNode] = {}
        self._clock = 0  # monotonic logical time for last_access
        self._heap: list[tuple[int, int, int, RadixNode]] = []  # (-priority, last_access, stamp, node)
        self._stamp = 0
        self._num_nodes = 0  # attached, non-root
        self.num_cached_blocks = 0  # blocks held by attached nodes
        self.num_evictable_blocks = 0  # ... of which in nodes with ref_count 0 (dormant)
        self._mark_dormant = getattr(pool, "mark_dormant", None)  # a window pool counts their window parts
        self.num_detached_blocks = 0  # held by invalidated nodes still in use
        self.num_evicted_nodes = 0
        self.num_evicted_blocks = 0  # tree references dropped by evict()
        self.num_freed_blocks = 0  # ... of which went back to the free list
        self.num_invalidated_blocks = 0
        self.spill: Spill | None = None  # lower tiers for LRU-evicted blocks
        self.retention: Retention | None = None  # prefixes clients asked to keep: evicted last
        self.num_spilled_blocks = 0
        self._ns_hashes: dict[Hashable, bytes] = {}
        # KV events (a cluster router's prefix directory, cluster/directory.py):
        # on_event(stored, chained hashes) as blocks enter the tree or leave it
        # (evicted, invalidated, cleared). None: nothing is hashed for it.
        self.on_event: Callable[[bool, list[bytes]], None] | None = None

    # ------------------------------------------------------------------ match

    def match_prefix(self, namespace: Hashable, token_ids: Sequence[int]) -> MatchResult:
        """Longest cached prefix of `token_ids`, truncated to full blocks
        (spec "最长前缀匹配": S_usable = floor(S_match / B) * B).

        Splits a node when the match ends inside its slice, so `last_node`
        ends exactly at the match. Refreshes last_access along the path;
        changes no refcount (lock the node to pin it).

        A caller that needs logits for the last prompt token should match
        `token_ids[:-1]`, so at least one token is left to prefill.
        """
        return self.match_blocks(namespace, self.block_keys(token_ids))

    def match_blocks(self, namespace: Hashable, keys: Sequence[BlockKey]) -> MatchResult:
        """`match_prefix` on keys from `block_keys` (a request that keeps its
        keys as its blocks fill does not re-chunk its whole prompt per call)."""
        root = self._roots.get(namespace)
        if root is None:  # an unseen namespace: don't grow the root table on lookups
            return MatchResult([], 0, RadixNode(key=[], block_ids=[], parent=None, namespace=namespace))
        node, n, block_ids = self._walk(root, keys if isinstance(keys, list) else list(keys))
        self._touch(node)
        return MatchResult(block_ids, n * self.block_size, node)

    def block_keys(self, token_ids: Sequence[int]) -> list[BlockKey]:
        """The B-token tuples of the full blocks of `token_ids`; a partial tail
        is dropped: it is never matched nor stored.

            tokens  t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9      (B = 4)
            keys    (t0..t3)      (t4..t7)                 t8 t9 dropped
        """
        # zip over B references to one iterator yields consecutive B-tuples.
        return list(zip(*[iter(token_ids)] * self.block_size))

    # --------------------------------------------------------------- pinning

    def num_cold_blocks(self, node: RadixNode) -> int:
        """Blocks on node's path that nobody holds (ref_count 0): what locking
        it would turn from reclaimable into active. A lock pins the whole
        path, so the first held node up the path ends the count."""
        n = 0
        while node.parent is not None and node.ref_count == 0:
            n += len(node.block_ids)
            node = node.parent
        return n

    def lock(self, node: RadixNode) -> None:
        """Pin `node` and its ancestors (the request reads their blocks)."""
        if node.detached and node.ref_count == 0:
            raise ValueError(f"lock of an evicted or invalidated radix node {node!r}: match again")
        while node.parent is not None:
            if node.ref_count == 0 and not node.detached:
                self._dormant(node.block_ids, False)
            node.ref_count += 1
            node = node.parent

    def unlock(self, node: RadixNode, priority: int | None = None) -> None:
        """Undo one `lock(node)`. A node whose count drops to 0 becomes
        dormant (evictable once it is a leaf); an invalidated node releases its
        blocks to the pool instead. The path counts as used until now, so its
        LRU time is refreshed: a long-running request's prefix is not the
        first to go the moment it finishes. `priority`: the releasing
        request's, the path's eviction class from now (None: unchanged)."""
        self._clock += 1
        t = self._clock
        while node.parent is not None:
            if node.ref_count <= 0:
                raise AssertionError(f"unlock of an unlocked radix node {node!r}")
            node.ref_count -= 1
            node.last_access = t
            if priority is not None:
                node.priority = priority
            if node.ref_count == 0:
                if node.detached:
                    self._release_detached(node)
                else:
                    self._dormant(node.block_ids, True)
                    if not node.children:
                        self._push(node)
            node = node.parent

    # ----------------------------------------------------------------- insert

    def insert(self, namespace: Hashable, token_ids: Sequence[int],
               block_ids: Sequence[int]) -> InsertResult:
        """Store the full blocks `block_ids` holding `token_ids`.

        `len(token_ids)` must be `len(block_ids) * block_size` (the caller
        drops its partial tail: only full blocks are shared). Blocks the tree
        lacks are adopted with one `pool.incref` each; where the tree holds a
        block for the same tokens already, it keeps its own and reports the
        caller's as a duplicate. Re-inserting a longer prefix of an inserted
        sequence (a running request whose blocks fill) adds only the new
        blocks, as a child of the node where the previous insert ended.

            tree      [A B] -- [C]
            insert     a b  c  d   ids (A, B, X, Y)
            result    [A B] -- [C] -- [Y]   duplicates [(2, C)], adopted 1
        """
        B = self.block_size
        if len(token_ids) != len(block_ids) * B:
            raise ValueError(f"{len(token_ids)} tokens for {len(block_ids)} blocks of {B}: "
                             "insert full blocks only")
        return self.insert_blocks(namespace, self.block_keys(token_ids), block_ids)

    def insert_blocks(self, namespace: Hashable, keys: Sequence[BlockKey],
                      block_ids: Sequence[int], below: RadixNode | None = None) -> InsertResult:
        """`insert` on keys from `block_keys`, one per block id.

        `below`: an attached node that ends exactly where `keys` begin (a
        running request's own locked path, extended as its blocks fill).
        The walk starts there instead of at the root, so growing a long
        context by one block costs O(1 block), not O(context); the result
        is the one a walk from the root over the whole path would give, and
        duplicate indices are relative to `keys`."""
        if len(keys) != len(block_ids):
            raise ValueError(f"{len(keys)} block keys for {len(block_ids)} block ids")
        if below is not None and below.detached:
            raise ValueError("insert below a detached radix node: insert the whole path from the root")
        if not keys:
            return InsertResult(below if below is not None else self.match_blocks(namespace, []).last_node, 0, [])
        root = below if below is not None else self._root(namespace)
        blocks = keys if isinstance(keys, list) else list(keys)
        node, n, cached = self._walk(root, blocks)
        duplicates = [(i, c) for i, c in enumerate(cached) if c != block_ids[i]]
        new = 0
        if n < len(blocks):
            new_ids = list(block_ids[n:])
            self.pool.incref(new_ids)
            leaf = RadixNode(key=blocks[n:], block_ids=new_ids, parent=node, namespace=namespace)
            node.children[leaf.key[0]] = leaf
            self._num_nodes += 1
            self.num_cached_blocks += len(new_ids)
            self._dormant(new_ids, True)
            new = len(new_ids)
            node = leaf
            if self.on_event is not None:
                self.on_event(True, self.block_hashes(leaf))
        self._touch(node)
        return InsertResult(node, new, duplicates)

    # ---------------------------------------------------------------- eviction

    def evict(self, num_blocks: int) -> int:
        """Drop dormant leaves, the least urgent priority first and the least
        recently used within it, until `num_blocks`
        blocks went back to the pool's free list or nothing is evictable.

        Returns the number of blocks that actually returned to the free list.
        A dormant node's block may still be in a request's block table (a fork
        child that never locked the node); dropping the tree's reference then
        frees nothing, and eviction goes on. `num_evicted_blocks` counts tree
        references dropped, `num_freed_blocks` blocks freed.

        O(log h) per popped heap entry (h = heap size); each stale entry is
        popped once, so the amortised cost is O(log h) per evicted node.
        """
        freed = 0
        retention = self.retention
        # Blocks a client asked to keep (kv/retention.py) go last: set aside
        # while anything else can go, then taken least recently used first.
        kept: list[RadixNode] = []
        # Not a local alias: a cascade's _push may compact self._heap into a
        # new list mid-loop, and entries pushed there must still be seen.
        while freed < num_blocks:
            if self._heap:
                *_, stamp, node = heapq.heappop(self._heap)
                if stamp != node.heap_stamp or not self._evictable(node):
                    continue  # stale: locked, grew a child, refreshed or gone since
                hashes = self.block_hashes(node) if retention else None
                if hashes is not None and retention.holds_any(hashes):
                    kept.append(node)
                    continue
            elif kept:
                node, hashes = kept.pop(0), None
                retention.num_deferred += 1
            else:
                break
            if self.spill is not None:
                # Down a tier instead of gone; the blocks are read before they are freed.
                self.spill.save(node.namespace, hashes or self.block_hashes(node), node.block_ids, node.priority)
                self.num_spilled_blocks += len(node.block_ids)
            freed += self._remove_leaf(node)
        for node in kept:  # still cached: back in the heap at their own time
            self._push(node)
        self.num_freed_blocks += freed
        return freed

    def evict_path(self, node: RadixNode, spill: bool = False) -> int:
        """Evict `node` and then its ancestors, deepest first, while each is a
        dormant leaf: a session's own history leaves the device, while a
        prefix other paths branch from (a shared preamble) or someone holds
        stays. spill: down to the lower tiers (a swap-out) instead of gone.
        Returns blocks freed to the pool."""
        freed = 0
        while node.parent is not None and not node.detached and self._evictable(node):
            parent = node.parent
            if spill and self.spill is not None:
                self.spill.save(node.namespace, self.block_hashes(node), node.block_ids, node.priority)
                self.num_spilled_blocks += len(node.block_ids)
            freed += self._remove_leaf(node)
            node = parent
        self.num_freed_blocks += freed
        return freed

    def _remove_leaf(self, node: RadixNode) -> int:
        """Take a dormant leaf out of the tree; returns blocks freed."""
        if self.on_event is not None:
            self.on_event(False, self.block_hashes(node))
        node.heap_stamp = -1
        self._dormant(node.block_ids, False)
        freed = self._drop_tree_refs(node.block_ids)
        self.num_evicted_nodes += 1
        self.num_evicted_blocks += len(node.block_ids)
        self.num_cached_blocks -= len(node.block_ids)
        self._num_nodes -= 1
        parent = node.parent
        del parent.children[node.key[0]]
        node.detached = True  # a handle to it must not be locked again
        # Cascade: the parent is a candidate once its last child is gone.
        if parent.parent is not None:
            if not parent.children and parent.ref_count == 0:
                self._push(parent)
        elif not parent.children and self._roots.get(parent.namespace) is parent:
            del self._roots[parent.namespace]
        return freed

    # ------------------------------------------------------------ block hashes

    def path_hash(self, node: RadixNode) -> bytes:
        """Chained hash of the whole path from the root to the end of `node`
        (a root: its namespace's hash). Memoized per node."""
        pending = []
        while node.parent is not None and node.hash_end is None:
            pending.append(node)
            node = node.parent
        h = node.hash_end if node.parent is not None else self._namespace_hash(node.namespace)
        for n in reversed(pending):
            for k in n.key:
                h = chain_hash(h, k)
            n.hash_end = h
        return h

    def block_hashes(self, node: RadixNode) -> list[bytes]:
        """The chained hash of each of `node`'s blocks."""
        h = self.path_hash(node.parent)
        out = []
        for k in node.key:
            h = chain_hash(h, k)
            out.append(h)
        return out

    def _namespace_hash(self, namespace: Hashable) -> bytes:
        h = self._ns_hashes.get(namespace)
        if h is None:
            h = self._ns_hashes[namespace] = namespace_hash(namespace)
        return h

    # ------------------------------------------------------------- inspection

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    def namespaces(self) -> list[Hashable]:
        return list(self._roots)

    def iter_nodes(self, namespace: Hashable | None = None) -> Iterator[RadixNode]:
        """Attached non-root nodes (of one namespace, or all), parents first."""
        if namespace is None:
            roots = list(self._roots.values())
        else:
            roots = [self._roots[namespace]] if namespace in self._roots else []
        stack = [c for r in roots for c in r.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def blocks_by_recency(self) -> list[int]:
        """Every block of the tree, in eviction's order: the least urgent
        class first, the least recently used path within it."""
        nodes = sorted(self.iter_nodes(), key=lambda n: (-n.priority, n.last_access))
        return [b for n in nodes for b in n.block_ids]

    # ---------------------------------------------------------------- private

    def _root(self, namespace: Hashable) -> RadixNode:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = RadixNode(key=[], block_ids=[], parent=None,
                                                      namespace=namespace)
        return root

    def _walk(self, root: RadixNode, blocks: Sequence[BlockKey]) -> tuple[RadixNode, int, list[int]]:
        """Follow `blocks` from `root`. Returns (node ending exactly at the
        match, blocks matched, their cached ids); a match that ends inside a
        node's slice splits that node there."""
        node, i, n = root, 0, len(blocks)
        ids: list[int] = []
        while i < n:
            child = node.children.get(blocks[i])
            if child is None:
                break
            key = child.key
            m = min(len(key), n - i)
            if key[:m] == blocks[i:i + m]:  # the common case, one C-level compare
                j = m
            else:
                j = 1  # key[0] matched by the dict lookup
                while j < m and key[j] == blocks[i + j]:
                    j += 1
            inside = j < len(key)
            if inside:
                child = self._split(child, j)
            ids.extend(child.block_ids)
            i += j
            node = child
            if inside:
                break
        return node, i, ids

    def _split(self, node: RadixNode, j: int) -> RadixNode:
        """Cut `node` after its first j blocks; returns the new upper node.

            before  parent -- [k0 .. k(j-1) kj .. kn]                 node
            after   parent -- [k0 .. k(j-1)] -- [kj .. kn]
                              new upper node    node (keeps its identity)

        The lower part keeps the node object, so handles held by requests
        (they locked the deep end) stay valid and the heap entry, if any, still
        refers to the leaf. The upper part inherits ref_count (every lock of
        the node pinned it), last_access and priority; pool refcounts are
        unchanged: each block is still held once by the tree.
        """
        parent = node.parent
        upper = RadixNode(key=node.key[:j], block_ids=node.block_ids[:j], parent=parent,
                          namespace=node.namespace, children={node.key[j]: node},
                          ref_count=node.ref_count, last_access=node.last_access, priority=node.priority)
        parent.children[upper.key[0]] = upper
        node.key = node.key[j:]
        node.block_ids = node.block_ids[j:]
        node.parent = upper
        self._num_nodes += 1
        return upper

    def _touch(self, node: RadixNode) -> None:
        """Refresh last_access from `node` up to the root (LRU order)."""
        self._clock += 1
        t = self._clock
        leaf = node
        while node.parent is not None:
            node.last_access = t
            node = node.parent
        if leaf.parent is not None and self._evictable(leaf):
            self._push(leaf)  # its old entry carries the old time: now stale

    @staticmethod
    def _evictable(node: RadixNode) -> bool:
        return (node.ref_count == 0 and not node.children and not node.detached
                and node.parent is not None)

    def _push(self, node: RadixNode) -> None:
        self._stamp += 1
        node.heap_stamp = self._stamp
        heapq.heappush(self._heap, (-node.priority, node.last_access, self._stamp, node))
        # Stale entries pile up under lock/unlock churn; compact when they
        # outnumber live nodes (amortised O(1) per push, never per evict call).
        if len(self._heap) > 2 * self._num_nodes + 64:
            self._heap = [e for e in self._heap if e[2] == e[3].heap_stamp and self._evictable(e[3])]
            heapq.heapify(self._heap)

    def _dormant(self, block_ids: list[int], on: bool) -> None:
        """Blocks join (on) or leave the nodes with ref_count 0: what
        eviction can free."""
        self.num_evictable_blocks += len(block_ids) if on else -len(block_ids)
        if self._mark_dormant is not None:
            self._mark_dormant(block_ids, on)

    def _drop_tree_refs(self, block_ids: list[int]) -> int:
        """pool.free the tree's reference; count blocks that hit the free list
        (a node's block ids are distinct, so that is the growth of the list)."""
        before = self.pool.num_free
        self.pool.free(block_ids)
        return self.pool.num_free - before
