"""Attention sinks (gpt-oss: a learned logit per head, one more term in each
query's softmax denominator that weighs no value) in every C attention
kernel, every build, float32, bfloat16 and quantized pools (on AMX tiles
where the CPU has them), with and without a window: the dense reference
with the sink's column, torch's paged attention, and a query's bits the
same decoded or in any prefill chunk (speculation's promise)."""
import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from test_window_attention import _context
from trajserve.model import cpu_kernels
from trajserve.model.attention import AttentionMetadata, PrefillSeq, paged_attention

ISAS = cpu_kernels.supported_isas()
needs_kernels = pytest.mark.skipif(not ISAS, reason="no C compiler or no AVX2 here")


def _dense_with_sinks(q, k, v, scale, window, sinks):
    """Causal attention over one sequence (the last len(q) queries), the sink
    a column of its own in each head's softmax, dropped before the values."""
    n, ctx, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    pos_q = torch.arange(ctx - n, ctx)[:, None]
    seen = torch.arange(ctx)[None, :] <= pos_q
    if window:
        seen &= torch.arange(ctx)[None, :] > pos_q - window
    scores.masked_fill_(~seen, float("-inf"))
    with_sink = torch.cat([scores, sinks.double().view(-1, 1, 1).expand(-1, n, 1)], dim=-1).softmax(-1)
    return torch.einsum("hqk,khd->qhd", with_sink[..., :ctx], v.double()).float()


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("pool", ("float32", "bfloat16", "q8_0", "q4_0"))
@settings(max_examples=20, deadline=None)
@given(window=st.sampled_from([0, 1, 37, 80]), ctx=st.integers(1, 200), n=st.integers(1, 80),
       split=st.integers(0, 80), bs=st.sampled_from([4, 16]), heads=st.sampled_from([(4, 4), (8, 2), (6, 1)]),
       seed=st.integers(0, 2**16))
@example(window=0, ctx=150, n=40, split=17, bs=16, heads=(8, 2), seed=3)  # AMX tiles' prefill where the CPU has them
def test_sinks_decoded_or_in_any_chunk_give_the_same_bits_and_the_reference(isa, pool, window, ctx, n, split, bs,
                                                                            heads, seed):
    K = cpu_kernels.load(isa)
    hq, hkv = heads
    d, n = 64, min(n, ctx)
    g = torch.Generator().manual_seed(seed)
    kc, vc, table = _context(g, ctx, hkv, d, bs, pool)
    q = torch.randn(n, hq, d, generator=g)
    sinks = torch.randn(hq, generator=g) * 3
    dec = torch.full_like(q, float("nan"))
    K.decode_attention(q, kc, vc, table.repeat(n), torch.arange(n) * table.shape[0],
                       torch.arange(ctx - n + 1, ctx + 1), torch.arange(n), d ** -0.5, dec, window, sinks)
    whole = torch.full_like(q, float("nan"))
    K.prefill_attention(q, kc, vc, table, ctx, d ** -0.5, whole, window, sinks)
    assert torch.equal(whole, dec)
    cut = min(split, n)
    parts = torch.full_like(q, float("nan"))
    if cut:
        K.prefill_attention(q[:cut], kc, vc, table, ctx - n + cut, d ** -0.5, parts[:cut], window, sinks)
    if cut < n:
        K.prefill_attention(q[cut:], kc, vc, table, ctx, d ** -0.5, parts[cut:], window, sinks)
    assert torch.equal(parts, dec)
    # Against the dense reference over the values the pool holds (a quantized pool's, dequantized).
    p = torch.arange(ctx)
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), None, None, None,
                             None, 0, [PrefillSeq(0, n, ctx, table)])
    if pool in ("float32", "bfloat16"):
        k, v = kc[table[p // bs], :, p % bs].float(), vc[table[p // bs], :, p % bs].float()
        # A bf16 pool's kernels also round queries and probabilities to bf16 (8 bits).
        tol = dict(atol=3e-2, rtol=3e-2) if pool == "bfloat16" else dict(atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(whole, _dense_with_sinks(q, k, v, d ** -0.5, window, sinks), **tol)
    if pool != "bfloat16":  # torch's attention reads the same rows (a bf16 pool runs under float32 in C only)
        torch_out = paged_attention(q, kc, vc, meta, d ** -0.5, window=window, sinks=sinks)
        as_bf16 = not window and K.amx_quantized(d, hq // hkv)  # AMX tiles read the rows as bf16
        tol = dict(atol=3e-2, rtol=3e-2) if as_bf16 else dict(atol=1e-4, rtol=1e-3)
        torch.testing.assert_close(whole, torch_out, **tol)
    without = torch.full_like(q, float("nan"))
    K.prefill_attention(q, kc, vc, table, ctx, d ** -0.5, without, window)
    assert not torch.equal(without, whole)  # the sinks took part


@needs_kernels
def test_sinks_of_another_shape_are_refused():
    K = cpu_kernels.load()
    g = torch.Generator().manual_seed(2)
    q = torch.randn(4, 4, 64, generator=g)
    kc, vc, table = _context(g, 20, 2, 64, 16, "float32")
    with pytest.raises(ValueError, match=r"sinks must be contiguous float32 \[4\]"):
        K.prefill_attention(q, kc, vc, table, 20, 0.125, torch.empty_like(q), 0, torch.zeros(3))
