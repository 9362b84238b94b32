"""MXFP4 executed as stored (quant_kernels.c): gpt-oss's experts, 4-bit
e2m1 codes with a power-of-two scale a block, multiplied through a byte
shuffle of the codes' doubled values (0, 1, 2, 3, 4, 6, 8, 12 and their
negatives) and a float32 scale 2^(e - 128). test_quant_kernels.py holds the
product to the two bounds of every format and checks that a row's bits do
not depend on its batch, the threads or the build; here, the layout, the
fused gate and the embedding rows, the largest codes, and what runs it."""
import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kquant import random_mxfp4
from test_quant_kernels import BUILDS, _extreme_inputs_match_the_reference, needs_kernels
from trajserve.model.quant import QuantizedWeight, target_format

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def test_the_blocks_are_ggml_layout():
    """A block is an e8m0 byte and 16 bytes of codes (value j in the low
    nibble of byte j, value 16 + j in the high one): e2m1(code) x 2^(e - 127),
    gguf's own dequantization, bit for bit, the scales past fp16's range included."""
    w = random_mxfp4(6, 128, torch.Generator().manual_seed(1))
    raw = w.data.numpy().reshape(6, 4, 17)
    e, qs = raw[..., 0].astype(np.int32), raw[..., 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    vals = np.asarray(E2M1, np.float32)[codes] * np.ldexp(np.float32(1), e - 127)[..., None].astype(np.float32)
    assert np.array_equal(vals.reshape(6, 128), w.dequantize().numpy())
    assert e.min() < 127 - 24 and e.max() > 127 + 16  # scales fp16 could not hold


@needs_kernels
def test_gate_up_and_embedding_rows():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 256, generator=g)
    gate, up = random_mxfp4(40, 256, g), random_mxfp4(40, 256, g)
    gate = QuantizedWeight.from_gguf(  # a gate of ordinary scale, so silu is not saturated everywhere
        gguf.quants.quantize(torch.randn(40, 256, generator=g).numpy(), gguf.GGMLQuantizationType.MXFP4),
        "mxfp4", (40, 256))
    want = F.silu(gate.reference_product(x)) * up.reference_product(x)
    ids = torch.tensor([0, 39, 17, 17, 16], dtype=torch.int64)
    for K in BUILDS.values():
        torch.testing.assert_close(K.qgate_up_silu(x, gate.pack(), up.pack()), want, atol=1e-3, rtol=1e-4)
        assert torch.equal(K.dequant_rows(up.pack(), ids), up.dequantize()[ids])  # gguf's values, bit for bit


@needs_kernels
def test_largest_codes_against_largest_inputs_do_not_overflow():
    """Codes of +-6 (shuffled to 24 and 0) against inputs of +-127: the AVX2
    build adds two groups' pair sums in int16 (at most 4 * 6096), not four
    (8 * 6096 would wrap)."""
    w = random_mxfp4(24, 512, torch.Generator().manual_seed(4))
    raw = w.data.numpy().reshape(24, 16, 17)
    raw[:12, :, 1:] = 0x77  # every code 7: +6
    raw[12:, :, 1:] = 0xFF  # every code 15: -6
    _extreme_inputs_match_the_reference(w)


def test_bytes_per_weight_and_what_runs_as_stored():
    w = random_mxfp4(32, 1024, torch.Generator().manual_seed(2))
    assert w.nbytes == 32 * 32 * 17  # the file's 4.25 bits a weight
    assert w.pack().nbytes == 32 * 1024 * 5 // 8  # 5: the scales as float32
    assert target_format("model.layers.0.mlp.experts.3.down_proj.weight", "MXFP4", "auto", 1024) == "mxfp4"
    assert target_format("model.layers.0.mlp.experts.3.down_proj.weight", "MXFP4", "none", 1024) is None
    with pytest.raises(ValueError, match="mxfp4"):
        QuantizedWeight.quantize(torch.randn(4, 64), "mxfp4")  # read from files, never written here
