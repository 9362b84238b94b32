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
mla_attention.c's (5.1-6.4x torch's paged decode at DeepSeek's widths), and
so is every row of a chunk of at most VERIFY_ROWS rows (a verified draft's:
1 + up to 64 drafts), each over its own causal prefix; the absorbed
products are one float32 product a head (ts_linear_heads). Those rows'
bits depend on their own query and context only, so a verified row is the
decode's and speculation runs as for any model. A longer chunk (a
prompt's) runs in torch's SDPA, which reads each key once for all its rows
(row by row the kernel took 2.2-2.4x its time over a 2,048-token prefix):
a prompt row's bits depend on how the scheduler chunks the prompt, as they
do without speculation. Without the kernels: torch's bmm and paged
attention throughout (bits that depend on the rows beside them;
speculation's auto stays off).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from trajserve.config import MLASpec
from trajserve.model.attention import AttentionMetadata, paged_attention
from trajserve.model.cpu_kernels import pack
from trajserve.model.rope import apply_rope

# Chunks of up to this many rows run on the decode kernel: a verification's
# (1 + at most 64 drafts, config.py), so a verified row gets a decode's bits.
VERIFY_ROWS = 65


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
        if kernels is not None:  # each head's matrices as the float kernel's panels (ts_linear_heads)
            self.w_uk = torch.cat([pack(w.T) for w in per_head[:, :nope]])  # per head [rank, nope]
            self.w_uv_t = torch.cat([pack(w) for w in per_head[:, nope:]])  # per head [v, rank]
        else:
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
        # MQA over the rows: the latent part of each output is sum_t p_t c_t.
        if self.kernels is not None:
            q_lat = torch.empty(T, H, rank + rope)
            head_products(self.kernels, q, nope, self.w_uk, rank, q_lat)
            q_lat[..., rank:] = apply_rope(q[..., nope:], cos, sin)
            o_lat = latent_attention(self.kernels, q_lat, pool, meta, self.scale, rank)
            out = torch.empty(T, H, s.v_head_dim)
            head_products(self.kernels, o_lat, rank, self.w_uv_t, s.v_head_dim, out)
            return self.o(out.view(T, H * s.v_head_dim))
        q_abs = torch.bmm(q[..., :nope].transpose(0, 1), self.w_uk)  # [H, T, rank]
        q_lat = torch.cat([q_abs.transpose(0, 1), apply_rope(q[..., nope:], cos, sin)], dim=-1)
        o_lat = paged_attention(q_lat.contiguous(), pool, pool, meta, self.scale)[..., :rank]
        out = torch.bmm(o_lat.transpose(0, 1), self.w_uv_t)  # [H, T, v]
        return self.o(out.transpose(0, 1).reshape(T, H * s.v_head_dim))


def head_products(kernels, x: torch.Tensor, k: int, panels: torch.Tensor, n: int, out: torch.Tensor) -> None:
    """out[t, h, :n] = x[t, h, :k] @ w_h^T for every head h, the heads'
    matrices [n, k] packed back to back in `panels` (x's and out's rows may
    be wider: their heads' strides are read from them)."""
    T, H = x.shape[0], x.shape[1]
    if x.stride(2) != 1 or out.stride(2) != 1 or panels.shape[0] != H * (-(-n // 16)) or panels.shape[1] != k:
        raise ValueError(f"head products: {H} heads of [{n}, {k}] do not match panels {tuple(panels.shape)}")
    kernels.lib.ts_linear_heads(x.data_ptr(), T, k, x.stride(0), x.stride(1), panels.data_ptr(), n, H,
                                out.data_ptr(), out.stride(0), out.stride(1), kernels.threads())


def latent_attention(kernels, q: torch.Tensor, pool: torch.Tensor, meta: AttentionMetadata, scale: float,
                     dv: int) -> torch.Tensor:
    """out [T, H, dv] for q [T, H, dk] float32, contiguous, over the pool
    [blocks, 1, B, dk] (float32 or bf16): the decode rows and the rows of
    chunks of at most VERIFY_ROWS on mla_attention.c, each over its own
    causal prefix; longer chunks in torch's SDPA (see the module's docstring)."""
    if q.dtype != torch.float32 or not q.is_contiguous() or not pool.is_contiguous() \
            or pool.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"latent attention: q must be contiguous float32 and the pool contiguous float32 or "
                        f"bfloat16, got {q.dtype} and {pool.dtype}")
    T, H, dk = q.shape
    long = [p for p in meta.prefills if p.q_len > VERIFY_ROWS]
    if long:
        out = paged_attention(q, pool, pool, dataclasses.replace(meta, num_decodes=0, prefills=long), scale)
        out = out[..., :dv].contiguous()
    else:
        out = torch.empty(T, H, dv, dtype=torch.float32)
    if meta.latent_rows is None:
        meta.latent_rows = _rows_as_decodes(meta)
    tables, starts, ctx, rows = meta.latent_rows
    if rows.numel() and kernels.lib.ts_latent_attention(
            q.data_ptr(), q.stride(0), rows.numel(), H, dk, dv, pool.data_ptr(), int(pool.dtype == torch.bfloat16),
            pool.shape[2], tables.data_ptr(), starts.data_ptr(), ctx.data_ptr(), rows.data_ptr(), scale,
            out.data_ptr(), out.stride(0), kernels.threads()):
        raise ValueError(f"latent attention: rows of {dk} values with values of {dv} are past the kernel's "
                         f"widths (mla_attention.c: DK_MAX, DV_MAX)")
    return out


def _rows_as_decodes(meta: AttentionMetadata) -> tuple[torch.Tensor, ...]:
    """The kernel's tables for its query rows: the decode rows' own, then
    each row j of a chunk of at most VERIFY_ROWS over its sequence's blocks
    with context ctx_len - q_len + j + 1 (the keys up to its own)."""
    tables, starts, ctx, rows = [], [], [], []
    offset = 0
    if meta.num_decodes:
        tables, starts, ctx, rows = [meta.dec_tables], [meta.dec_table_start], [meta.dec_ctx], [meta.decode_rows]
        offset = meta.dec_tables.numel()
    for p in meta.prefills:
        if p.q_len > VERIFY_ROWS:
            continue
        tables.append(p.block_ids)
        starts.append(torch.full((p.q_len,), offset, dtype=torch.long))
        ctx.append(torch.arange(p.ctx_len - p.q_len + 1, p.ctx_len + 1, dtype=torch.long))
        rows.append(torch.arange(p.q_start, p.q_start + p.q_len, dtype=torch.long))
        offset += p.block_ids.numel()
    if not rows:
        return (torch.empty(0, dtype=torch.long),) * 4
    return tuple(torch.cat(t).contiguous() for t in (tables, starts, ctx, rows))
