"""A radix path as a unit: what paused agent sessions do with their state.

A paused session's KV state is the radix path of its history. These keep it
(pin), drop it from the device (evict_prefix), and bring blocks saved on a
lower tier back into the tree (begin_import / finish_import); the prefix
cache's own tiers end their promotions through _adopt too. `keys`: the
path's block keys (radix.block_keys(token_ids)) when the caller keeps them,
so a long history is not re-chunked on every call.

A mixin of KVCacheManager (kv/cache_manager.py): it works on the manager's
radix cache and pool.
"""
from __future__ import annotations

from collections.abc import Hashable

from trajserve.kv.radix_node import BlockKey, MatchResult, RadixNode, chain_hash, namespace_hash
from trajserve.kv.scope import CacheScope


class PathOps:
    def cached_prefix(self, token_ids: list[int], scope: CacheScope,
                      keys: list[BlockKey] | None = None) -> MatchResult | None:
        """The device-resident full blocks of token_ids (all of them: no token
        is left out for logits here)."""
        ns = self.namespace(scope)
        if self.radix is None:
            return None
        return self.radix.match_blocks(ns, keys if keys is not None else self.radix.block_keys(token_ids))

    def pin(self, token_ids: list[int], scope: CacheScope, keys: list[BlockKey] | None = None
            ) -> RadixNode | None:
        hit = self.cached_prefix(token_ids, scope, keys)
        if hit is None or not hit.block_ids:
            return None
        self.radix.lock(hit.last_node)
        return hit.last_node

    def unpin(self, node: RadixNode) -> None:
        self.radix.unlock(node)

    # A resumed session's pin is held until its turn is admitted (kv/admission_hold.py).
    def hold(self, owner: Hashable, node: RadixNode) -> None:
        self.holds.hold(owner, node)

    def cancel_hold(self, owner: Hashable) -> None:
        if self.holds is not None:
            self.holds.cancel(owner)

    def release_admitted_holds(self) -> None:
        """After admission: the holds whose turns locked their paths go."""
        if self.holds:
            self.holds.release_admitted()

    def yield_holds(self, keep: MatchResult | None) -> int:
        """Waiting turns' holds give way (all but the one on `keep`'s path); returns how many went."""
        return self.holds.yield_except(keep.last_node if keep is not None else None) if self.holds else 0

    def release_all_holds(self) -> int:
        return self.holds.release_all() if self.holds else 0

    def evict_prefix(self, token_ids: list[int], scope: CacheScope, keys: list[BlockKey] | None = None
                     ) -> int:
        """Free the device blocks of this path no one else uses or branches from."""
        hit = self.cached_prefix(token_ids, scope, keys)
        return self.radix.evict_path(hit.last_node) if hit and hit.block_ids else 0

    def begin_import(self, token_ids: list[int], scope: CacheScope, num_blocks: int,
                     keys: list[BlockKey] | None = None) -> tuple[MatchResult, list[int]] | None:
        """Fresh blocks for full blocks [hit, num_blocks) of token_ids, to be
        filled from a lower tier; the device-resident hit is pinned meanwhile.
        None when the pool has no room even after eviction."""
        hit = self.cached_prefix(token_ids, scope, keys)
        need = num_blocks - len(hit.block_ids)
        if need <= 0:
            return hit, []
        self.radix.lock(hit.last_node)
        short = need + self.watermark_blocks - self.pool.num_free
        if short > 0:
            self._evict_for(short)
        if need > self.pool.num_free:
            self.radix.unlock(hit.last_node)
            return None
        return hit, self.pool.allocate(need)  # a window pool's: with their window pages, until finish_import

    def finish_import(self, token_ids: list[int], scope: CacheScope, hit: MatchResult,
                      new_ids: list[int], filled: int, keys: list[BlockKey] | None = None,
                      windows: list[bool] | None = None) -> None:
        """The first `filled` imported blocks hold their KV now: the tree takes
        them over; the rest (a block failed its checks) go back to the pool.
        windows: which of those came with their window part (a window pool)."""
        if not new_ids:
            return
        start, B = len(hit.block_ids), self.block_size
        new_keys = (keys[start:start + filled] if keys is not None
                    else self.radix.block_keys(token_ids[start * B:(start + filled) * B]))
        self._adopt(self.namespace(scope), hit, new_keys, new_ids, filled, windows)

    def _adopt(self, ns: Hashable, hit: MatchResult, new_keys: list[BlockKey], new_ids: list[int],
               filled: int, windows: list[bool] | None = None) -> None:
        """The end of an import (from a session's saved state or the prefix
        cache's tiers): the first `filled` new blocks hold their KV and join
        the tree right below the hit, which the import locked and which is
        unlocked now; the rest go back to the pool. In a window pool the
        tree keeps the window parts that came with them (the points worth
        resuming from, kv/window_parts.py); the others' window pages go."""
        self.pool.free(new_ids[filled:])
        if self.windowed:
            self.pool.imported(new_ids[:filled], windows or [])
        node = hit.last_node
        if filled and node.detached:
            # Invalidated while a background import ran (locking stops eviction,
            # not invalidation): what it loaded must not be served.
            self.pool.free(new_ids[:filled])
            filled = 0
        if filled:
            below = node if node.parent is not None else None  # an empty hit: from the namespace's root
            # A background import (a prefetch) may find some of its blocks
            # computed meanwhile by a request with the same prefix: the tree
            # keeps its own (insert reports them as duplicates) and ours go
            # back to the pool with the next line.
            self.radix.insert_blocks(ns, new_keys[:filled], new_ids[:filled], below=below)
            self.pool.free(new_ids[:filled])  # the tree holds the ones it took
        self.radix.unlock(node)

    def cached_paths(self):
        """(namespace, chained hashes, block ids) of every cached node, least
        recently used first: what a persistent disk tier takes at a clean close."""
        if self.radix is None:
            return
        for node in sorted(self.radix.iter_nodes(), key=lambda n: n.last_access):
            yield node.namespace, self.radix.block_hashes(node), list(node.block_ids)

    def path_identity(self, hit: MatchResult) -> tuple[Hashable, list[bytes]]:
        """The namespace a matched path's blocks were computed under and each
        block's chained hash, read from the tree that holds them (not from
        what a caller says they are): the labels a copy of those blocks
        carries on a lower tier, which a load under another scope refuses."""
        nodes, node = [], hit.last_node
        while node.parent is not None:
            nodes.append(node)
            node = node.parent
        hashes = [h for n in reversed(nodes) for h in self.radix.block_hashes(n)]
        return hit.last_node.namespace, hashes[:len(hit.block_ids)]

    def prefix_hashes(self, token_ids: list[int], scope: CacheScope, num_blocks: int) -> list[bytes]:
        """The chained hashes of the first num_blocks full blocks of token_ids
        under scope: what the cluster's prefix directory knows them by."""
        h = namespace_hash(self.namespace(scope))
        out = []
        for k in self.radix.block_keys(token_ids[:num_blocks * self.block_size]):
            h = chain_hash(h, k)
            out.append(h)
        return out

    def retain(self, token_ids: list[int], scope: CacheScope, num_tokens: int, ttl_s: float) -> int:
        """Keep the blocks of token_ids' first num_tokens (full blocks) under
        scope for ttl_s seconds: every tier evicts them last (kv/retention.py).
        Returns the blocks named."""
        if self.radix is None:
            return 0
        hashes = self.prefix_hashes(token_ids, scope, min(num_tokens, len(token_ids)) // self.block_size)
        self.retention.retain(hashes, ttl_s)
        return len(hashes)
