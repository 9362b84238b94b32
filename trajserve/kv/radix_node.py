"""The radix prefix cache's vocabulary: block keys, chained block hashes,
nodes, match and insert results, and the protocols of the tiers below it.

Spec: kv-cache-management table 2 (a node's prefix_tokens, block_ids,
children, parent, ref_count, last_access). kv/radix_cache.py is the tree;
these types are shared with the KV manager, the tiers and the sessions.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Hashable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

BlockKey = tuple[int, ...]


def chain_hash(prev: bytes, key: BlockKey) -> bytes:
    """Hash of a block given the hash of everything before it (128-bit BLAKE2b:
    equal hashes mean equal prefixes for any practical purpose). The tokens go
    in as little-endian int64s (a cached struct per block length: ~25 % faster
    than an array, and a simulated run hashes millions of blocks)."""
    packer = _PACKERS.get(len(key))
    if packer is None:
        packer = _PACKERS[len(key)] = struct.Struct(f"<{len(key)}q")
    return hashlib.blake2b(prev + packer.pack(*key), digest_size=16).digest()


_PACKERS: dict[int, struct.Struct] = {}


def namespace_hash(namespace: Hashable) -> bytes:
    return hashlib.blake2b(repr(namespace).encode(), digest_size=16).digest()


class Spill(Protocol):
    """Where LRU-evicted blocks go instead of nowhere (kv/lower_tiers.py)."""

    def save(self, namespace: Hashable, hashes: list[bytes], block_ids: list[int], priority: int = 0) -> None: ...


@dataclass(slots=True, eq=False)
class RadixNode:
    """One edge of the tree: a run of full blocks without a branch point
    (spec table 2: prefix_tokens, block_ids, children, parent, ref_count,
    last_access)."""

    key: list[BlockKey]  # one B-token tuple per block
    block_ids: list[int]  # block_ids[i] holds the KV of key[i]
    parent: RadixNode | None
    namespace: Hashable
    children: dict[BlockKey, RadixNode] = field(default_factory=dict)
    ref_count: int = 0
    last_access: int = 0
    # The priority of the request that last released the path (lower runs
    # first; --scheduling priority / program): eviction takes the least
    # urgent class first, least recently used within it.
    priority: int = 0
    # Stamp of this node's only valid heap entry (-1: none). Older entries
    # for the node are stale and skipped when popped.
    heap_stamp: int = -1
    # Set by invalidate(): the node is out of the tree, never matched again;
    # its blocks go back to the pool when its last user unlocks it.
    detached: bool = False
    # Chained hash at the end of this node's path (lazily computed; a split
    # gives the new upper node none, the lower part keeps its end and hash).
    hash_end: bytes | None = None

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    def depth_tokens(self, block_size: int) -> int:
        """Tokens on the path from the root to the end of this node."""
        n, node = 0, self
        while node is not None:
            n += len(node.key)
            node = node.parent
        return n * block_size

    def __repr__(self) -> str:  # the default one recurses through parent/children
        return (f"RadixNode(blocks={self.block_ids}, ref_count={self.ref_count}, "
                f"last_access={self.last_access}, children={len(self.children)}"
                f"{', detached' if self.detached else ''})")


@dataclass(slots=True)
class MatchResult:
    """Longest cached block-aligned prefix of a prompt.

    `num_tokens == len(block_ids) * block_size`; `last_node` is the node that
    ends exactly at the match (the root when nothing matched) -- lock it to
    pin the matched blocks while the request uses them."""

    block_ids: list[int]
    num_tokens: int
    last_node: RadixNode


@dataclass(slots=True)
class InsertResult:
    """Outcome of `RadixCache.insert`.

    node: the node that ends exactly at the inserted prefix (lock it).
    num_new_blocks: caller blocks the tree adopted (took a pool reference on).
    duplicates: (block index, cached block id) where the tree already held a
        different block for the same tokens; the tree kept its own and took no
        reference on the caller's. The caller may switch its table to the
        cached block (incref it) and free its own.
    """

    node: RadixNode
    num_new_blocks: int
    duplicates: list[tuple[int, int]]


class LowerTierCache(Spill, Protocol):
    """Blocks the radix cache evicted, kept below the device under their
    chained hashes (kv/lower_tiers.py holds the real one)."""

    retention: object  # kv/retention.py: the KV manager's, set when attached (its LRU takes those last)

    def contains(self, block_hash: bytes) -> bool: ...

    def load(self, namespace: Hashable, hashes: list[bytes], block_ids: list[int]) -> int:
        """Copy the blocks named by `hashes` into these device blocks, in order,
        and let go of them; returns how many it loaded (it stops at the first
        one missing or failing its checks)."""
        ...

    def loading(self, hashes: list[bytes]) -> AbstractContextManager:
        """Keep these blocks while the device evicts (and spills) to make room to load them."""
        ...

    def discard_namespace(self, namespace: Hashable) -> None: ...

    def clear(self) -> None: ...
