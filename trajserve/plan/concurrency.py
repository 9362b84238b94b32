"""How many trajectories fit in a KV pool (eqs. 6, 7, kv-cache-management).

Sizes are counted in whole blocks, as the paged allocator hands them out:
a trajectory's private tokens round up to a block, and only full blocks of a
shared prefix are shared (a partial tail block is private; 8.3.2 of
inference-optimization, block-aligned radix matching). A trajectory that
prompted M tokens and generated K stores M + K - 1 tokens: the last sampled
token is never fed back, so its K/V is never written (8.1.2).
"""
from __future__ import annotations

import math

_EPS = 1e-9  # float products like 0.9 * pool land a hair under an exact integer


def _floor(x: float) -> int:
    return math.floor(x + _EPS)


def _ceil(x: float) -> int:
    return math.ceil(x - _EPS)


def kv_demand(b: int, m_avg: float, k_avg: float, m_token: float) -> float:
    """M_KV^demand = B * (M_avg + K_avg) * m_token, no sharing   (eq. 6)."""
    return b * (m_avg + k_avg) * m_token


def kv_demand_shared(b: int, m_avg: float, k_avg: float, m_token: float, s_shared: float = 0.0,
                     sigma: float = 0.0, pool_headroom: float = 0.0) -> float:
    """M_KV^demand = (S_shared + B((1 - sigma) M_avg + K_avg)) m_token + Pool_headroom   (eq. 7)."""
    if not 0.0 <= sigma < 1.0:
        raise ValueError(f"sigma must be in [0, 1), got {sigma}")
    return (s_shared + b * ((1 - sigma) * m_avg + k_avg)) * m_token + pool_headroom


def stored_tokens(prompt: int, output: int) -> int:
    return prompt + max(output - 1, 0)


def blocks_for(tokens: int, block_size: int) -> int:
    return _ceil(tokens / block_size)


def shared_prefix_blocks(shared_tokens: int, block_size: int) -> int:
    return shared_tokens // block_size  # only full blocks are shared


def served_tokens(prompt: int, shared_tokens: int) -> int:
    """The shared tokens a cache can serve: never the whole prompt, whose
    last token is computed for its logits. (With sigma = 1 and one output
    token eq. 7 would leave a trajectory no private block, and B no bound.)"""
    return min(shared_tokens, prompt - 1)


def trajectory_blocks(prompt: int, output: int, shared_tokens: int, block_size: int) -> int:
    """Private blocks of one trajectory: (1 - sigma) M + K of eq. 7, in blocks."""
    shared = shared_prefix_blocks(served_tokens(prompt, shared_tokens), block_size) * block_size
    return blocks_for(stored_tokens(prompt, output) - shared, block_size)


def pool_blocks(pool_bytes: float, m_token: float, block_size: int, headroom: float = 0.0) -> int:
    """Blocks the allocator may hand out after keeping Pool_headroom = headroom * M_KV free."""
    if not 0.0 <= headroom < 1.0:
        raise ValueError(f"headroom must be in [0, 1), got {headroom}")
    return _floor(pool_bytes * (1 - headroom) / (block_size * m_token))


def max_trajectories(pool_bytes: float, m_token: float, prompt: int, output: int = 0, *,
                     shared_tokens: int = 0, headroom: float = 0.0, block_size: int = 16) -> int:
    """Largest B whose eq. 7 demand fits the pool: eq. 7 solved for B.

    pool_bytes and m_token must be in the same scope: both per device, or
    both for the whole tensor/pipeline-parallel group.
    """
    if shared_tokens > prompt:
        raise ValueError(f"shared prefix ({shared_tokens} tokens) is longer than the context ({prompt} tokens)")
    free = (pool_blocks(pool_bytes, m_token, block_size, headroom)
            - shared_prefix_blocks(served_tokens(prompt, shared_tokens), block_size))
    per = trajectory_blocks(prompt, output, shared_tokens, block_size)
    if free <= 0 or per <= 0:
        return 0
    return free // per
