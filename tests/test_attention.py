"""Paged attention vs a dense causal reference on random shapes."""
import numpy as np
import torch
from hypothesis import given, settings, strategies as st

from trajserve.model.attention import AttentionMetadata, PrefillSeq, dense_attention, paged_attention, write_kv


def run_case(seqs, block_size, heads, kv_heads, d, dtype, seed):
    """seqs: list of (ctx_len, q_len). Builds a pool with scattered blocks,
    runs one mixed batch, and returns (paged, dense) outputs for the query rows."""
    g = torch.Generator().manual_seed(seed)
    nblocks = sum(-(-c // block_size) for c, _ in seqs) + 3
    k_cache = torch.randn(nblocks, kv_heads, block_size, d, generator=g).to(dtype)  # garbage in unused slots
    v_cache = torch.randn(nblocks, kv_heads, block_size, d, generator=g).to(dtype)

    def at(slots):
        return AttentionMetadata(slots // block_size, slots % block_size, None, None, None, None, 0, [])

    perm = torch.randperm(nblocks, generator=g).tolist()
    qs, slots, refs = [], [], []
    dec_rows, pair_seq, pair_block, pair_mask, prefills = [], [], [], [], []
    row = 0
    for ctx, qlen in seqs:
        nb = -(-ctx // block_size)
        table = [perm.pop() for _ in range(nb)]
        k = torch.randn(ctx, kv_heads, d, generator=g).to(dtype)
        v = torch.randn(ctx, kv_heads, d, generator=g).to(dtype)
        q = torch.randn(ctx, heads, d, generator=g).to(dtype)
        pos = np.arange(ctx)
        all_slots = torch.tensor(np.asarray(table)[pos // block_size] * block_size + pos % block_size)
        write_kv(k[: ctx - qlen], v[: ctx - qlen], k_cache, v_cache, at(all_slots[: ctx - qlen]))  # cached prefix
        slots.append(all_slots[ctx - qlen:])
        qs.append((q[ctx - qlen:], k[ctx - qlen:], v[ctx - qlen:]))
        refs.append(dense_attention(q, k, v, d ** -0.5)[ctx - qlen:])
        if qlen == 1:
            i = len(dec_rows)
            dec_rows.append(row)
            for j, b in enumerate(table):
                pair_seq.append(i)
                pair_block.append(b)
                pair_mask.append([j * block_size + t < ctx for t in range(block_size)])
        else:
            prefills.append(PrefillSeq(row, qlen, ctx, torch.tensor(table)))
        row += qlen
    q = torch.cat([x[0] for x in qs])
    slots = torch.cat(slots)
    meta = AttentionMetadata(
        slot_block=slots // block_size, slot_offset=slots % block_size,
        decode_rows=torch.tensor(dec_rows) if dec_rows else None,
        pair_seq=torch.tensor(pair_seq) if dec_rows else None,
        pair_block=torch.tensor(pair_block) if dec_rows else None,
        pair_mask=torch.tensor(pair_mask) if dec_rows else None,
        num_decodes=len(dec_rows), prefills=prefills)
    write_kv(torch.cat([x[1] for x in qs]), torch.cat([x[2] for x in qs]), k_cache, v_cache, meta)
    return paged_attention(q, k_cache, v_cache, meta, d ** -0.5), torch.cat(refs)


@settings(max_examples=40, deadline=None)
@given(
    seqs=st.lists(st.tuples(st.integers(1, 70), st.integers(1, 70)), min_size=1, max_size=6),
    block_size=st.sampled_from([1, 4, 8, 16]),
    gqa=st.sampled_from([(4, 4), (4, 2), (9, 3), (8, 1)]),
    seed=st.integers(0, 2**16),
)
def test_paged_matches_dense_random(seqs, block_size, gqa, seed):
    seqs = [(max(c, q), q) for c, q in seqs]  # q_len <= ctx_len
    out, ref = run_case(seqs, block_size, gqa[0], gqa[1], 16, torch.float32, seed)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_mixed_decode_and_chunk_with_prefix():
    # Two decodes of different lengths, a chunk with a cached prefix, a fresh prompt.
    out, ref = run_case([(37, 1), (5, 1), (100, 23), (17, 17)], 16, 9, 3, 64, torch.float32, 0)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_bfloat16_close_to_reference():
    out, ref = run_case([(300, 1), (64, 1), (200, 40)], 16, 9, 3, 64, torch.bfloat16, 1)
    assert (out.float() - ref.float()).abs().max() < 3e-2
