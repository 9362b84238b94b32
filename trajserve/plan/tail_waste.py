"""Memory lost inside the last block of each sequence, by block size.

Paging removes external fragmentation; what remains is the unused tail of
each sequence's last block (kv-cache-management, "块大小选择中的量化权衡";
inference-optimization 8.3.1).
"""
from __future__ import annotations

import math
from collections.abc import Iterable


def tail_slots(length: int, block_size: int) -> int:
    """Delta_tail = (B - (S mod B)) mod B = p * ceil(L / p) - L."""
    return (block_size - length % block_size) % block_size


def expected_tail_slots(block_size: int) -> float:
    """E[Delta_tail] = (B - 1) / 2 when lengths mod B are uniform."""
    return (block_size - 1) / 2


def allocated_slots(lengths: Iterable[int], block_size: int) -> int:
    """Token slots a paged allocator hands out: sum of p * ceil(L / p)."""
    return sum(block_size * math.ceil(n / block_size) for n in lengths)


def expected_waste_bytes(n_seqs: int, block_size: int, m_token: float) -> float:
    """N_seq * (B - 1)/2 * m_token: the tails of a full batch (box 0.3)."""
    return n_seqs * expected_tail_slots(block_size) * m_token


def waste_fraction(n_seqs: int, block_size: int, m_token: float, pool_bytes: float) -> float:
    """Share of the KV pool lost to tails (box 0.3's fragmentation ratio)."""
    return expected_waste_bytes(n_seqs, block_size, m_token) / pool_bytes


def shared_block_count(prefix_blocks: int, private_blocks: int, branches: int) -> tuple[int, int]:
    """(physical blocks, block-table references) when `branches` sequences
    share `prefix_blocks` and each holds `private_blocks` (8.3.2)."""
    return prefix_blocks + branches * private_blocks, branches * (prefix_blocks + private_blocks)


def reservation_efficiency(useful_tokens: float, reserved_tokens: float) -> float:
    """eta = M_useful / M_allocated for a static max-length reservation (box 0.2)."""
    return useful_tokens / reserved_tokens
