"""Rotary position embedding tables (rotate-half layout, as in HF Llama)."""
from __future__ import annotations

import math

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
    """[max_len, head_dim] cos and sin in float32."""
    inv = inv_frequencies(head_dim, theta, scaling).float()
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, d]; cos/sin: [T, d] already in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
