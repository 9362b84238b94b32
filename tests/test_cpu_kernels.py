"""The C kernels of trajserve/model/cpu_kernels.c against torch, on random
shapes, and the embedded model's greedy output with and without them."""
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from trajserve.model import cpu_kernels
from trajserve.model.attention import AttentionMetadata, dense_attention, paged_attention, write_kv
from trajserve.model.rope import apply_rope, cos_sin_table

ISAS = cpu_kernels.supported_isas()  # every build this CPU runs (avx512, avx2): each is tested
needs_kernels = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler or no AVX2 here")


@pytest.fixture(scope="module", params=ISAS or ["none"])
def K(request):
    return cpu_kernels.load(request.param) if ISAS else None


def test_kernels_build_where_they_can():
    # Every other test here needs them: on a machine with a compiler and
    # AVX2 (this one) they must build, or the model silently loses them.
    if (shutil.which("cc") or shutil.which("gcc")) and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert ISAS and all(cpu_kernels.load(isa) is not None for isa in ISAS)


def test_off_switch_and_a_failed_build_fall_back(monkeypatch, tmp_path):
    monkeypatch.setenv("TRAJSERVE_CPU_KERNELS", "0")
    assert cpu_kernels.load.__wrapped__() is None
    monkeypatch.setenv("TRAJSERVE_CPU_KERNELS", "1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", shutil.which("false") or "/bin/false")  # a compiler that always fails
    assert cpu_kernels.load.__wrapped__() is None


def _g(seed):
    return torch.Generator().manual_seed(seed)


@needs_kernels
@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 130), k=st.integers(1, 300), n=st.integers(1, 70), bias=st.booleans(),
       acc=st.booleans(), seed=st.integers(0, 2**16))
def test_linear_matches_torch(K, m, k, n, bias, acc, seed):
    """Any row count (tiles of 6, row blocks of 60, remainders), any width (panels of
    16 and a partial last one), a row stride that is not k."""
    g = _g(seed)
    x = torch.randn(m, k + 3, generator=g)[:, 3:]
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    ref = F.linear(x, w, b)
    if acc:
        res = torch.randn(m, n, generator=g)
        ref = ref + res
        out = K.linear(x, cpu_kernels.pack(w), n, b, res)
        assert out is res  # added in place
    else:
        out = K.linear(x, cpu_kernels.pack(w), n, b)
    torch.testing.assert_close(out, ref, atol=1e-5 * k ** 0.5 + 1e-6, rtol=1e-5)


@needs_kernels
def test_a_row_does_not_depend_on_its_batch(K):
    # One accumulator per output summed in order: the same bits for a row
    # alone, in a tile of 6, or in a remainder tile.
    g = _g(1)
    w, x = cpu_kernels.pack(torch.randn(50, 200, generator=g)), torch.randn(13, 200, generator=g)
    alone = torch.cat([K.linear(x[i:i + 1], w, 50, None) for i in range(13)])
    assert torch.equal(K.linear(x, w, 50, None), alone)


@needs_kernels
def test_packed_rows_and_width_check(K):
    w = torch.randn(37, 24)
    ids = torch.tensor([0, 36, 15, 16, 5])
    assert torch.equal(cpu_kernels.packed_rows(cpu_kernels.pack(w), ids), w[ids])
    with pytest.raises(ValueError, match="input has 23 features, the packed weight 24"):
        K.linear(torch.zeros(2, 23), cpu_kernels.pack(w), 37, None)


@needs_kernels
@pytest.mark.parametrize("m,k,inter", [(1, 576, 1536), (5, 64, 7), (16, 96, 33), (41, 40, 8)])
def test_gate_up_silu_matches_torch(K, m, k, inter):
    g = _g(m)
    x = torch.randn(m, k, generator=g)
    gate, up = torch.randn(inter, k, generator=g) / k ** 0.5, torch.randn(inter, k, generator=g) / k ** 0.5
    ref = F.silu(x @ gate.T) * (x @ up.T)
    out = K.gate_up_silu(x, cpu_kernels.pack_gate_up(gate, up), inter)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("ftz", [0, 1])  # SiLU runs without FTZ/DAZ, the bf16 attention with them
def test_exp_gives_the_same_bits_at_both_widths(K, ftz):
    # The avx512 build's exp16 scales by 2^n in one VSCALEFPS where exp8
    # builds 2^n from its bits; a row's softmax and SiLU must not depend on
    # the build. Every 16th float of the range exp is asked for (x <= 88:
    # ~7.6 million inputs, the clamp at -87.3 and denormal results included),
    # then the edges.
    lo, hi = np.float32(-100.0).view(np.int32), np.float32(88.0).view(np.int32)
    neg = np.arange(np.float32(-0.0).view(np.int32), lo + 1, 16, dtype=np.int64).astype(np.uint32).view(np.float32)
    pos = np.arange(0, hi + 1, 16, dtype=np.int32).view(np.float32)
    edges = np.array([-np.inf, np.nan, -87.3, -87.29, -87.31, -86.9, -0.0, 0.0, 1e-45, -1e-45, 88.0, 87.99],
                     np.float32)
    x = np.concatenate([neg, pos, edges])
    x = np.concatenate([x, np.zeros(-len(x) % 16, np.float32)])
    narrow, wide = np.empty_like(x), np.empty_like(x)
    K.lib.ts_exp_widths(x.ctypes.data, len(x), narrow.ctypes.data, wide.ctypes.data, ftz)
    assert np.array_equal(narrow.view(np.uint32), wide.view(np.uint32))
    finite = np.isfinite(x) & (x > -80)  # and exp itself: ~1 ulp
    np.testing.assert_allclose(narrow[finite], np.exp(x[finite].astype(np.float64)), rtol=3e-7)


@needs_kernels
def test_gate_up_silu_holds_at_extreme_gates(K):
    # The vector SiLU's exp(-g) is capped at exp(88): past it the exponent
    # would overflow into garbage. Gates up to +-1000 (and 21 of them: the
    # last panel is partial) must still give silu(g) * 1.
    vals = torch.tensor([-1000., -100., -88.7, -88.5, -88., -87.5, -20., -1e-30, 0., 1e-30, 3., 20., 87.,
                         88.5, 100., 1000., float("inf"), -3.5, 0.5, 7.25, float("nan")])
    gate, up = torch.zeros(len(vals), 8), torch.zeros(len(vals), 8)
    gate[:, 0], up[:, 1] = vals, 1.0
    x = torch.zeros(1, 8)
    x[0, :2] = 1.0
    out = K.gate_up_silu(x, cpu_kernels.pack_gate_up(gate, up), len(vals))[0]
    torch.testing.assert_close(out, F.silu(vals), atol=1e-34, rtol=1e-6, equal_nan=True)


@needs_kernels
@pytest.mark.parametrize("m", [1, 16, 40])  # one thread up to 16 rows, all above
def test_rms_norm_matches_torch(K, m):
    g = _g(m)
    x, w = torch.randn(m, 576, generator=g) * 3, torch.randn(576, generator=g)
    torch.testing.assert_close(K.rms_norm(x, w, 1e-5), F.rms_norm(x, (576,), w, 1e-5), atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("hq,hkv,d,bs", [(9, 3, 64, 16), (4, 4, 16, 1), (8, 2, 128, 8)])
def test_rope_store_matches_torch(K, hq, hkv, d, bs):
    g = _g(d)
    T, nblocks = 21, 40
    cos, sin = cos_sin_table(d, 512, 10000.0, None, "cpu")
    qkv = torch.randn(T, (hq + 2 * hkv) * d, generator=g)
    pos = torch.randint(0, 512, (T,), generator=g)
    slots = torch.randperm(nblocks * bs, generator=g)[:T]
    kc, vc = torch.randn(nblocks, hkv, bs, d, generator=g), torch.randn(nblocks, hkv, bs, d, generator=g)
    kc2, vc2 = kc.clone(), vc.clone()
    qk = qkv[:, : (hq + hkv) * d].view(T, hq + hkv, d)
    ref = apply_rope(qk, cos[pos], sin[pos])
    meta = AttentionMetadata(slots // bs, slots % bs, None, None, None, None, 0, [])
    write_kv(ref[:, hq:], qkv[:, (hq + hkv) * d:].view(T, hkv, d), kc2, vc2, meta)
    K.rope_store(qkv, hq, hkv, d, cos, sin, pos, kc, vc, slots // bs, slots % bs)
    torch.testing.assert_close(qkv[:, : (hq + hkv) * d].view(T, hq + hkv, d), ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(kc, kc2, atol=1e-6, rtol=1e-5)
    assert torch.equal(vc, vc2)  # untouched slots too


@needs_kernels
def test_index_tensors_must_be_int64(K):
    # The C side reads them as int64 arrays; an int32 one must not be read as garbage.
    cos, sin = cos_sin_table(16, 8, 10000.0, None, "cpu")
    qkv, kc = torch.zeros(2, 64), torch.zeros(4, 1, 4, 16)
    ok = torch.zeros(2, dtype=torch.long)
    with pytest.raises(TypeError, match="contiguous int64, got torch.int32"):
        K.rope_store(qkv, 2, 1, 16, cos, sin, ok.int(), kc, kc.clone(), ok, ok)


@needs_kernels
@settings(max_examples=30, deadline=None)
@given(ctxs=st.lists(st.integers(1, 700), min_size=1, max_size=5), bs=st.sampled_from([1, 4, 16]),
       gqa=st.sampled_from([(4, 4), (9, 3), (8, 1)]), d=st.sampled_from([16, 64]), seed=st.integers(0, 2**16))
def test_decode_attention_matches_dense(K, ctxs, bs, gqa, d, seed):
    """Decode queries (one per sequence, rows interleaved with other rows of
    the batch, q with a row stride) read scattered blocks via the tables;
    contexts past 256 keys are split into segments and merged."""
    heads, kvh = gqa
    g = _g(seed)
    nblocks = sum(-(-c // bs) for c in ctxs) + 2
    kc = torch.randn(nblocks, kvh, bs, d, generator=g)  # garbage in slots no table covers
    vc = torch.randn(nblocks, kvh, bs, d, generator=g)
    perm = torch.randperm(nblocks, generator=g).tolist()
    T = 2 * len(ctxs)  # decode rows at odd positions
    qbuf = torch.randn(T, heads * d + 5, generator=g)
    q = qbuf[:, : heads * d].view(T, heads, d)
    tables, starts, rows, refs = [], [], [], []
    for i, ctx in enumerate(ctxs):
        table = [perm.pop() for _ in range(-(-ctx // bs))]
        starts.append(len(tables))
        tables += table
        rows.append(2 * i + 1)
        k = torch.randn(ctx, kvh, d, generator=g)
        v = torch.randn(ctx, kvh, d, generator=g)
        p = np.arange(ctx)
        slots = torch.tensor(np.asarray(table)[p // bs] * bs + p % bs)
        write_kv(k, v, kc, vc, AttentionMetadata(slots // bs, slots % bs, None, None, None, None, 0, []))
        qs = torch.randn(ctx, heads, d, generator=g)
        qs[-1] = q[2 * i + 1]
        refs.append(dense_attention(qs, k, v, d ** -0.5)[-1])
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                             torch.tensor(rows), None, None, None, len(ctxs), [],
                             dec_tables=torch.tensor(tables), dec_table_start=torch.tensor(starts),
                             dec_ctx=torch.tensor(ctxs))
    out = paged_attention(q, kc, vc, meta, d ** -0.5, K)
    torch.testing.assert_close(out[rows], torch.stack(refs), atol=2e-5, rtol=1e-4)


@needs_kernels
def test_decode_attention_does_not_depend_on_the_batch_or_the_threads(K):
    # Segments sit at fixed key positions: a sequence's output is the same
    # bits alone or beside others, on 1 thread or 2 (contexts of 1 to 3
    # segments, one ending exactly on a segment's edge).
    g = _g(7)
    hq, kvh, d, bs = 9, 3, 64, 16
    ctxs = [700, 5, 512, 256, 1000]
    nb = sum(-(-c // bs) for c in ctxs)
    kc, vc = torch.randn(nb, kvh, bs, d, generator=g), torch.randn(nb, kvh, bs, d, generator=g)
    perm = torch.randperm(nb, generator=g).tolist()
    tables = [[perm.pop() for _ in range(-(-c // bs))] for c in ctxs]
    q = torch.randn(len(ctxs), hq, d, generator=g)

    def run(idx: list[int]) -> torch.Tensor:
        flat = [b for i in idx for b in tables[i]]
        starts = np.cumsum([0] + [len(tables[i]) for i in idx])[:-1]
        out = torch.full((len(ctxs), hq, d), float("nan"))
        K.decode_attention(q, kc, vc, torch.tensor(flat), torch.tensor(starts), torch.tensor([ctxs[i] for i in idx]),
                           torch.tensor(idx), d ** -0.5, out)
        return out

    batch = run(list(range(len(ctxs))))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = run(list(range(len(ctxs))))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batch, one_thread)
    for i in range(len(ctxs)):
        assert torch.equal(run([i])[i], batch[i]), f"sequence {i} (context {ctxs[i]}) alone differs"


def _paged_context(g, ctx, kvh, d, bs):
    """K/V of `ctx` tokens written into scattered blocks of a pool whose
    other slots hold garbage: (k, v, k_cache, v_cache, block_ids)."""
    nb = -(-ctx // bs)
    kc = torch.randn(nb + 3, kvh, bs, d, generator=g)
    vc = torch.randn(nb + 3, kvh, bs, d, generator=g)
    table = torch.randperm(nb + 3, generator=g)[:nb].contiguous()
    k = torch.randn(ctx, kvh, d, generator=g)
    v = torch.randn(ctx, kvh, d, generator=g)
    p = torch.arange(ctx)
    write_kv(k, v, kc, vc, AttentionMetadata(table[p // bs], p % bs, None, None, None, None, 0, []))
    return k, v, kc, vc, table


@needs_kernels
@settings(max_examples=40, deadline=None)
@given(prefix=st.integers(0, 200), n=st.integers(1, 90), bs=st.sampled_from([1, 4, 16]),
       gqa=st.sampled_from([(4, 4), (9, 3), (8, 1)]), d=st.sampled_from([8, 24, 64]), seed=st.integers(0, 2**16))
def test_prefill_attention_matches_dense(K, prefix, n, bs, gqa, d, seed):
    """A chunk of n queries after `prefix` cached tokens (query blocks of 24
    and key blocks of 64 both cut at odd places), q with a row stride."""
    heads, kvh = gqa
    g = _g(seed)
    ctx = prefix + n
    k, v, kc, vc, table = _paged_context(g, ctx, kvh, d, bs)
    qs = torch.randn(ctx, heads, d, generator=g)
    qbuf = torch.randn(n, heads * d + 5, generator=g)
    qbuf[:, : heads * d] = qs[prefix:].reshape(n, -1)
    out = torch.full((n, heads, d), float("nan"))
    K.prefill_attention(qbuf[:, : heads * d].view(n, heads, d), kc, vc, table, ctx, d ** -0.5, out)
    torch.testing.assert_close(out, dense_attention(qs, k, v, d ** -0.5)[prefix:], atol=2e-5, rtol=1e-4)


@needs_kernels
def test_prefill_attention_does_not_depend_on_the_chunking(K):
    # Caching and chunked prefill must not change a query's output by a bit:
    # the same 300 queries in one chunk, or in chunks of 7, 20 and 61 after a
    # prefix (short last query blocks of one, three and two 8-query vectors).
    g = _g(3)
    k, v, kc, vc, table = _paged_context(g, 300, 3, 64, 16)
    qs = torch.randn(300, 9, 64, generator=g)
    whole = torch.empty(300, 9, 64)
    K.prefill_attention(qs, kc, vc, table, 300, 0.125, whole)
    for step in (7, 20, 61):
        parts = torch.empty(300, 9, 64)
        for a in range(0, 300, step):
            b = min(a + step, 300)
            K.prefill_attention(qs[a:b], kc, vc, table, b, 0.125, parts[a:b])
        assert torch.equal(parts, whole)


@needs_kernels
def test_prefill_attention_rejects_a_context_its_blocks_cannot_hold(K):
    kc = torch.zeros(4, 1, 4, 8)
    q, out = torch.zeros(3, 2, 8), torch.empty(3, 2, 8)
    with pytest.raises(ValueError, match="context 9, 2 blocks of 4"):
        K.prefill_attention(q, kc, kc, torch.tensor([0, 1]), 9, 1.0, out)
    with pytest.raises(ValueError, match="chunk of 3 tokens, context 2"):
        K.prefill_attention(q, kc, kc, torch.tensor([0, 1]), 2, 1.0, out)


@needs_kernels
def test_auto_dtype_runs_the_kernels_where_they_load():
    """--dtype auto on the CPU is float32 with the C kernels wherever they
    load (AVX2-only and AVX-512 CPUs alike: they decode faster than torch's
    bf16 there), and without them bf16 only where the CPU has native bf16."""
    import torch

    from trajserve.engine.dtype import cpu_has_native_bf16, resolve_dtype

    cpu = torch.device("cpu")
    dtype, why = resolve_dtype("auto", cpu)
    assert dtype == (torch.float32 if cpu_kernels.load() is not None else
                     torch.bfloat16 if cpu_has_native_bf16() else torch.float32), why
    off, _ = resolve_dtype("auto", cpu, cpu_kernels=False)
    assert off == (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)


def test_embedded_model_same_greedy_tokens_with_and_without_kernels():
    from trajserve.llm import LLM
    from trajserve.sampling import SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):", "List three uses of a KV cache:"]
    sp = SamplingParams(max_tokens=24, temperature=0, logprobs=1)
    outs = {}
    for on in (True, False):
        # float32 both ways: without the kernels "auto" may pick bf16 (an AVX-512 BF16 CPU), and with
        # them a bf16 KV pool (AMX).
        llm = LLM(num_blocks=64, cpu_kernels=on, dtype="float32", quantization="none", kv_cache_dtype="float32")
        assert (llm.engine.model.kernels is not None) == on
        outs[on] = llm.generate(prompts, sp, use_tqdm=False)
    for a, b in zip(outs[True], outs[False]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        lp_a = [chosen for chosen, _ in a.outputs[0].logprobs]
        lp_b = [chosen for chosen, _ in b.outputs[0].logprobs]
        assert np.allclose(lp_a, lp_b, atol=1e-3)


@needs_kernels
@settings(max_examples=30, deadline=None)
@given(ctx=st.integers(1, 300), n=st.integers(1, 40), bs=st.sampled_from([1, 3, 8, 16]),
       heads=st.sampled_from([(4, 4), (4, 2), (9, 3), (8, 1)]), d=st.sampled_from([8, 64, 96]),
       seed=st.integers(0, 2**16))
def test_a_query_scores_the_same_in_decode_and_in_prefill(K, ctx, n, bs, heads, d, seed):
    """Both attention kernels run one arithmetic per query, bit for bit: a
    token's output is the same whether it was decoded or is recomputed in a
    prefill chunk (preemption, a dropped session, a cache miss), which the
    8-bit input rounding of quantized products would otherwise amplify."""
    hq, hkv = heads
    n = min(n, ctx)
    g = _g(seed)
    nb = -(-ctx // bs)
    kc, vc = torch.randn(nb + 2, hkv, bs, d, generator=g), torch.randn(nb + 2, hkv, bs, d, generator=g)
    table = torch.randperm(nb + 2, generator=g)[:nb].to(torch.int64)
    q = torch.randn(n, hq, d, generator=g)
    pre, dec = torch.empty(n, hq, d), torch.empty(n, hq, d)
    K.prefill_attention(q, kc, vc, table, ctx, d ** -0.5, pre)
    K.decode_attention(q, kc, vc, table.repeat(n), torch.arange(n, dtype=torch.int64) * nb,
                       torch.arange(ctx - n + 1, ctx + 1, dtype=torch.int64), torch.arange(n, dtype=torch.int64),
                       d ** -0.5, dec)
    assert torch.equal(pre, dec)


@pytest.mark.skipif(len(ISAS) < 2, reason="one kernel build runs here: nothing to compare it with")
@settings(max_examples=15, deadline=None)
@given(ctx=st.integers(1, 400), n=st.integers(1, 120), d=st.sampled_from([8, 24, 64, 128]), seed=st.integers(0, 2**16))
def test_every_build_gives_the_same_attention_bits(ctx, n, d, seed):
    """The AVX-512 build's prefill tiles hold 48 queries where the AVX2
    build's hold 24 (and 32 dims where it holds 16); each lane does the same
    operations, so both give the same bits, for prefill and for decode."""
    n = min(n, ctx)
    g = _g(seed)
    nb = -(-ctx // 16)
    kc, vc = torch.randn(nb, 3, 16, d, generator=g), torch.randn(nb, 3, 16, d, generator=g)
    table = torch.arange(nb, dtype=torch.int64)
    q = torch.randn(n, 9, d, generator=g)
    outs = []
    for isa in ISAS:
        o = torch.empty(n, 9, d)
        cpu_kernels.load(isa).prefill_attention(q, kc, vc, table, ctx, d ** -0.5, o)
        outs.append(o)
    assert all(torch.equal(o, outs[0]) for o in outs)


@needs_kernels
@pytest.mark.parametrize("t", [1, 5, 40])  # one thread up to 16 rows, all above
def test_rms_norm_heads_norms_each_head_in_place(K, t):
    """Qwen3's q / k head norms: each head of the given columns normed as
    transformers' RMSNorm does (within float rounding), the rest of the row untouched."""
    g = _g(t)
    x = torch.randn(t, 3 * 16 + 8, generator=g) * 3
    w = torch.rand(16, generator=g) + 0.5
    y = x.clone()
    K.rms_norm_heads(y, 8, 3, 16, w, 1e-6)
    heads = x[:, 8:].reshape(t, 3, 16)
    want = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    assert torch.allclose(y[:, 8:].reshape(t, 3, 16), want, atol=1e-5)
    assert torch.equal(y[:, :8], x[:, :8])
