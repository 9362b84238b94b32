"""What one decode round reads, and how batching spreads it
(inference-optimization 8.2.1).

b requests share one read of the matrix weights D_w; each reads its own
context's KV, L tokens of k bytes:

    I_weight ~= 2 b / s_w              FLOPs per weight byte read (s_w: bytes a weight)
    D(b, L)   = D_w + b L k            bytes a round reads
    d(b, L)   = D_w / b + L k          bytes per output token
    b_KV      = ceil(D_w / (L k))      the smallest batch whose KV reads reach the weights'
    T_step   ~= max(b F / P, D(b, L) / beta)

Arithmetic only: bytes, FLOPs, seconds.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass


def weight_intensity(batch: int, weight_bytes: float) -> float:
    """I_weight = 2 b / s_w: two FLOPs per multiply-add, each weight read once a round."""
    return 2 * batch / weight_bytes


def round_bytes(weights: float, batch: int, context: int, kv_per_token: float) -> float:
    """D(b, L) = D_w + b L k."""
    return weights + batch * context * kv_per_token


def bytes_per_token(weights: float, batch: int, context: int, kv_per_token: float) -> float:
    """d(b, L) = D_w / b + L k."""
    return weights / batch + context * kv_per_token


def kv_batch(weights: float, context: int, kv_per_token: float) -> int:
    """b_KV = ceil(D_w / (L k))."""
    if context < 1 or not kv_per_token > 0:
        raise ValueError(f"context must be >= 1 token and KV bytes per token > 0, got {context}, {kv_per_token}")
    return math.ceil(weights / (context * kv_per_token))


def step_time(batch: int, flops_per_request: float, peak_flops: float, weights: float, context: int,
              kv_per_token: float, bandwidth: float) -> float:
    """T_step ~= max(b F / P, (D_w + b L k) / beta)."""
    return max(batch * flops_per_request / peak_flops,
               round_bytes(weights, batch, context, kv_per_token) / bandwidth)


@dataclass(frozen=True, slots=True)
class ReadsRow:
    batch: int
    weight_intensity: float  # FLOPs per weight byte
    round_bytes: float  # D(b, L)
    bytes_per_token: float  # d(b, L)
    weight_share: float  # D_w / b over d(b, L)

    def to_dict(self) -> dict:
        return asdict(self)


def reads_table(weights: float, weight_bytes: float, context: int, kv_per_token: float,
                batches: list[int]) -> list[ReadsRow]:
    rows = []
    for b in batches:
        if b < 1:
            raise ValueError(f"batch sizes must be >= 1, got {b}")
        per = bytes_per_token(weights, b, context, kv_per_token)
        rows.append(ReadsRow(b, weight_intensity(b, weight_bytes), round_bytes(weights, b, context, kv_per_token),
                             per, weights / b / per))
    return rows
