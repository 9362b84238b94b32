"""Q4_K, Q5_K and Q6_K executed as stored (quant_kernels.c). Q4_K: the
super-block's d and dmin times each block's 6-bit scale and minimum make a
Q4_1-shaped block whose scales are exact in float32; Q5_K: the same with a
fifth bit a code; Q6_K: 6-bit codes with
an int8 scale per 16 values, two sums a block. test_quant_kernels.py holds
their products to the other formats' two bounds and checks that a row's bits
do not depend on its batch, the threads or the build; here, their layouts,
the fused gate and the embedding rows, and what runs them."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kquant import random_q4_k, random_q5_k, random_q6_k
from test_quant_kernels import BUILDS, needs_kernels
from trajserve.model.quant import QuantizedWeight, q4_k_fields, q5_k_fields, q6_k_fields, target_format


def test_fields_are_ggml_layout():
    """The unpacked fields rebuild gguf's own dequantization exactly."""
    w = random_q4_k(7, 512, 1, wild=True)
    raw = w.data.numpy().reshape(7, 2, 144)
    d, dmin, sc, m, codes = q4_k_fields(raw)
    df, dmf = d.copy().view(np.float16).astype(np.float32), dmin.copy().view(np.float16).astype(np.float32)
    vals = (df * sc)[..., None] * codes.reshape(7, 2, 8, 32) - (dmf * m)[..., None]
    assert np.array_equal(vals.reshape(7, 512), w.dequantize().numpy())
    assert sc.max() > 47 and m.max() > 47  # the high two bits of the 6-bit fields were exercised


def test_q5_k_fields_are_ggml_layout():
    w = random_q5_k(6, 512, 3)
    d, dmin, sc, m, codes = q5_k_fields(w.data.numpy().reshape(6, 2, 176))
    df, dmf = d.copy().view(np.float16).astype(np.float32), dmin.copy().view(np.float16).astype(np.float32)
    vals = (df * sc)[..., None] * codes.reshape(6, 2, 8, 32) - (dmf * m)[..., None]
    assert np.array_equal(vals.reshape(6, 512), w.dequantize().numpy())
    assert codes.max() == 31 and codes.min() == 0 and (codes >= 16).mean() > 0.4  # the fifth bits were read


def test_q6_k_fields_are_ggml_layout():
    w = random_q6_k(5, 512, 2)
    d, sc, codes = q6_k_fields(w.data.numpy().reshape(5, 2, 210))
    df = d.copy().view(np.float16).astype(np.float32)
    vals = (df * sc)[..., None] * (codes.reshape(5, 2, 16, 16).astype(np.float32) - 32)
    assert np.array_equal(vals.reshape(5, 512), w.dequantize().numpy())
    assert codes.max() == 63 and codes.min() == 0 and sc.min() < -100


@needs_kernels
@pytest.mark.parametrize("make", [random_q4_k, random_q5_k, random_q6_k])
def test_k_quant_gate_up_and_embedding_rows(make):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 512, generator=g)
    gate, up = make(40, 512, 4), make(40, 512, 5)
    want = F.silu(gate.reference_product(x)) * up.reference_product(x)
    ids = torch.tensor([0, 39, 17, 17, 16], dtype=torch.int64)
    for K in BUILDS.values():
        torch.testing.assert_close(K.qgate_up_silu(x, gate.pack(), up.pack()), want, atol=1e-3, rtol=1e-4)
        assert torch.equal(K.dequant_rows(gate.pack(), ids), gate.dequantize()[ids])  # gguf's values, bit for bit


def test_k_quant_bytes_per_weight_and_what_runs_as_stored():
    w = random_q4_k(32, 1024, 2)
    assert w.nbytes == 32 * 4 * 144  # the file's 4.5 bits a weight
    assert w.pack().nbytes == 32 * 1024 * 37 // 64  # 4.625: the 6-bit scales as bytes
    assert target_format("model.layers.0.mlp.down_proj.weight", "Q4_K", "auto", 1024) == "q4_k"
    assert target_format("lm_head.weight", "Q4_K", "auto", 1024) == "q4_k"
    assert target_format("model.layers.0.mlp.down_proj.weight", "Q6_K", "auto", 1024) == "q6_k"
    assert target_format("model.layers.0.mlp.down_proj.weight", "Q5_K", "auto", 1024) == "q5_k"
    assert target_format("model.layers.0.mlp.down_proj.weight", "Q3_K", "auto", 1024) == "q8_0"
    assert random_q5_k(32, 1024, 2).pack().nbytes == 32 * 1024 * 45 // 64  # 5.625 bits: the file's 5.5 + scales as bytes
    assert random_q6_k(32, 1024, 2).pack().nbytes == 32 * 1024 * 105 // 128  # 6.5625 bits: the file's
    assert target_format("model.layers.0.mlp.down_proj.weight", "Q4_K", "none", 1024) is None
    with pytest.raises(ValueError, match="q4_k"):
        QuantizedWeight.quantize(torch.randn(4, 256), "q4_k")  # read from files, never written here
    with pytest.raises(ValueError, match="multiple of 256"):
        QuantizedWeight(torch.zeros(2, 144, dtype=torch.uint8), "q4_k", (2, 128))
