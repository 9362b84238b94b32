"""Physical KV blocks: a free list and a refcount per block (no tensors).

Spec: kv-cache-management, "分页 KV 分配". A block is either free (refcount 0,
on the free list) or referenced; refcount = number of holders (block tables
now, radix nodes later). The free list is a deque, so allocate and free are
O(1) per block.
"""
from __future__ import annotations

from collections import deque


class NoFreeBlocks(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least 1 block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocks(f"asked for {n} blocks, {len(self._free)} free")
        # Locals, not attribute lookups, in the per-block loops: a simulated
        # trace moves tens of millions of blocks through here.
        pop = self._free.popleft
        blocks = [pop() for _ in range(n)]
        ref = self.ref_counts
        for b in blocks:
            ref[b] = 1
        return blocks

    def incref(self, blocks: list[int]) -> None:
        ref = self.ref_counts
        for b in blocks:
            if ref[b] <= 0:
                raise AssertionError(f"incref of free block {b}")
            ref[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference from each block; a block whose last reference goes
        returns to the free list."""
        ref, push = self.ref_counts, self._free.append
        for b in blocks:
            rc = ref[b] - 1
            if rc < 0:
                raise AssertionError(f"double free of block {b}")
            ref[b] = rc
            if rc == 0:
                push(b)

    def check(self) -> None:
        """Invariant: free list and refcounts agree (used by tests)."""
        free = set(self._free)
        assert len(free) == len(self._free), "block on the free list twice"
        for b, rc in enumerate(self.ref_counts):
            assert (rc == 0) == (b in free), f"block {b}: refcount {rc}, free={b in free}"
