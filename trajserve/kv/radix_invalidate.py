"""Invalidation of the radix prefix cache: the stale-context fallacy.

After a file an agent read changes, KV derived from its old text must never
be served again (spec kv-cache-management, the stale-context pitfall): every
block that holds the first stale token or a later one is dropped from the
tree, in every path that starts with the given prefix. Nodes still in use
are detached (never matched again) and keep their blocks until their last
user unlocks them. `clear` drops everything not in use.

A mixin of RadixCache (kv/radix_cache.py): it works on the tree's own fields.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence

from trajserve.kv.radix_node import RadixNode


class Invalidation:
    def invalidate(self, namespace: Hashable, prefix_tokens: Sequence[int] | None = None) -> int:
        """Drop cached state that depends on stale tokens (the stale-context
        fallacy: after a file changes, KV derived from its old text must never
        be served again).

        `prefix_tokens` ends with the first stale token: every block that holds
        that token or any later one, on a path that starts with
        `prefix_tokens`, is dropped; blocks wholly before it are kept. None
        (or empty) drops the whole namespace.

            prefix    s0 s1 s2 s3 | s4 s5 f0        (f0: first stale token)
            kept      [s0 s1 s2 s3]
            dropped   [s4 s5 f0 *] and everything below it

        Nodes in use are detached (never matched again) and keep their blocks
        until their last user unlocks them; the rest free their blocks now.
        Returns the number of tree block references dropped or scheduled for
        release.
        """
        root = self._roots.get(namespace)
        if root is None:
            return 0
        if not prefix_tokens:
            victims = list(root.children.values())
        else:
            victims = self._invalidation_roots(root, prefix_tokens)
        dropped = 0
        for v in victims:
            del v.parent.children[v.key[0]]
            dropped += self._detach_subtree(v)
        if not root.children:
            del self._roots[namespace]
        # The parent of a dropped subtree may now be a dormant leaf.
        for v in victims:
            p = v.parent
            if p.parent is not None and self._evictable(p):
                self._push(p)
        self.num_invalidated_blocks += dropped
        return dropped

    def clear(self) -> int:
        """Drop every cached node not in use (in any namespace); nodes in use
        and their ancestors stay. Returns blocks freed to the pool."""
        freed = 0
        for ns, root in list(self._roots.items()):
            freed += self._clear_under(root)
            if not root.children:
                del self._roots[ns]
        self.num_freed_blocks += freed
        # Everything left is pinned, so no heap entry can be valid.
        self._heap.clear()
        return freed

    def _invalidation_roots(self, root: RadixNode, prefix: Sequence[int]) -> list[RadixNode]:
        B = self.block_size
        k = (len(prefix) - 1) // B  # block holding the first stale token
        head = self.block_keys(prefix[:k * B])
        tail = tuple(prefix[k * B:])
        node, n, _ = self._walk(root, head)
        if n < len(head):
            return []  # nothing cached under this prefix
        # `node` ends exactly after block k-1; block k starts a child.
        if len(tail) == B:
            child = node.children.get(tail)
            return [child] if child is not None else []
        return [c for first, c in node.children.items() if first[:len(tail)] == tail]

    def _detach_subtree(self, top: RadixNode) -> int:
        """Take `top` (already unlinked from its parent) and its descendants out
        of the tree. Keeps parent links so unlock still walks up."""
        dropped = 0
        stack = [top]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if self.on_event is not None:  # parent links are kept: the hashes still chain
                self.on_event(False, self.block_hashes(node))
            node.detached = True
            node.heap_stamp = -1
            nb = len(node.block_ids)
            dropped += nb
            self._num_nodes -= 1
            self.num_cached_blocks -= nb
            if node.ref_count == 0:
                self._dormant(node.block_ids, False)
                self.num_freed_blocks += self._drop_tree_refs(node.block_ids)
                node.block_ids = []
            else:
                self.num_detached_blocks += nb
        return dropped

    def _release_detached(self, node: RadixNode) -> None:
        self.num_detached_blocks -= len(node.block_ids)
        self.num_freed_blocks += self._drop_tree_refs(node.block_ids)
        node.block_ids = []

    def _clear_under(self, root: RadixNode) -> int:
        """Post-order: free every node with ref_count 0 (its descendants are
        then unpinned too, since pins cover whole paths)."""
        freed = 0
        order: list[RadixNode] = []
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        for node in reversed(order):  # children before parents
            if node.ref_count == 0:
                if self.on_event is not None:
                    self.on_event(False, self.block_hashes(node))
                self._dormant(node.block_ids, False)
                freed += self._drop_tree_refs(node.block_ids)
                self.num_cached_blocks -= len(node.block_ids)
                self._num_nodes -= 1
                del node.parent.children[node.key[0]]
                node.detached = True
                node.heap_stamp = -1
        return freed
