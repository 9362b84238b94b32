"""Per-sequence block table: logical block i -> physical block id.

Token at position p lives in slot  block_ids[p // B] * B + p % B  of the
flattened pool (B = block size). The table grows one block at a time; only
the last block can be partially filled.
"""
from __future__ import annotations

import numpy as np


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockTable:
    __slots__ = ("block_ids", "block_size")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.block_ids: list[int] = []

    def __len__(self) -> int:
        return len(self.block_ids)

    @property
    def capacity(self) -> int:
        """Tokens the table can hold without another block."""
        return len(self.block_ids) * self.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        return max(0, blocks_for(num_tokens, self.block_size) - len(self.block_ids))

    def slots(self, start: int, end: int) -> np.ndarray:
        """Flat pool slots of positions [start, end)."""
        pos = np.arange(start, end)
        table = np.asarray(self.block_ids, dtype=np.int64)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size
