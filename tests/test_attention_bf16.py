"""Attention over a bfloat16 KV pool (trajserve/model/attention_bf16.c) and
its AMX tiles: one arithmetic per query, bit for bit, whichever
kernel and build computes it; close to float64 within bf16's rounding; and
the engine's --kv-cache-dtype choosing and reporting it.

Every build the CPU runs is tested; the AMX paths where the CPU has AMX
(elsewhere they are never selected, which is tested too)."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from trajserve.model import cpu_kernels
from trajserve.model.quant import STORED_FORMATS, QuantizedWeight, group_size

ISAS = cpu_kernels.supported_isas()
needs_kernels = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler or no AVX2 here")
AMX = cpu_kernels.load() is not None and cpu_kernels.load().amx
AMX_INT8 = cpu_kernels.load() is not None and cpu_kernels.load().amx_int8
needs_amx = pytest.mark.skipif(not AMX, reason="no AMX-BF16 on this CPU: its prefill is never selected here")
needs_amx_int8 = pytest.mark.skipif(not AMX_INT8, reason="no AMX-INT8 on this CPU: never selected here")


@pytest.fixture(scope="module", params=ISAS or ["none"])
def K(request):
    return cpu_kernels.load(request.param) if ISAS else None


def _pool(g, nb, hkv, bs, d):
    return (torch.randn(nb, hkv, bs, d, generator=g).to(torch.bfloat16),
            torch.randn(nb, hkv, bs, d, generator=g).to(torch.bfloat16))


def _prefill(K, q, kc, vc, table, ctx, amx: bool) -> torch.Tensor:
    out = torch.empty_like(q)
    K.with_paths(amx=amx).prefill_attention(q, kc, vc, table, ctx, q.shape[-1] ** -0.5, out)
    return out


def _decodes(K, q, kc, vc, table, ctx, amx: bool | None = None) -> torch.Tensor:
    """Each query of a chunk decoded alone over the keys it sees (amx: on
    tiles or not; None: as K stands)."""
    n, nb = q.shape[0], table.shape[0]
    out = torch.empty_like(q)
    K = K if amx is None else K.with_paths(amx=amx)
    K.decode_attention(q, kc, vc, table.repeat(n), torch.arange(n, dtype=torch.int64) * nb,
                       torch.arange(ctx - n + 1, ctx + 1, dtype=torch.int64), torch.arange(n, dtype=torch.int64),
                       q.shape[-1] ** -0.5, out)
    return out


def _dense(q, kc, vc, table, ctx) -> torch.Tensor:
    """float64 causal attention over the pool's (bf16) K/V, queries exact."""
    n, hq, d = q.shape
    hkv = kc.shape[1]
    k = kc[table].transpose(0, 1).reshape(hkv, -1, d)[:, :ctx].double().repeat_interleave(hq // hkv, 0)
    v = vc[table].transpose(0, 1).reshape(hkv, -1, d)[:, :ctx].double().repeat_interleave(hq // hkv, 0)
    s = torch.einsum("qhd,hkd->hqk", q.double(), k) * d ** -0.5
    s.masked_fill_(torch.arange(ctx)[None] > torch.arange(ctx - n, ctx)[:, None], float("-inf"))
    return torch.einsum("hqk,hkd->qhd", s.softmax(-1), v)


@needs_kernels
@settings(max_examples=30, deadline=None)
@given(ctx=st.integers(1, 300), n=st.integers(1, 70), bs=st.sampled_from([8, 16, 32]),
       heads=st.sampled_from([(4, 4), (9, 3), (8, 1)]), d=st.sampled_from([32, 64, 128]),
       seed=st.integers(0, 2**16))
def test_a_query_scores_the_same_decoded_and_in_any_prefill(K, ctx, n, bs, heads, d, seed):
    """The vector decode kernel, a chunk run as decodes and (with AMX) the
    tile prefill and tile decode give the same bits for every query: a token
    scores the same decoded, in a chunk, or recomputed after preemption."""
    hq, hkv = heads
    n = min(n, ctx)
    g = torch.Generator().manual_seed(seed)
    nb = -(-ctx // bs)
    kc, vc = _pool(g, nb + 2, hkv, bs, d)
    table = torch.randperm(nb + 2, generator=g)[:nb].to(torch.int64)
    q = torch.randn(n, hq, d, generator=g)
    dec = _decodes(K, q, kc, vc, table, ctx, amx=False)
    assert torch.equal(_prefill(K, q, kc, vc, table, ctx, amx=False), dec)
    if K.amx:  # tiles need 16 contiguous keys a block: bs 8 runs on the vector kernel, which the equality also covers
        assert torch.equal(_prefill(K, q, kc, vc, table, ctx, amx=True), dec)
        assert torch.equal(_decodes(K, q, kc, vc, table, ctx, amx=True), dec)


@needs_kernels
@pytest.mark.parametrize("n,ctx,d", [(1, 1, 64), (37, 100, 64), (200, 700, 64), (64, 64, 128), (20, 300, 32)])
def test_bf16_attention_is_within_bf16_rounding_of_float64(K, n, ctx, d):
    """Queries and probabilities rounded to bf16 (K/V already are): each
    moves an output by at most ~2^-8 of its inputs' size; a wrong key, mask
    or rescale moves it by O(1)."""
    g = torch.Generator().manual_seed(n + ctx)
    nb = -(-ctx // 16)
    kc, vc = _pool(g, nb, 3, 16, d)
    table = torch.arange(nb, dtype=torch.int64)
    q = torch.randn(n, 9, d, generator=g)
    ref = _dense(q, kc, vc, table, ctx)
    for amx in (False, True) if K.amx else (False,):
        err = (_prefill(K, q, kc, vc, table, ctx, amx).double() - ref).abs().max().item()
        assert err < 0.02, (amx, err)
    for amx in (False, True) if K.amx else (False,):
        assert (_decodes(K, q, kc, vc, table, ctx, amx).double() - ref).abs().max().item() < 0.02


@pytest.mark.skipif(len(ISAS) < 2, reason="one kernel build runs here: nothing to compare it with")
@settings(max_examples=10, deadline=None)
@given(ctx=st.integers(1, 300), n=st.integers(1, 60), seed=st.integers(0, 2**16))
def test_every_build_gives_the_same_bf16_attention_bits(ctx, n, seed):
    n = min(n, ctx)
    g = torch.Generator().manual_seed(seed)
    nb = -(-ctx // 16)
    kc, vc = _pool(g, nb, 3, 16, 64)
    table = torch.arange(nb, dtype=torch.int64)
    q = torch.randn(n, 9, 64, generator=g)
    outs = [_prefill(cpu_kernels.load(isa), q, kc, vc, table, ctx, amx=cpu_kernels.load(isa).amx) for isa in ISAS]
    assert all(torch.equal(o, outs[0]) for o in outs)


@needs_kernels
def test_rope_store_rounds_k_and_v_to_nearest_bf16(K):
    from trajserve.model.rope import apply_rope, cos_sin_table

    g = torch.Generator().manual_seed(3)
    t, hq, hkv, d, bs = 7, 4, 2, 64, 16
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
    pos = torch.tensor([0, 3, 5, 9, 17, 40, 41])
    cos, sin = cos_sin_table(d, 64, 10000.0, None, "cpu")
    kc, vc = torch.zeros(4, hkv, bs, d, dtype=torch.bfloat16), torch.zeros(4, hkv, bs, d, dtype=torch.bfloat16)
    blocks, offs = pos // bs, pos % bs
    want = apply_rope(qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d), cos[pos], sin[pos])
    v = qkv[:, (hq + hkv) * d:].view(t, hkv, d).clone()
    K.rope_store(qkv, hq, hkv, d, cos, sin, pos, kc, vc, blocks, offs)
    assert torch.allclose(qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d), want, atol=1e-5)
    for i in range(t):  # torch rounds to nearest even, as the kernel must
        assert torch.equal(kc[blocks[i], :, offs[i]], qkv[i, hq * d: (hq + hkv) * d].view(hkv, d).to(torch.bfloat16))
        assert torch.equal(vc[blocks[i], :, offs[i]], v[i].to(torch.bfloat16))


@needs_kernels
def test_a_pool_of_another_dtype_is_refused(K):
    q = torch.randn(2, 4, 64)
    kc = torch.zeros(2, 2, 16, 64, dtype=torch.float16)
    with pytest.raises(TypeError, match="float32, bfloat16 or uint8"):
        K.prefill_attention(q, kc, kc, torch.tensor([0, 1]), 2, 0.125, torch.empty_like(q))
    with pytest.raises(TypeError, match="float32, bfloat16 or uint8"):
        K.prefill_attention(q, kc.float(), kc.bfloat16(), torch.tensor([0, 1]), 2, 0.125, torch.empty_like(q))


@needs_amx_int8
@settings(max_examples=25, deadline=None)
@given(m=st.integers(32, 130), blocks=st.integers(1, 20), n=st.integers(1, 70),
       fmt=st.sampled_from(STORED_FORMATS), bias=st.booleans(), acc=st.booleans(),
       seed=st.integers(0, 2**16))
def test_amx_int8_products_give_the_vector_kernels_bits(m, blocks, n, fmt, bias, acc, seed):
    """A prefill chunk's products on tiles and a decode's on vpdpbusd give
    the same bits (same integers, same float steps per block), for any rows,
    width and stored format (every code, scale and minimum random), with
    bias and the residual add."""
    K = cpu_kernels.load()
    g = torch.Generator().manual_seed(seed)
    k = 32 * blocks if group_size(fmt) == 32 else 256 * (1 + blocks // 8)
    x = torch.randn(m, k, generator=g)
    w = QuantizedWeight.random_blocks(fmt, n, k, np.random.default_rng(seed)).pack()
    b = torch.randn(n, generator=g) if bias else None
    res = torch.randn(m, n, generator=g)
    outs = []
    for amx in (True, False):
        outs.append(K.with_paths(amx_int8=amx).qlinear(x, w, b, res.clone() if acc else None))
    assert torch.equal(outs[0], outs[1])


@needs_amx_int8
def test_rows_wider_than_the_tile_path_takes_run_on_the_vector_kernel():
    K = cpu_kernels.load()
    g = torch.Generator().manual_seed(9)
    x = torch.randn(40, 32 * 300, generator=g)  # 300 blocks a row: over the 256 the tiles' repacking holds
    w = QuantizedWeight.quantize(torch.randn(24, 32 * 300, generator=g), "q4_1").pack()
    want = K.with_paths(amx_int8=False).qlinear(x, w)
    assert torch.equal(K.qlinear(x, w), want)


@needs_kernels
def test_which_formats_and_rows_run_on_amx_int8_tiles(K):
    """The tile path's reach, as the kernels report it (what the load check
    and `bench products` read): every format but Q6_K from 32 rows, and
    nothing in a build or on a CPU without AMX-INT8."""
    want = 32 if K.isa == "avx512" and K.amx_int8 else 0
    assert {f: K.tile_rows(f) for f in STORED_FORMATS} == {f: 0 if f == "q6_k" else want for f in STORED_FORMATS}
    assert all(K.without("amx_int8").tile_rows(f) == 0 for f in STORED_FORMATS)


def test_bench_products_compares_the_paths_or_says_there_are_none(capsys):
    import json

    from trajserve.cli import main

    rc = main(["bench", "products", "--formats", "q4_k,q6_k", "--rows", "8,40", "--repeats", "1", "--json"])
    out = capsys.readouterr().out
    if not AMX_INT8:
        assert rc == 1 and "runs no AMX-INT8 tiles" in out
        return
    rows = json.loads(out)["results"]
    assert [(r["format"], r["rows"], r["tiles_arm_runs"]) for r in rows] == [
        ("q4_k", 8, "VNNI (tiles from 32 rows)"), ("q4_k", 40, "tiles"),
        ("q6_k", 8, "VNNI (no tile path)"), ("q6_k", 40, "VNNI (no tile path)")]
    assert all(r["tiles_ms"] > 0 and r["vnni_ms"] > 0 for r in rows)


@needs_amx_int8
@pytest.mark.parametrize("fmt", ["q4_1", "q4_k", "q5_k", "mxfp4"])
def test_amx_int8_gate_up_gives_the_vector_kernels_bits(fmt):
    K = cpu_kernels.load()
    rng = np.random.default_rng(5)
    x = torch.from_numpy(rng.standard_normal((45, 512), dtype=np.float32))
    gate, up = (QuantizedWeight.random_blocks(fmt, 40, 512, rng).pack() for _ in range(2))
    want = K.with_paths(amx_int8=False).qgate_up_silu(x, gate, up)
    assert torch.equal(K.qgate_up_silu(x, gate, up), want)


@needs_kernels
def test_amx_is_used_only_where_it_runs_and_gives_the_same_bits(monkeypatch, caplog):
    """No AMX flags, or a tile kernel whose bits differ from the decode
    kernel's: the paths stay off (with a warning for the second), and the
    engine's auto pool then stays float32."""
    from trajserve.model import amx_check

    K = cpu_kernels.load()
    no_amx = frozenset({"avx2", "fma", "f16c"})
    assert not amx_check.amx_usable(K, no_amx) and not amx_check.amx_int8_usable(K, no_amx)
    if not AMX:
        return
    real = cpu_kernels.CpuKernels.prefill_attention

    def off_by_one_bit(self, q, kc, vc, table, ctx, scale, out):
        real(self, q, kc, vc, table, ctx, scale, out)
        if self.amx:
            out.view(torch.int32)[0, 0, 0] ^= 1

    monkeypatch.setattr(cpu_kernels.CpuKernels, "prefill_attention", off_by_one_bit)
    with caplog.at_level("WARNING"):
        assert not amx_check.amx_usable(K, cpu_kernels.cpu_flags())
        # a quantized pool's tile path whose bits differ from the bf16 kernel's stays off too
        assert not amx_check.amx_kv_quant_usable(K.with_paths(amx=True, amx_kv_quant=False))
    assert "differs from the vector decode kernel" in caplog.text
    assert "quantized KV pools stay on the vector kernel" in caplog.text


def test_kv_dtype_resolution():
    from trajserve.engine.dtype import resolve_kv_dtype

    class Kern(cpu_kernels.CpuKernels):
        def __init__(self, amx):
            self.paths = cpu_kernels.KernelPaths(amx=amx, amx_kv_quant=amx)

    f32, bf16 = torch.float32, torch.bfloat16

    def name(*args, **kw):  # the pool format auto or a request resolves to
        return resolve_kv_dtype(*args, **kw)[0].name

    assert name("auto", f32, Kern(True)) == "bfloat16"
    assert name("auto", f32, Kern(True), head_dim=80) == "float32"  # no tiles for 80 dims
    assert name("auto", f32, Kern(True), block_size=8) == "float32"  # nor 8-key blocks
    assert name("auto", f32, Kern(False)) == "float32"  # a chunk as decodes: slower, not chosen
    assert name("auto", f32, None) == "float32"
    assert name("auto", bf16, None) == "bfloat16"
    fmt, why = resolve_kv_dtype("bfloat16", f32, Kern(False))
    assert fmt.storage == bf16 and why == "requested (no AMX tiles for it here: a prefill chunk runs as decodes, slower)"
    assert name("q8_0", f32, Kern(False)) == "q8_0" and name("q4_0", bf16, None) == "q4_0"  # never auto
    assert "on AMX tiles" in resolve_kv_dtype("q8_0", f32, Kern(True), group=3)[1]
    assert "dequantized as read in the C kernels" in resolve_kv_dtype("q8_0", f32, Kern(True), group=17)[1]
    with pytest.raises(ValueError, match=r"kv_cache_dtype \(--kv-cache-dtype\) bfloat16 .* C kernels"):
        resolve_kv_dtype("bfloat16", f32, None)
    with pytest.raises(ValueError, match=r"kv_cache_dtype \(--kv-cache-dtype\) float32 cannot run under"):
        resolve_kv_dtype("float32", bf16, None)


def test_bad_kv_cache_dtype_is_named():
    from trajserve.config import CacheConfig, EngineConfig

    with pytest.raises(ValueError, match=r"kv_cache_dtype \(--kv-cache-dtype\) must be one of auto, float32, "
                                         r"bfloat16, q8_0, q4_0, got 'fp8'"):
        EngineConfig(cache=CacheConfig(kv_cache_dtype="fp8")).validate()


@needs_kernels
def test_engine_bf16_pool_halves_the_bytes_and_says_so():
    from trajserve.llm import LLM

    llms = {kv: LLM(num_blocks=32, dtype="float32", kv_cache_dtype=kv) for kv in ("float32", "bfloat16")}
    e32, e16 = llms["float32"].engine, llms["bfloat16"].engine
    assert e16.kv_dtype == torch.bfloat16 and e32.kv_dtype == torch.float32
    assert e16.runner.kv_caches[0][0].dtype == torch.bfloat16
    assert e16.block_layout.dtype == "bfloat16" and e32.block_layout.dtype == "float32"
    assert "KV cache: bfloat16 (requested" in e16.startup_summary
    m32 = e32.model_config.kv_bytes_per_token(4)
    assert f"m_token = {m32 // 2:,} B" in e16.startup_summary and f"m_token = {m32:,} B" in e32.startup_summary
    auto = LLM(num_blocks=32, dtype="float32").engine
    assert auto.kv_dtype == (torch.bfloat16 if AMX else torch.float32)


@needs_kernels
def test_bf16_pool_greedy_text_stays_close_to_float32():
    """Rounding K/V, queries and probabilities to bf16 leaves the embedded
    model's greedy continuation of a plain prompt as it was for the first
    tokens (the full-agreement figures are bench quant-agreement's)."""
    from trajserve.llm import LLM
    from trajserve.sampling import SamplingParams

    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = [LLM(num_blocks=32, dtype="float32", kv_cache_dtype=kv).generate(["The capital of France is"], sp,
                                                                            use_tqdm=False)[0]
            for kv in ("float32", "bfloat16")]
    assert outs[0].outputs[0].token_ids[:4] == outs[1].outputs[0].token_ids[:4]
