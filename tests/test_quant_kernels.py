"""The quantized products of quant_kernels.c (Q8_0, Q4_0, Q4_1, the K-quants' and MXFP4's panels) against
float64 products, in every build this CPU runs, and the build selection.

The kernels quantize each input row to 8-bit blocks, so two bounds apply:
against the float64 product over the dequantized weights and the *same*
quantized inputs they differ by float32 rounding only; against the product
with the float inputs, by at most input_quantization_bound (each input value
moves by at most half its block's step) plus that rounding."""
import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from kquant import random_mxfp4, random_q4_k, random_q5_k, random_q6_k
from trajserve.model import cpu_isa, cpu_kernels
from trajserve.model.quant import (QUANT_FORMATS, STORED_FORMATS, QuantizedWeight, input_quantization_bound,
                                   quantize_input_rows, target_format)

ISAS = cpu_kernels.supported_isas()  # what this CPU runs; never a build it cannot
BUILDS = {isa: cpu_kernels.load(isa) for isa in ISAS}
needs_kernels = pytest.mark.skipif(not any(BUILDS.values()), reason="no C compiler or no AVX2 here")


K_QUANTS = ("q4_k", "q5_k", "q6_k")  # read from GGUF files only: their test bytes come from tests/kquant.py


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _weight(fmt: str, n: int, k: int, seed: int, g: torch.Generator) -> QuantizedWeight:
    if fmt == "q4_k":
        return random_q4_k(n, k, seed, wild=bool(seed % 2))
    if fmt == "q5_k":
        return random_q5_k(n, k, seed)
    if fmt == "q6_k":
        return random_q6_k(n, k, seed)
    if fmt == "mxfp4":
        return random_mxfp4(n, k, g)
    return QuantizedWeight.quantize(torch.randn(n, k, generator=g), fmt)


def _rounding(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """A float32 sum of k products of these sizes is off by <= k eps sum |x||w|
    (a loose form of the standard bound), per output."""
    eps = float(np.finfo(np.float32).eps)
    k = x.shape[1]
    return k * eps * (x.abs().double() @ w.dequantize().abs().double().T).float() + 1e-6


def test_every_build_the_cpu_runs_loads_and_names_its_dot_product():
    assert ISAS, "this project's machines all have AVX2"
    for isa, k in BUILDS.items():
        assert k is not None, isa
        assert k.isa == isa
        assert k.dot_product == {"avx2": "avx2 vpmaddubsw", "avx512": "avx512 vpdpbusd"}[isa]
    flags = cpu_kernels.cpu_flags()
    assert ("avx512" in ISAS) == (all(f in flags for f in cpu_kernels.ISA_NEEDS["avx512"])
                                  and torch.backends.cpu.get_cpu_capability() == "AVX512")


@needs_kernels
@pytest.mark.parametrize("fmt", STORED_FORMATS)
@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 130), blocks=st.integers(1, 12), n=st.integers(1, 70), bias=st.booleans(),
       acc=st.booleans(), seed=st.integers(0, 2**16))
def test_quantized_linear_within_its_bounds(fmt, m, blocks, n, bias, acc, seed):
    """Any row count (tiles, row blocks, remainders), any width in blocks
    (K-quants: in super-blocks of 8, their bytes random, Q4_K's also
    quantized from Gaussian rows), any output count (a partial last panel), a row stride
    that is not k."""
    g = _g(seed)
    k = 256 * (1 + blocks // 4) if fmt in K_QUANTS else 32 * blocks
    x = torch.randn(m, k + 5, generator=g)[:, 5:]
    w = _weight(fmt, n, k, seed, g)
    panels = w.pack()
    b = torch.randn(n, generator=g) if bias else None
    same_inputs = w.reference_product(x) + (b if bias else 0)
    float_inputs = w.reference_product(x, quantize_input=False) + (b if bias else 0)
    slack = _rounding(x, w)
    for isa, K in BUILDS.items():
        if acc:
            res = torch.randn(m, n, generator=_g(seed + 1))
            out = K.qlinear(x, panels, b, res.clone())
            got = out - res
        else:
            got = K.qlinear(x, panels, b)
        assert ((got - same_inputs).abs() <= slack + 1e-5 * res.abs() if acc else
                (got - same_inputs).abs() <= slack).all(), isa
        assert ((got - float_inputs).abs() <= input_quantization_bound(x, w) * 1.0001 + slack
                + (1e-5 * res.abs() if acc else 0)).all(), isa


@needs_kernels
@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_gate_up_silu_and_row_lookup(fmt):
    g = _g(3)
    x = torch.randn(9, 96, generator=g)
    gate = QuantizedWeight.quantize(torch.randn(40, 96, generator=g), fmt)
    up = QuantizedWeight.quantize(torch.randn(40, 96, generator=g), fmt)
    want = F.silu(gate.reference_product(x)) * up.reference_product(x)
    ids = torch.tensor([0, 39, 17, 17, 16], dtype=torch.int64)
    for K in BUILDS.values():
        torch.testing.assert_close(K.qgate_up_silu(x, gate.pack(), up.pack()), want, atol=1e-3, rtol=1e-4)
        # The embedding rows out of the panels: gguf's dequantization, bit for bit.
        assert torch.equal(K.dequant_rows(gate.pack(), ids), gate.dequantize()[ids])
        with pytest.raises(IndexError):
            K.dequant_rows(gate.pack(), torch.tensor([40], dtype=torch.int64))


@needs_kernels
def test_input_blocks_are_the_documented_rounding():
    g = _g(5)
    x = torch.randn(7, 128, generator=g) * torch.logspace(-3, 3, 128)
    x[2] = 0  # an all-zero block: scale 0, codes 0
    for K in BUILDS.values():
        raw = K.quantize_rows_q8(x).numpy().reshape(7, 4, cpu_kernels.Q8X_BLOCK_BYTES)
        d = raw[..., 0:4].copy().view(np.float32)[..., 0]
        total = raw[..., 8:12].copy().view(np.int32)[..., 0]
        q = raw[..., 16:48].view(np.int8)
        assert np.array_equal((q * d[..., None]).reshape(7, 128), quantize_input_rows(x.numpy()))
        assert np.array_equal(q.astype(np.int32).sum(-1), total)
        assert np.abs(q).max() <= 127


@needs_kernels
@pytest.mark.parametrize("fmt", STORED_FORMATS)
def test_a_row_does_not_depend_on_its_batch_the_threads_or_the_build(fmt):
    """Each output is the same integer block sums and the same float steps in
    one order, however rows are tiled: bit-identical, in every build (the
    AMX-INT8 tiles, where the CPU has them, against the vector kernel)."""
    g = _g(11)
    k = 768 if fmt in K_QUANTS else 192
    x = torch.randn(67, k, generator=g)
    w = _weight(fmt, 53, k, 12, g).pack()
    results = []
    for K in BUILDS.values():
        whole = K.qlinear(x, w)
        assert torch.equal(K.with_paths(amx_int8=False).qlinear(x, w), whole)  # 67 rows: on tiles where the CPU has them
        assert torch.equal(torch.cat([K.qlinear(x[i:i + 1], w) for i in range(67)]), whole)
        assert torch.equal(K.qlinear(x[5:40], w), whole[5:40])
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            assert torch.equal(K.qlinear(x, w), whole)
        finally:
            torch.set_num_threads(threads)
        results.append(whole)
    assert all(torch.equal(r, results[0]) for r in results)


@needs_kernels
def test_shape_and_format_errors_are_clear():
    K = next(iter(BUILDS.values()))
    w = QuantizedWeight.quantize(torch.randn(8, 64), "q4_1")
    with pytest.raises(ValueError, match="64"):
        K.qlinear(torch.randn(2, 96), w.pack())
    with pytest.raises(ValueError, match="gate q4_1"):
        K.qgate_up_silu(torch.randn(2, 64), w.pack(), QuantizedWeight.quantize(torch.randn(8, 64), "q8_0").pack())
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantizedWeight.quantize(torch.randn(4, 40), "q8_0")
    with pytest.raises(ValueError, match="supported: q8_0, q4_0, q4_1"):
        QuantizedWeight.quantize(torch.randn(4, 64), "q3_k")


def test_builds_the_cpu_cannot_run_are_never_selected(monkeypatch, caplog):
    avx2_only = frozenset({"avx2", "fma", "f16c", "sse4_2"})
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: avx2_only)
    assert cpu_kernels.supported_isas() == (["avx2"] if ISAS else [])
    with caplog.at_level(logging.WARNING):
        assert cpu_kernels.load.__wrapped__("avx512") is None
    if ISAS:
        assert "this CPU runs only avx2" in caplog.text
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: frozenset({"sse4_2"}))  # no AVX2: nothing
    assert cpu_kernels.supported_isas() == []
    assert cpu_kernels.load.__wrapped__() is None


@needs_kernels
def test_a_build_failing_its_known_answer_falls_back_with_a_warning(monkeypatch, caplog):
    real = cpu_kernels._known_answer
    monkeypatch.setattr(cpu_kernels, "_known_answer", lambda k: "Q4_1 product" if k.isa == "avx512" else real(k))
    with caplog.at_level(logging.WARNING):
        k = cpu_kernels.load.__wrapped__()
    assert k is not None and k.isa == "avx2"
    if "avx512" in ISAS:
        assert "(avx512) off: the Q4_1 product failed its known-answer check" in caplog.text
    monkeypatch.setattr(cpu_kernels, "_known_answer", lambda k: "float product")
    assert cpu_kernels.load.__wrapped__() is None


def test_format_rule():
    proj, head, embed = "model.layers.0.mlp.up_proj.weight", "lm_head.weight", "model.embed_tokens.weight"
    assert target_format(proj, "Q4_1", "auto", 576) == "q4_1"
    assert target_format(proj, "Q4_K", "auto", 576) == "q8_0"  # requantized, never to fewer bits
    assert target_format(proj, "F16", "auto", 576) is None
    assert target_format(proj, "F32", "q4_0", 576) == "q4_0"
    assert target_format(proj, "Q4_1", "none", 576) is None
    assert target_format(proj, "F32", "q8_0", 40) is None  # not a whole number of blocks
    assert target_format(head, "F32", "q4_0", 576) == "q8_0"
    assert target_format(embed, "Q8_0", "q4_0", 576) == "q8_0"
    assert target_format("model.layers.0.input_layernorm.weight", "F32", "q8_0", 576) is None
    with pytest.raises(ValueError, match="quantization must be one of"):
        target_format(proj, "F32", "int3", 576)


@needs_kernels
@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_largest_codes_against_largest_inputs_do_not_overflow(fmt):
    """Rows whose codes are all 15 (4-bit; Q8_0: +-127) against inputs that
    quantize to +-127 everywhere: the AVX2 build adds a block's 4-bit pair
    sums in int16 (at most 8 * 3810 = 30480 < 32767) before widening."""
    k = 256
    w = torch.full((24, k), 0.875)
    w[:, ::32] = -1.0  # Q4_0: d = 1/8, -1 -> code 0, 0.875 -> 15; Q4_1: minimum -1, d = 1.875/15 -> 15
    w[12:] = -w[12:]
    q = QuantizedWeight.quantize(w, fmt)
    x = torch.ones(3, k)
    x[1] = -1.0
    x[2, ::2] = -1.0
    want = q.reference_product(x)
    for K in BUILDS.values():
        torch.testing.assert_close(K.qlinear(x, q.pack()), want, atol=1e-3, rtol=1e-5)


def test_largest_q6_k_codes_against_largest_inputs_do_not_overflow():
    """Q6_K codes all 63 (+31) or 0 (-32) against inputs of +-127: the AVX2
    build adds two groups' 6-bit pair sums in int16 (at most 2 * 16002)."""
    w = random_q6_k(24, 512, 3)
    raw = w.data.numpy().reshape(24, 2, 210)
    raw[:12, :, 0:192] = 0xFF  # every code 63
    raw[12:, :, 0:192] = 0x00  # every code 0
    raw[:, :, 192:208] = 127  # the largest scales
    _extreme_inputs_match_the_reference(w)


@needs_kernels
def test_largest_q5_k_codes_against_largest_inputs_do_not_overflow():
    """Q5_K codes all 31 against inputs of +-127: the AVX2 build adds two
    groups' 5-bit pair sums in int16 (at most 4 * 7874), not four."""
    w = random_q5_k(24, 512, 4)
    raw = w.data.numpy().reshape(24, 2, 176)
    raw[:12, :, 16:176] = 0xFF  # every code 31: all fifth bits and nibbles set
    raw[12:, :, 16:176] = 0x00
    raw[:, :, 4:16] = 0xFF  # the largest 6-bit scales and minimums
    _extreme_inputs_match_the_reference(w)


def _extreme_inputs_match_the_reference(w: QuantizedWeight) -> None:
    """Inputs all +1, all -1 and alternating (each block's codes +-127)."""
    x = torch.ones(3, w.shape[1])
    x[1] = -1.0
    x[2, ::2] = -1.0
    want = w.reference_product(x)
    for K in BUILDS.values():
        torch.testing.assert_close(K.qlinear(x, w.pack()), want, atol=1e-3, rtol=1e-5)
