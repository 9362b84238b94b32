"""Paged attention in torch: queries read K/V through block tables.

One entry point, `paged_attention`, so a GPU kernel can replace it later.
Two paths, chosen per sequence by query length:

* decode (1 query token): batched over all decode sequences without padding
  to the longest. Work is split into (sequence, block) pairs,

      pair p:  q[seq(p)]  x  K[block(p)]^T   -> scores [kv_heads, group, B]

  and softmax is taken across all pairs of a sequence with a scatter-max and
  an index-add (an exact, split-K "flash-decoding" reduction). Only the last
  block of each sequence carries masked (padding) slots.
  On the CPU in float32 the C kernel of cpu_kernels.c does the same exact
  softmax per (sequence, kv head) in one call, reading the block tables
  directly (`dec_tables`); the pair tensors are then not built.
* prefill chunk (n query tokens): the chunk attends to the cached prefix plus
  itself causally; K/V are gathered once per sequence and fed to SDPA with
  GQA, so K/V are never repeated per query head. With the C kernels the
  chunk's attention reads K/V in place through the block table instead
  (flash-style, hidden key blocks skipped, no mask built).

Pool layout per layer: [num_blocks, H_kv, B, d] (head-major inside a block),
so a gathered block is already the [H_kv, B, d] operand a batched matmul
wants: no transpose copy of K or V on the decode path. A q8_0 / q4_0 pool
holds [num_blocks, H_kv, B, row bytes] (model/kv_quant.py): its gathered
blocks are dequantized to the compute dtype, and write_kv quantizes.

A sliding-window layer (window > 0) gives each query only its latest
`window` keys (positions > its own - window, as transformers masks them);
its blocks before that are never read.

K/V of the current step are written into the pool (write_kv) before this runs.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from trajserve.model.kv_quant import load_rows, pool_format, store_rows


@dataclass(slots=True)
class PrefillSeq:
    q_start: int  # row of the first query token in the flat batch
    q_len: int
    ctx_len: int  # tokens in cache incl. this chunk
    block_ids: torch.Tensor  # [ceil(ctx_len / B)] long
    # Additive masks over the cached prefix + chunk by window (0: causal
    # only), built by the first layer of each kind and reused by the rest (a
    # float mask also spares SDPA converting a boolean one per call: ~8 % of
    # a 400-token chunk's attention).
    masks: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass(slots=True)
class AttentionMetadata:
    # Where each new token's K/V goes: block id and offset inside the block.
    slot_block: torch.Tensor  # [T] long
    slot_offset: torch.Tensor  # [T] long
    # decode path
    decode_rows: torch.Tensor | None  # [D] long: rows of decode queries
    pair_seq: torch.Tensor | None  # [P] long: decode index of each (seq, block) pair
    pair_block: torch.Tensor | None  # [P] long: physical block of each pair
    pair_mask: torch.Tensor | None  # [P, B] bool: slot holds a real token
    num_decodes: int
    # prefill path
    prefills: list[PrefillSeq]
    # decode path of the C kernel: all decode block tables back to back,
    # where each sequence's starts, and its context length.
    dec_tables: torch.Tensor | None = None  # [sum of blocks] long
    dec_table_start: torch.Tensor | None = None  # [D] long
    dec_ctx: torch.Tensor | None = None  # [D] long
    # torch decode path, for windows: each pair slot's position, each pair's
    # context length, and the pair masks by window (built once per step).
    pair_pos: torch.Tensor | None = None  # [P, B] long
    pair_ctx: torch.Tensor | None = None  # [P] long
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    # Latent attention's kernel tables for the rows it runs (model/mla.py
    # _rows_as_decodes): built by the first layer, read by the rest.
    latent_rows: tuple | None = None
    # A window model's pool (kv/window_pool.py): every layer reads its own
    # pages of tensors all layers share; the block ids above become each
    # layer's pages through these (None: a block id is every layer's index).
    layer_pages: LayerTables | None = None

    def for_layer(self, layer: int) -> AttentionMetadata:
        """The metadata layer `layer` reads the pool with."""
        lp = self.layer_pages
        if lp is None:
            return self
        m = lp.views.get(layer)
        if m is None:
            m = lp.views[layer] = dataclasses.replace(
                self, slot_block=lp.slot_block[layer] if lp.slot_block is not None else None,
                dec_tables=lp.dec_tables[layer] if lp.dec_tables is not None else None,
                pair_block=lp.pair_block[layer] if lp.pair_block is not None else None,
                prefills=[PrefillSeq(s.q_start, s.q_len, s.ctx_len, pages[layer], s.masks)
                          for s, pages in zip(self.prefills, lp.prefill_blocks)],
                layer_pages=None)
        return m


@dataclass(slots=True)
class LayerTables:
    """Per layer (the first axis) the pages standing for the metadata's block
    ids: of each new token's slot, of the decode tables, of the torch
    decode's pairs and of each prefill's table."""
    slot_block: torch.Tensor | None  # [layers, T] (None: metadata of reads only, a step's sampled rows)
    dec_tables: torch.Tensor | None
    pair_block: torch.Tensor | None
    prefill_blocks: list[torch.Tensor]  # per prefill: [layers, blocks]
    views: dict[int, AttentionMetadata] = field(default_factory=dict)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             meta: AttentionMetadata) -> None:
    """k, v: [T, H_kv, d]; caches: [num_blocks, H_kv, B, row] (row: d, or a
    q8_0 / q4_0 row's bytes, model/kv_quant.py)."""
    fmt = pool_format(k_cache, k.shape[-1])
    k_cache[meta.slot_block, :, meta.slot_offset] = store_rows(k, fmt)
    v_cache[meta.slot_block, :, meta.slot_offset] = store_rows(v, fmt)


def _blocks(cache: torch.Tensor, ids: torch.Tensor, d: int, dtype: torch.dtype) -> torch.Tensor:
    """Pool blocks `ids` as values [n, H_kv, B, d] of `dtype` (a quantized
    pool's rows dequantized as gathered; a float pool's as they are)."""
    fmt = pool_format(cache, d)
    blocks = cache.index_select(0, ids)
    return load_rows(blocks, fmt, d, dtype) if fmt.quantized else blocks


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, kernels=None, window: int = 0,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, H, d] (rows may be strided) -> out [T, H, d]. `kernels`: the
    CpuKernels that run the decodes and the prefill chunks (the metadata
    then carries `dec_tables`, not the pair tensors). window > 0: a
    sliding-window layer's attention. sinks: each head's sink logit, float32
    [H] (gpt-oss): counted in the softmax's denominator, weighing no value
    (torch's, or the C vector kernels')."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if meta.num_decodes:
        if kernels is not None:
            kernels.decode_attention(q, k_cache, v_cache, meta.dec_tables, meta.dec_table_start,
                                     meta.dec_ctx, meta.decode_rows, scale, out, window, sinks)
        else:
            out[meta.decode_rows] = _decode(q[meta.decode_rows], k_cache, v_cache, meta, scale, window, sinks)
    for s in meta.prefills:
        rows = slice(s.q_start, s.q_start + s.q_len)
        if kernels is not None:
            kernels.prefill_attention(q[rows], k_cache, v_cache, s.block_ids, s.ctx_len, scale, out[rows], window,
                                      sinks)
        else:
            out[rows] = _prefill(q[rows], k_cache, v_cache, s, scale, window, sinks)
    return out


def _pair_mask(meta: AttentionMetadata, window: int) -> torch.Tensor:
    """Which pair slots hold a key the decode query sees."""
    if not window:
        return meta.pair_mask
    m = meta.window_masks.get(window)
    if m is None:
        m = meta.window_masks[window] = meta.pair_mask & (meta.pair_pos > (meta.pair_ctx - 1 - window)[:, None])
    return m


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            meta: AttentionMetadata, scale: float, window: int = 0,
            sinks: torch.Tensor | None = None) -> torch.Tensor:
    n, num_heads, d = q.shape
    kvh = k_cache.shape[1]
    group = num_heads // kvh
    seq, blk = meta.pair_seq, meta.pair_block
    qp = q.view(n, kvh, group, d)[seq] * scale  # [P, kvh, g, d]
    scores = torch.matmul(qp, _blocks(k_cache, blk, d, q.dtype).transpose(-1, -2)).float()  # [P, kvh, g, B]
    scores.masked_fill_(~_pair_mask(meta, window)[:, None, None, :], float("-inf"))
    # Exact softmax over each sequence's pairs: global max per sequence first.
    pair_max = scores.amax(dim=-1)  # [P, kvh, g]
    if sinks is None:
        seq_max = torch.full((n, kvh, group), float("-inf"), dtype=scores.dtype, device=q.device)
    else:  # a sink is one more logit in the max and the denominator
        seq_max = sinks.view(1, kvh, group).to(scores.dtype).repeat(n, 1, 1)
    seq_max.scatter_reduce_(0, seq.view(-1, 1, 1).expand_as(pair_max), pair_max, "amax")
    p = torch.exp(scores - seq_max[seq].unsqueeze(-1))
    denom = torch.zeros_like(seq_max).index_add_(0, seq, p.sum(dim=-1))
    if sinks is not None:
        denom += torch.exp(sinks.view(1, kvh, group) - seq_max)
    vb = _blocks(v_cache, blk, d, q.dtype)  # [P, kvh, B, d]
    o_pair = torch.matmul(p.to(vb.dtype), vb)  # [P, kvh, g, d]
    o = torch.zeros((n, kvh, group, d), dtype=torch.float32, device=q.device)
    o.index_add_(0, seq, o_pair.float())
    o /= denom.unsqueeze(-1)
    return o.view(n, num_heads, d).to(q.dtype)


def _prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             s: PrefillSeq, scale: float, window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    kvh, d = k_cache.shape[1], q.shape[-1]
    # [nb, kvh, B, d] -> [1, kvh, ctx, d]
    kt = _blocks(k_cache, s.block_ids, d, q.dtype).transpose(0, 1).reshape(kvh, -1, d)[:, : s.ctx_len].unsqueeze(0)
    vt = _blocks(v_cache, s.block_ids, d, q.dtype).transpose(0, 1).reshape(kvh, -1, d)[:, : s.ctx_len].unsqueeze(0)
    qt = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, d]
    if sinks is not None:
        return _prefill_sinks(qt, kt, vt, s, scale, window, sinks)
    if s.ctx_len == s.q_len and not window:  # no cached prefix: plain causal
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
    else:
        mask = s.masks.get(window)
        if mask is None:
            # Query i sits at position ctx_len - q_len + i and sees keys <= it
            # (and, in a window, > it - window).
            qpos = torch.arange(s.ctx_len - s.q_len, s.ctx_len, device=q.device).unsqueeze(1)
            kpos = torch.arange(s.ctx_len, device=q.device).unsqueeze(0)
            hidden = (kpos > qpos) | (kpos <= qpos - window) if window else kpos > qpos
            mask = s.masks[window] = torch.zeros(hidden.shape, dtype=q.dtype, device=q.device).masked_fill_(
                hidden, float("-inf"))
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)


def _prefill_sinks(qt: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor, s: PrefillSeq, scale: float,
                   window: int, sinks: torch.Tensor) -> torch.Tensor:
    """A chunk's attention with each head's sink, as SDPA over one more key:
    q gains a value sink_h / scale and every key a 0, the sink key is 0
    everywhere but a 1 there and its value is 0, so the sink key scores
    sink_h for every query of head h and adds to the denominator alone."""
    H, n, d = qt.shape[1], qt.shape[2], qt.shape[3]
    kvh = kt.shape[1]
    q1 = torch.cat([qt, (sinks.to(qt.dtype) / scale).view(1, H, 1, 1).expand(1, H, n, 1)], dim=-1)
    sink_k = torch.zeros(1, kvh, 1, d + 1, dtype=kt.dtype, device=kt.device)
    sink_k[..., d] = 1.0
    k1 = torch.cat([sink_k, F.pad(kt, (0, 1))], dim=2)
    v1 = torch.cat([torch.zeros(1, kvh, 1, d, dtype=vt.dtype, device=vt.device), vt], dim=2)
    qpos = torch.arange(s.ctx_len - s.q_len, s.ctx_len, device=qt.device).unsqueeze(1)
    kpos = torch.arange(s.ctx_len, device=qt.device).unsqueeze(0)
    hidden = (kpos > qpos) | (kpos <= qpos - window) if window else kpos > qpos
    mask = torch.zeros((n, s.ctx_len + 1), dtype=qt.dtype, device=qt.device)
    mask[:, 1:].masked_fill_(hidden, float("-inf"))  # the sink key (column 0) is seen by every query
    o = F.scaled_dot_product_attention(q1, k1, v1, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    window: int = 0) -> torch.Tensor:
    """Reference: causal attention over one contiguous sequence, K/V repeated
    per head explicitly (window > 0: query i sees keys > i - window).
    q: [n, H, d], k/v: [n, H_kv, d]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    n = q.shape[0]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    if window:
        causal = causal.triu(1 - window)
    scores.masked_fill_(~causal, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float()).to(q.dtype)
