"""q8_0 / q4_0 KV pools (model/kv_quant.py, cpu_kernels.c): the rows' bytes, the
C kernels against torch and against a float32 pool holding the dequantized
(rotated) values, the rotation, the error bound of each format, and the
pool's capacity."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from trajserve.model.kv_quant import (FORMATS, dequantize_q4_0, dequantize_q8_0, load_rows, pool_format,
                                   quantize_q4_0, quantize_q8_0, rotate, store_rows)
from trajserve.model import cpu_kernels
from trajserve.model.attention import AttentionMetadata, PrefillSeq, paged_attention, write_kv
from trajserve.model.rope import apply_rope, cos_sin_table

ISAS = cpu_kernels.supported_isas()
needs_kernels = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler or no AVX2 here")
QFORMATS = ["q8_0", "q4_0"]
QUANT = {"q8_0": quantize_q8_0, "q4_0": quantize_q4_0}
DEQUANT = {"q8_0": dequantize_q8_0, "q4_0": dequantize_q4_0}


@pytest.fixture(scope="module", params=ISAS or ["none"])
def K(request):
    return cpu_kernels.load(request.param) if ISAS else None


@pytest.fixture(params=["tiles", "vector"])
def KP(K, request):
    """K with quantized pools' attention on AMX tiles, or on the vector
    kernels (what CPUs without AMX run)."""
    if request.param == "tiles" and not K.amx_kv_quant:
        pytest.skip("this CPU or build runs no AMX tiles for quantized pools")
    return K.with_paths(amx_kv_quant=request.param == "tiles")


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_row_layout_and_bytes_per_token():
    # 34 / 18 bytes per 32 values (8.4.2): a 64-dim row is 68 / 36 bytes; eq. 1 via the planner's table.
    from trajserve.config import ModelConfig

    assert FORMATS["q8_0"].row_elems(64) == 68 and FORMATS["q4_0"].row_elems(64) == 36
    assert FORMATS["q8_0"].row_elems(128) == 136 and FORMATS["q4_0"].row_elems(128) == 72
    mc = ModelConfig(architecture="llama", vocab_size=8, hidden_size=576, intermediate_size=8, num_layers=30,
                     num_heads=9, num_kv_heads=3, head_dim=64)
    per = {n: f.bytes_per_token(mc) for n, f in FORMATS.items()}
    assert per == {"float32": 46_080, "bfloat16": 23_040, "q8_0": 12_240, "q4_0": 6_480}
    assert per["bfloat16"] / per["q8_0"] >= 1.85 and per["bfloat16"] / per["q4_0"] >= 3.4
    with pytest.raises(ValueError, match="head_dim a multiple of 32"):
        FORMATS["q8_0"].row_elems(48)


@pytest.mark.parametrize("fmt", QFORMATS)
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), scale=st.sampled_from([1e-3, 1.0, 30.0]), groups=st.integers(1, 4))
def test_quantized_rows_are_within_the_formats_bound(fmt, seed, scale, groups):
    x = torch.randn(7, groups * 32, generator=_g(seed)) * scale
    x[0, :5] = 0.0
    x[1] = 0.0  # an all-zero group: scale 0, codes 0 (q8_0) / 8 (q4_0), values back exactly 0
    y = DEQUANT[fmt](QUANT[fmt](x), x.shape[-1])
    g = x.reshape(7, groups, 32)
    amax = g.abs().amax(-1, keepdim=True)
    err = (y.reshape(7, groups, 32) - g).abs()
    # The code grid's step is d = amax / 127 (q8_0) or amax / 8 (q4_0); codes are within half a step, except
    # q4_0's +8 d, clamped to code 15 (a whole step); the scale is stored as float16 (2^-11 relative, or
    # 2^-25 absolute below its normal range: tiny groups lose precision, as in llama.cpp) and multiplies a
    # code of at most 127 / 8.
    d = amax / (127 if fmt == "q8_0" else 8)
    scale_err = torch.maximum(d * 2.0**-11, torch.full_like(d, 2.0**-25))
    bound = (d * (0.5 if fmt == "q8_0" else 1.0) + (127 if fmt == "q8_0" else 8) * scale_err) * (1 + 1e-5)
    assert (err <= bound).all()
    assert torch.equal(y[1], torch.zeros_like(y[1]))


@pytest.mark.parametrize("fmt", QFORMATS)
def test_q4_0_and_q8_0_codes_of_known_values(fmt):
    x = torch.zeros(1, 32)
    x[0, :4] = torch.tensor([-8.0, 4.0, 1.0, -2.0])
    row = QUANT[fmt](x)
    y = DEQUANT[fmt](row, 32)
    if fmt == "q4_0":  # d = -8 / -8 = 1: every integer in [-8, 7] exact
        assert row.shape[-1] == 18 and torch.equal(y, x)
    else:  # d = 8 / 127
        assert row.shape[-1] == 34
        assert torch.allclose(y, x, atol=8 / 127 / 2 + 1e-3)
        assert row[0, 0].item() == (256 - 127)  # -8 -> code -127


@needs_kernels
@pytest.mark.parametrize("fmt", QFORMATS)
@pytest.mark.parametrize("hq,hkv,d,bs", [(9, 3, 64, 16), (4, 2, 128, 8), (2, 1, 32, 1)])
def test_c_store_writes_torchs_bytes(K, fmt, hq, hkv, d, bs):
    g = _g(d + bs)
    T, nblocks = 23, 30
    f = FORMATS[fmt]
    cos, sin = cos_sin_table(d, 512, 10000.0, None, "cpu")
    qkv = torch.randn(T, (hq + 2 * hkv) * d, generator=g) * 4
    qkv[3, (hq + hkv) * d:] = 0.0  # zero groups too
    pos = torch.randint(0, 512, (T,), generator=g)
    slots = torch.randperm(nblocks * bs, generator=g)[:T]
    kc = torch.randint(0, 256, (nblocks, hkv, bs, f.row_elems(d)), generator=g, dtype=torch.uint8)
    vc = torch.randint(0, 256, kc.shape, generator=g, dtype=torch.uint8)
    kc2, vc2 = kc.clone(), vc.clone()
    qk = apply_rope(qkv[:, : (hq + hkv) * d].view(T, hq + hkv, d), cos[pos], sin[pos])
    meta = AttentionMetadata(slots // bs, slots % bs, None, None, None, None, 0, [])
    K.rope_store(qkv, hq, hkv, d, cos, sin, pos, kc, vc, slots // bs, slots % bs)
    # torch from the C-rotated keys (RoPE itself is tested elsewhere; here the bytes of one input)
    write_kv(qkv[:, hq * d:(hq + hkv) * d].view(T, hkv, d), qkv[:, (hq + hkv) * d:].view(T, hkv, d), kc2, vc2, meta)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)  # every byte, untouched slots included
    torch.testing.assert_close(qkv[:, : (hq + hkv) * d].view(T, hq + hkv, d), qk, atol=1e-5, rtol=1e-5)


def _pools(g, fmt, nblocks, hkv, bs, d):
    """A quantized pool of random rows and the float32 pool of their values
    (as stored: the rotated groups' values)."""
    x = torch.randn(2, nblocks, hkv, bs, d, generator=g) * 3
    rows = store_rows(x, FORMATS[fmt])
    return rows[0], rows[1], DEQUANT[fmt](rows[0], d), DEQUANT[fmt](rows[1], d)


def _rotated_attention(call, q, scale, out):
    """What a quantized pool's kernel computes, through a float kernel: the
    query rotated (and / 32 with the scale), the output rotated back."""
    call(rotate(q), scale / 32, out)
    out.copy_(rotate(out) * (1 / 32))


def _as_read(K, kf, vf, hq):
    """The float pool whose kernel a quantized pool's kernel equals: float32
    values (the vector kernels), or the values as bf16 where its attention
    runs on AMX tiles (the bf16 kernels)."""
    if K.amx_quantized(kf.shape[-1], hq // kf.shape[1]):
        return kf.bfloat16(), vf.bfloat16()
    return kf, vf


def test_rotation_is_its_own_inverse_times_32_and_spreads_an_outlier():
    g = _g(3)
    x = torch.randn(5, 4, 64, generator=g)
    assert torch.equal(rotate(rotate(x)) / 32, rotate(rotate(x)) * (1 / 32))
    torch.testing.assert_close(rotate(rotate(x)) / 32, x, atol=1e-5, rtol=0)
    # H's rows are orthogonal: dot products survive up to the factor 32
    torch.testing.assert_close((rotate(x[0]) * rotate(x[1])).sum(-1) / 32, (x[0] * x[1]).sum(-1), atol=1e-4, rtol=1e-5)
    # K with an outlier channel (as real keys have): the rotated q8_0 / q4_0 rows read back closer to the values
    k = torch.randn(256, 64, generator=g)
    k[:, 5] *= 30.0
    for fmt in QFORMATS:
        plain = (DEQUANT[fmt](QUANT[fmt](k), 64) - k).pow(2).mean()
        rotated = (load_rows(store_rows(k, FORMATS[fmt]), FORMATS[fmt], 64, torch.float32) - k).pow(2).mean()
        assert rotated < plain / 4, (fmt, plain, rotated)


@needs_kernels
@pytest.mark.parametrize("fmt", QFORMATS)
@pytest.mark.parametrize("ctxs,bs,gqa,d", [((1, 17, 70, 200), 16, (9, 3), 64), ((5, 64), 8, (4, 2), 128)])
def test_c_decode_over_quantized_rows_is_the_float_kernel_on_their_values(KP, fmt, ctxs, bs, gqa, d):
    K = KP
    g = _g(len(ctxs) + d)
    hq, hkv = gqa
    nblocks = sum((c + bs - 1) // bs for c in ctxs) + 3
    kq, vq, kf, vf = _pools(g, fmt, nblocks, hkv, bs, d)
    perm = torch.randperm(nblocks, generator=g)
    tables, starts, used = [], [], 0
    for c in ctxs:
        nb = (c + bs - 1) // bs
        starts.append(len(tables))
        tables += perm[used:used + nb].tolist()
        used += nb
    args = (torch.tensor(tables), torch.tensor(starts), torch.tensor(ctxs), torch.arange(len(ctxs)))
    q = torch.randn(len(ctxs), hq, d, generator=g)
    out_q, out_f = torch.empty_like(q), torch.empty_like(q)
    K.decode_attention(q, kq, vq, *args, 0.125, out_q)
    kf, vf = _as_read(K, kf, vf, hq)
    _rotated_attention(lambda qr, sc, o: K.decode_attention(qr, kf, vf, *args, sc, o), q, 0.125, out_f)
    assert torch.equal(out_q, out_f)


@needs_kernels
@pytest.mark.parametrize("fmt", QFORMATS)
@pytest.mark.parametrize("prefix,n,bs,d", [(0, 40, 16, 64), (150, 70, 16, 64), (60, 2, 16, 64), (33, 9, 8, 128)])
def test_c_prefill_over_quantized_rows_is_the_float_kernel_on_their_values(KP, fmt, prefix, n, bs, d):
    K = KP
    g = _g(prefix + n)
    hq, hkv, ctx = 6, 2, prefix + n
    nb = (ctx + bs - 1) // bs
    kq, vq, kf, vf = _pools(g, fmt, nb + 2, hkv, bs, d)
    table = torch.randperm(nb + 2, generator=g)[:nb]
    q = torch.randn(n, hq, d, generator=g)
    out_q, out_f = torch.empty_like(q), torch.empty_like(q)
    K.prefill_attention(q, kq, vq, table, ctx, 0.125, out_q)
    kf, vf = _as_read(K, kf, vf, hq)
    _rotated_attention(lambda qr, sc, o: K.prefill_attention(qr, kf, vf, table, ctx, sc, o), q, 0.125, out_f)
    assert torch.equal(out_q, out_f)
    # each query decoded alone over the keys it sees: the chunk's bits (one arithmetic for every query)
    per_query = (table.repeat(n), torch.arange(n) * nb, torch.arange(ctx - n + 1, ctx + 1), torch.arange(n))
    alone = torch.empty_like(q)
    K.decode_attention(q, kq, vq, *per_query, 0.125, alone)
    assert torch.equal(alone, out_q)


@pytest.mark.parametrize("fmt", QFORMATS)
def test_torch_path_reads_the_same_values(fmt):
    # The torch path (no kernels) over a quantized pool equals it over the float32 pool of the values it reads
    # (dequantized and rotated back).
    g = _g(5)
    hq, hkv, d, bs, nb = 4, 2, 64, 8, 12
    kq, vq, _, _ = _pools(g, fmt, nb, hkv, bs, d)
    kf, vf = (load_rows(c, FORMATS[fmt], d, torch.float32) for c in (kq, vq))
    ctx, n = 50, 20
    table = torch.randperm(nb, generator=g)[:7]
    q = torch.randn(n, hq, d, generator=g)
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), None, None, None,
                             None, 0, [PrefillSeq(0, n, ctx, table)])
    a = paged_attention(q, kq, vq, meta, 0.125)
    meta.prefills[0].masks.clear()
    b = paged_attention(q, kf, vf, meta, 0.125)
    assert torch.equal(a, b)


def test_pool_format_from_the_tensor():
    assert pool_format(torch.zeros(2, 1, 4, 68, dtype=torch.uint8), 64).name == "q8_0"
    assert pool_format(torch.zeros(2, 1, 4, 36, dtype=torch.uint8), 64).name == "q4_0"
    assert pool_format(torch.zeros(2, 1, 4, 64, dtype=torch.bfloat16), 64).name == "bfloat16"
    with pytest.raises(ValueError, match="neither q8_0 nor q4_0"):
        pool_format(torch.zeros(2, 1, 4, 40, dtype=torch.uint8), 64)
