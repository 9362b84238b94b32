"""Rotary position embedding tables (rotate-half layout, as in HF Llama)."""
from __future__ import annotations

import math

import numpy as np
import torch


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv
    # Llama 3.1 "llama3" scaling: long wavelengths slowed by `factor`, short
    # ones kept, a smooth blend between.
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)


def cos_sin_table(head_dim: int, max_len: int, theta: float, scaling: dict | None,
                  device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """[max_len, head_dim] cos and sin in float32.

    The angles are HF's (float32 position x float32 frequency); cos and sin
    are numpy's float64 libm, rounded once to float32. torch's vectorized
    float32 cos, computed here at start-up on two threads, came out wrong
    in one thread's half of the table in about 3 processes of 10 on this
    project's Sapphire Rapids VM (cos(1) = 0.5403335 instead of 0.5403023;
    the same call repeated gave the right table): a process then produced
    other greedy tokens and prompt logprobs 0.017 off (what made the server
    and an in-process engine disagree now and then). Not understood; the
    table no longer depends on it (tests/test_rope_table.py)."""
    inv = inv_frequencies(head_dim, theta, scaling).float().numpy()
    freqs = np.outer(np.arange(max_len, dtype=np.float32), inv).astype(np.float64)  # float32 products, as HF
    emb = np.concatenate([freqs, freqs], axis=-1)
    return (torch.from_numpy(np.cos(emb).astype(np.float32)).to(device),
            torch.from_numpy(np.sin(emb).astype(np.float32)).to(device))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, d]; cos/sin: [T, d] already in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
