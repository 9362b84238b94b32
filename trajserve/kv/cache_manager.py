"""KVCacheManager: the only owner of block tables and the block pool.

The scheduler asks it for room (allocate_slots) and returns room (free); it
never touches blocks itself. Works on token counts and block ids only, so the
simulator can drive it without tensors.
"""
from __future__ import annotations

from trajserve.kv.block_pool import BlockPool
from trajserve.kv.block_table import BlockTable, blocks_for


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.tables: dict[str, BlockTable] = {}
        self.watermark_blocks = int(watermark * num_blocks)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def token_capacity(self) -> int:
        return self.pool.num_blocks * self.block_size

    def usage(self) -> float:
        """U_KV = N_allocated_blocks / N_total_blocks   (eq. 8, kv-cache-management)."""
        return self.pool.num_used / self.pool.num_blocks

    def table(self, request_id: str) -> BlockTable:
        return self.tables[request_id]

    def can_admit(self, request_id: str, num_tokens: int) -> bool:
        """Admission keeps a watermark of free blocks for running decodes."""
        need = self._needed(request_id, num_tokens)
        return need + self.watermark_blocks <= self.pool.num_free

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's table to hold num_tokens tokens. False (and no
        change) when the pool is short."""
        need = self._needed(request_id, num_tokens)
        if need > self.pool.num_free:
            return False
        table = self.tables.get(request_id)
        if table is None:
            table = self.tables[request_id] = BlockTable(self.block_size)
        if need:
            table.block_ids.extend(self.pool.allocate(need))
        return True

    def free(self, request_id: str) -> None:
        table = self.tables.pop(request_id, None)
        if table is not None:
            # Free in reverse so the tail (least likely to be shared later)
            # is reused first.
            self.pool.free(table.block_ids[::-1])

    def _needed(self, request_id: str, num_tokens: int) -> int:
        table = self.tables.get(request_id)
        have = len(table) if table is not None else 0
        return max(0, blocks_for(num_tokens, self.block_size) - have)
