"""Multi-head latent attention (DeepSeek V2 / V3; config.MLASpec), absorbed.

A token caches, per layer, one row: its normed latent c (kv_lora_rank values)
and its rotated RoPE key k_pe (qk_rope_head_dim, shared by every head). Per
head h the model's keys and values are up-projections of c,

    k_h = [W_UK,h c, k_pe]        v_h = W_UV,h c        (W_UK, W_UV: kv_b_proj's rows)

so a query's score is q_h . k_h = (W_UK,h^T q_nope,h) . c + q_pe,h . k_pe: with
the query absorbed into latent space, q'_h = [W_UK,h^T q_nope,h, q_pe,h], every
head attends over the same cached rows, as multi-query attention with one
KV "head" whose row is [c, k_pe]. The output is W_UV,h (sum_t p_t c_t): the
probabilities weigh the latent (the row's first kv_lora_rank values) and one
product per head lifts it to v_head_dim. Decode and prefill both read only
the cached rows ((kv_lora_rank + qk_rope_head_dim) values a token and
layer), never per-head K or V; the pool keeps one tensor a layer
(ModelConfig.kv_pool_shape) and the attention reads it as both K and V.

Scores are scaled by (qk_nope + qk_rope)^-1/2, times YaRN's mscale(factor,
mscale_all_dim)^2 where the config scales its RoPE so (as transformers'
yarn_apply_mscale). The RoPE rows of q and k_pe are stored de-interleaved
(model/hf_reader.py), so the model's rotate-half RoPE applies.

With the C kernels a decode row's attention over the rows is
mla_attention.c's (5.1-6.4x torch's paged decode at DeepSeek's widths); a
prefill chunk's, and every row's without the kernels, torch's paged
attention with the pool as K and V. A verified draft's rows are a chunk's,
and the absorbed products (torch's bmm, whose rows' bits depend on how many
rows it multiplies) are in torch too, so a verified row does not get a
decode's bits and auto speculation stays off.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from trajserve.config import MLASpec
from trajserve.model.attention import AttentionMetadata, paged_attention
from trajserve.model.rope import apply_rope


def mla_scale(spec: MLASpec, rope_scaling: dict | None) -> float:
    """The softmax scale of the scores (see the module's docstring)."""
    scale = (spec.qk_nope_head_dim + spec.qk_rope_head_dim) ** -0.5
    if rope_scaling is not None and rope_scaling.get("rope_type") == "yarn" and rope_scaling.get("mscale_all_dim"):
        factor, m = rope_scaling["factor"], rope_scaling["mscale_all_dim"]
        mscale = 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return scale


class LatentAttention:
    """One layer's attention. `qa_kva`: the product of the layer's input into
    [q_a (q_lora_rank values; with no q bottleneck, q itself), then the
    latent and k_pe] in one; `q_b` lifts the normed q_a to every head's
    [q_nope, q_pe] (None without the bottleneck); `kv_b`: kv_b_proj's matrix
    [heads * (qk_nope + v_head), kv_lora_rank]; `o`: the output product."""

    def __init__(self, spec: MLASpec, num_heads: int, qa_kva: Callable, q_a_norm: torch.Tensor | None,
                 q_b: Callable | None, kv_a_norm: torch.Tensor, kv_b: torch.Tensor, o: Callable,
                 scale: float, rms: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], kernels=None) -> None:
        self.spec, self.heads, self.scale, self.rms, self.kernels = spec, num_heads, scale, rms, kernels
        self.qa_kva, self.q_a_norm, self.q_b, self.kv_a_norm, self.o = qa_kva, q_a_norm, q_b, kv_a_norm, o
        nope, v, rank = spec.qk_nope_head_dim, spec.v_head_dim, spec.kv_lora_rank
        per_head = kv_b.view(num_heads, nope + v, rank)
        self.w_uk = per_head[:, :nope].contiguous()  # [H, nope, rank]: q_nope -> latent space
        self.w_uv_t = per_head[:, nope:].transpose(1, 2).contiguous()  # [H, rank, v]: latent -> value
        self.q_width = num_heads * (nope + spec.qk_rope_head_dim)

    def products(self) -> list:
        return [p for p in (self.qa_kva, self.q_b, self.o) if p is not None]

    @property
    def absorbed_bytes(self) -> int:
        """The up-projections' bytes (kv_b_proj's, read by every forward)."""
        return (self.w_uk.numel() + self.w_uv_t.numel()) * self.w_uk.element_size()

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                 pool: torch.Tensor, rows: torch.Tensor | None = None,
                 rows_meta: AttentionMetadata | None = None) -> torch.Tensor:
        """The attention's output product [T, hidden] for h [T, hidden]
        (the layer's normed input), cos / sin the RoPE rows of the step's
        positions. Every row's latent is written into `pool` (meta's
        slots); with `rows`, only those rows' queries attend (over rows_meta):
        the last layer's sampled rows."""
        s, H = self.spec, self.heads
        nope, rope, rank = s.qk_nope_head_dim, s.qk_rope_head_dim, s.kv_lora_rank
        T = h.shape[0]
        qa_kva = self.qa_kva(h)
        q_part = s.q_lora_rank or self.q_width
        c = self.rms(qa_kva[:, q_part:q_part + rank].contiguous(), self.kv_a_norm)
        # k_pe rotated as a one-head tensor; the cached row is [c, k_pe].
        k_pe = apply_rope(qa_kva[:, q_part + rank:].view(T, 1, rope), cos, sin)
        pool[meta.slot_block, :, meta.slot_offset] = torch.cat([c.unsqueeze(1), k_pe], dim=-1).to(pool.dtype)
        qa = qa_kva[:, :q_part]
        if rows is not None:
            qa, cos, sin, meta, T = qa[rows], cos[rows], sin[rows], rows_meta, rows.shape[0]
        q = self.q_b(self.rms(qa.contiguous(), self.q_a_norm)) if self.q_b is not None else qa
        q = q.view(T, H, nope + rope)
        q_abs = torch.bmm(q[..., :nope].transpose(0, 1), self.w_uk)  # [H, T, rank]
        q_lat = torch.cat([q_abs.transpose(0, 1), apply_rope(q[..., nope:], cos, sin)], dim=-1)
        # MQA over the rows: the latent part of each output is sum_t p_t c_t.
        if self.kernels is not None:
            o_lat = latent_attention(self.kernels, q_lat.contiguous(), pool, meta, self.scale, rank)
        else:
            o_lat = paged_attention(q_lat.contiguous(), pool, pool, meta, self.scale)[..., :rank]
        out = torch.bmm(o_lat.transpose(0, 1), self.w_uv_t)  # [H, T, v]
        return self.o(out.transpose(0, 1).reshape(T, H * s.v_head_dim))


def latent_attention(kernels, q: torch.Tensor, pool: torch.Tensor, meta: AttentionMetadata, scale: float,
                     dv: int) -> torch.Tensor:
    """out [T, H, dv] for q [T, H, dk] float32, contiguous, over the pool
    [blocks, 1, B, dk] (float32 or bf16): the decode rows on mla_attention.c,
    the prefill chunks' rows in torch's SDPA (row by row the kernel took
    1.0-1.8x SDPA's time on 512- and 2,048-row chunks at DeepSeek's widths)."""
    if q.dtype != torch.float32 or not q.is_contiguous() or not pool.is_contiguous() \
            or pool.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"latent attention: q must be contiguous float32 and the pool contiguous float32 or "
                        f"bfloat16, got {q.dtype} and {pool.dtype}")
    T, H, dk = q.shape
    if meta.prefills:
        out = paged_attention(q, pool, pool, dataclasses.replace(meta, num_decodes=0), scale)[..., :dv].contiguous()
    else:
        out = torch.empty(T, H, dv, dtype=torch.float32)
    if meta.num_decodes and kernels.lib.ts_latent_attention(
            q.data_ptr(), q.stride(0), meta.num_decodes, H, dk, dv, pool.data_ptr(), int(pool.dtype == torch.bfloat16),
            pool.shape[2], meta.dec_tables.data_ptr(), meta.dec_table_start.data_ptr(), meta.dec_ctx.data_ptr(),
            meta.decode_rows.data_ptr(), scale, out.data_ptr(), out.stride(0), kernels.threads()):
        raise ValueError(f"latent attention: rows of {dk} values with values of {dv} are past the kernel's "
                         f"widths (mla_attention.c: DK_MAX, DV_MAX)")
    return out
