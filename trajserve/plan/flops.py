"""Matrix FLOPs of a forward pass over new tokens, some of them after a cached prefix.

    linear    = 2 N S_new                     (two FLOPs per weight per token)
    attention = 4 L d_q * pairs               (QK^T and PV, 2 d_q each per query-key pair)

`pairs` is how many query-key products the kernel computes. The two chapters
count them differently, so the convention is a parameter:
  "causal": S_new * S_cached + S_new^2 / 2 -- each query sees only earlier keys
            (inference-optimization 8.3.4 and 8.6.3: 96.5 TFLOP, 2137.5 TFLOP)
  "full":   S_new * (S_cached + S_new) -- the whole square, an upper bound
            (kv-cache-management box 0.4: 4 L d_model S^2)
  "none":   projections only (kv-cache-management box 0.6: 2 N S)
"""
from __future__ import annotations

ATTENTION_CONVENTIONS = ("causal", "full", "none")


def attention_pairs(new_tokens: float, cached_tokens: float = 0.0, attention: str = "causal") -> float:
    if attention == "causal":
        return new_tokens * cached_tokens + new_tokens * new_tokens / 2
    if attention == "full":
        return new_tokens * (cached_tokens + new_tokens)
    if attention == "none":
        return 0.0
    raise ValueError(f"unknown attention convention {attention!r}; allowed: {', '.join(ATTENTION_CONVENTIONS)}")


def causal_pairs(new: int, cached: int) -> int:
    """N_pair = c h + c (c + 1) / 2   (inference-optimization 8.2.3): the
    query-key pairs a chunk of c new tokens after h cached ones computes,
    each query with its own key included (the step-time models' feature)."""
    return new * cached + new * (new + 1) // 2


def forward_flops(n_params: float, num_layers: int, q_dim: int, new_tokens: float,
                  cached_tokens: float = 0.0, attention: str = "causal") -> float:
    """FLOPs to run `new_tokens` through the model after `cached_tokens` of KV.

    n_params: the parameters multiplied per token (matmul params for a
    prefill; add the LM head when every position needs logits, as in
    speculative verification). q_dim = H_q * d_head.
    """
    linear = 2 * n_params * new_tokens
    return linear + 4 * num_layers * q_dim * attention_pairs(new_tokens, cached_tokens, attention)


def compute_time(flops: float, peak_flops: float, efficiency: float) -> float:
    """Prefill time as FLOPs / (peak * MFU) (inference-optimization 8.6.3)."""
    if peak_flops <= 0:
        raise ValueError("peak FLOP/s unknown for this device; calibrate it first")
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency (MFU) must be in (0, 1], got {efficiency}")
    return flops / (peak_flops * efficiency)
