"""Sliding-window attention (a window layer's query sees its latest `window`
keys): the C kernels of every build and pool format, and the torch path,
against a dense reference; a query's bits the same decoded or in any prefill
chunk; the pool's blocks before a window never read (a window group may
have freed them)."""
import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from trajserve.model import cpu_kernels
from trajserve.model.attention import AttentionMetadata, PrefillSeq, dense_attention, paged_attention, write_kv
from trajserve.model.kv_quant import FORMATS, kv_format

ISAS = cpu_kernels.supported_isas()
needs_kernels = pytest.mark.skipif(not ISAS, reason="no C compiler or no AVX2 here")
POOLS = ("float32", "bfloat16", "q8_0", "q4_0")


def _pool_format(name: str):
    return kv_format(getattr(torch, name)) if name in ("float32", "bfloat16") else FORMATS[name]


def _context(g, ctx, hkv, d, bs, pool, poison_before=0):
    """K/V of ctx tokens in scattered blocks of a `pool` pool; the slots of
    positions < poison_before hold NaN (float pools), as a freed block's
    reuse could hold anything. Returns (k, v, k_cache, v_cache, table) with
    k, v the values the pool holds (rounded as stored)."""
    nb = -(-ctx // bs)
    f = _pool_format(pool)
    shape = (nb + 2, hkv, bs, f.row_elems(d))
    kc, vc = torch.zeros(shape, dtype=f.storage), torch.zeros(shape, dtype=f.storage)
    table = torch.randperm(nb + 2, generator=g)[:nb].contiguous()
    k, v = torch.randn(ctx, hkv, d, generator=g), torch.randn(ctx, hkv, d, generator=g)
    p = torch.arange(ctx)
    meta = AttentionMetadata(table[p // bs], p % bs, None, None, None, None, 0, [])
    write_kv(k, v, kc, vc, meta)
    if pool in ("float32", "bfloat16") and poison_before:
        hidden = p[:poison_before]
        kc[table[hidden // bs], :, hidden % bs] = float("nan")
        vc[table[hidden // bs], :, hidden % bs] = float("nan")
    return kc, vc, table


def _decodes(K, q, kc, vc, table, ctx, window):
    """Each of q's n queries (the last at position ctx - 1) as a decode."""
    n, hq, d = q.shape
    out = torch.full_like(q, float("nan"))
    K.decode_attention(q, kc, vc, table.repeat(n), torch.arange(n) * table.shape[0], torch.arange(ctx - n + 1, ctx + 1),
                       torch.arange(n), d ** -0.5, out, window)
    return out


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("pool", POOLS)
@settings(max_examples=25, deadline=None)
@given(window=st.integers(1, 160), ctx=st.integers(1, 300), n=st.integers(1, 120), split=st.integers(0, 120),
       bs=st.sampled_from([1, 4, 16]), heads=st.sampled_from([(4, 4), (9, 3), (8, 1)]),
       d=st.sampled_from([32, 64]), seed=st.integers(0, 2**16))
@example(window=70, ctx=300, n=120, split=50, bs=16, heads=(9, 3), d=64, seed=0)  # windows across 64-key blocks
@example(window=1, ctx=130, n=130, split=7, bs=4, heads=(4, 4), d=32, seed=1)  # each query sees itself only
def test_a_window_query_scores_the_same_decoded_or_in_any_chunk(isa, pool, window, ctx, n, split, bs, heads, d, seed):
    """Prefill chunks (whole, or cut at `split`) give each query the decode
    kernel's bits, reading no key before the chunk's first window."""
    K = cpu_kernels.load(isa)
    hq, hkv = heads
    n = min(n, ctx)
    g = torch.Generator().manual_seed(seed)
    first_seen = max(0, ctx - n - window + 1)  # the chunk's first query's window starts here
    kc, vc, table = _context(g, ctx, hkv, d, bs, pool, poison_before=first_seen)
    q = torch.randn(n, hq, d, generator=g)
    dec = _decodes(K, q, kc, vc, table, ctx, window)
    whole = torch.full_like(q, float("nan"))
    K.prefill_attention(q, kc, vc, table, ctx, d ** -0.5, whole, window)
    assert torch.isfinite(whole).all(), "a key before the window was read"
    assert torch.equal(whole, dec)
    cut = min(split, n)
    parts = torch.full_like(q, float("nan"))
    start = ctx - n
    if cut:
        K.prefill_attention(q[:cut], kc, vc, table, start + cut, d ** -0.5, parts[:cut], window)
    K.prefill_attention(q[cut:], kc, vc, table, ctx, d ** -0.5, parts[cut:], window) if cut < n else None
    assert torch.equal(parts, dec)


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@settings(max_examples=25, deadline=None)
@given(window=st.integers(1, 160), ctx=st.integers(1, 300), n=st.integers(1, 90), bs=st.sampled_from([1, 4, 16]),
       heads=st.sampled_from([(4, 4), (9, 3), (8, 1)]), d=st.sampled_from([8, 24, 64]), seed=st.integers(0, 2**16))
def test_window_attention_matches_the_dense_reference(isa, window, ctx, n, bs, heads, d, seed):
    """The C kernels (float32 pool) and the torch path against dense
    attention with the window's mask, for a chunk after a cached prefix."""
    K = cpu_kernels.load(isa)
    hq, hkv = heads
    n = min(n, ctx)
    g = torch.Generator().manual_seed(seed)
    kc, vc, table = _context(g, ctx, hkv, d, bs, "float32")
    p = torch.arange(ctx)
    k, v = kc[table[p // bs], :, p % bs], vc[table[p // bs], :, p % bs]
    qs = torch.randn(ctx, hq, d, generator=g)
    ref = dense_attention(qs, k, v, d ** -0.5, window)[ctx - n:]
    out = torch.full((n, hq, d), float("nan"))
    K.prefill_attention(qs[ctx - n:], kc, vc, table, ctx, d ** -0.5, out, window)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), None, None, None,
                             None, 0, [PrefillSeq(0, n, ctx, table)])
    torch.testing.assert_close(paged_attention(qs[ctx - n:], kc, vc, meta, d ** -0.5, window=window), ref,
                               atol=2e-5, rtol=1e-4)
    # The torch decode path (pairs of (sequence, block)) for the chunk's last query.
    nb = -(-ctx // bs)
    pos = torch.arange(nb)[:, None] * bs + torch.arange(bs)[None, :]
    dmeta = AttentionMetadata(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), torch.tensor([0]),
                              torch.zeros(nb, dtype=torch.long), table, pos < ctx, 1, [],
                              pair_pos=pos, pair_ctx=torch.full((nb,), ctx))
    torch.testing.assert_close(paged_attention(qs[-1:], kc, vc, dmeta, d ** -0.5, window=window), ref[-1:],
                               atol=2e-5, rtol=1e-4)


@needs_kernels
def test_a_window_wider_than_the_context_is_full_attention():
    K = cpu_kernels.load()
    g = torch.Generator().manual_seed(5)
    kc, vc, table = _context(g, 90, 2, 32, 16, "float32")
    q = torch.randn(90, 4, 32, generator=g)
    full, wide = torch.empty_like(q), torch.empty_like(q)
    K.prefill_attention(q, kc, vc, table, 90, 0.2, full)
    K.prefill_attention(q, kc, vc, table, 90, 0.2, wide, 90)
    assert torch.equal(full, wide)
    narrow = torch.empty_like(q)
    K.prefill_attention(q, kc, vc, table, 90, 0.2, narrow, 89)
    assert torch.equal(narrow[:89], full[:89]) and not torch.equal(narrow[89], full[89])
