"""Rotary position embedding tables (rotate-half layout, as in HF Llama)."""
from __future__ import annotations

import math

import dataclasses

import numpy as np
import torch

from trajserve.config import ModelConfig


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """The rotation frequencies, scaled as ModelConfig.rope_scaling says
    (the formulas of transformers' modeling_rope_utils)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv
    kind = scaling.get("rope_type", "llama3")
    if kind == "linear":  # positions divided by the factor: every wavelength stretched alike
        return inv / scaling["factor"]
    if kind == "yarn":
        return _yarn(inv, head_dim, theta, scaling)
    if kind != "llama3":
        raise ValueError(f"unsupported rope scaling {kind!r}; supported: llama3, linear, yarn")
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


def _yarn(inv: torch.Tensor, head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN (Peng et al. 2023): dimensions that turn fewer than beta_slow
    times over the trained context are interpolated by `factor`, those that
    turn more than beta_fast times are kept, a linear ramp between."""
    factor, trained = scaling["factor"], scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times over the trained length
        return head_dim * math.log(trained / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = math.floor(dim_of(fast)), math.ceil(dim_of(slow))
    if scaling.get("truncate", True) is False:
        low, high = dim_of(fast), dim_of(slow)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv / factor * ramp + inv * (1 - ramp)


def attention_scale(scaling: dict | None) -> float:
    """YaRN's factor on cos and sin (attention sharpened as the context
    grows): 0.1 ln(factor) + 1, or as the model's config gives it; 1 otherwise."""
    if scaling is None or scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 0.1 * m * math.log(scale) + 1.0 if scale > 1 else 1.0
    factor, m, m_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    return mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)


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
    scale = attention_scale(scaling)
    return (torch.from_numpy((np.cos(emb) * scale).astype(np.float32)).to(device),
            torch.from_numpy((np.sin(emb) * scale).astype(np.float32)).to(device))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, d]; cos/sin: [T, d] already in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


def stretched_rope(mc: ModelConfig, kind: str, factor: float) -> ModelConfig:
    """The model with its RoPE stretched past the trained context by factor
    (--rope-scaling linear | yarn): its context grows to factor times the
    trained one. A model whose RoPE is already scaled is refused: the two
    would not compose into what either was trained or tuned for."""
    if mc.rope_scaling is not None:
        raise ValueError(f"rope_scaling (--rope-scaling): the model already scales its RoPE "
                         f"({mc.rope_scaling.get('rope_type', 'llama3')} x{mc.rope_scaling['factor']:g}); "
                         f"its context is {mc.max_position_embeddings:,} tokens")
    trained = mc.max_position_embeddings
    scaling = {"rope_type": kind, "factor": float(factor)}
    if kind == "yarn":
        scaling["original_max_position_embeddings"] = trained
    return dataclasses.replace(mc, rope_scaling=scaling, max_position_embeddings=int(trained * factor))
