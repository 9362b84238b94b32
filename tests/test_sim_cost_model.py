"""The simulator's cost model against hand-computed step times.

Every expected value below is written out from the formula in
trajserve/sim/cost_model.py with the catalog's numbers (H100 SXM: 989e12
FLOP/s, 3.35e12 B/s, PCIe Gen5 64e9 B/s, NVMe 7e9 B/s; Llama-3-70B shapes),
not computed by calling the code under test, and the spec's own worked
example (inference-optimization 8.2.2/8.2.3: 46.7 ms memory-bound decode,
158.7 ms compute-bound mixed batch) is reproduced.
"""
from __future__ import annotations

import pytest

from trajserve.config import ModelConfig
from trajserve.plan.catalog import get_device, get_model
from trajserve.sim.cost_model import CostModel, causal_pairs
from trajserve.sim.hardware import Hardware, ModelCost

# Llama-3-70B, written out: per layer q 8192x8192, k and v 8192x1024 each,
# o 8192x8192, MLP 3 x 8192x28672; 80 layers.
N_MM = 80 * (8192 * 8192 + 2 * 8192 * 1024 + 8192 * 8192 + 3 * 8192 * 28672)  # 68,451,041,280
N_HEAD = 128256 * 8192                                                       # 1,050,673,152
D_W = 2 * (70_553_706_496 - N_HEAD)  # bf16 weights a step reads: all but the embedding table
L, DQ = 80, 64 * 128
M_TOKEN_DEV = 2 * L * 1 * 128 * 2  # eq. 1 with H_kv / TP = 8 / 8 = 1 head per device: 40,960 B
P, BW, MFU, MBU, FIXED, TP = 989e12, 3.35e12, 0.45, 0.7, 0.002, 8


@pytest.fixture(scope="module")
def cost() -> CostModel:
    hw = Hardware.from_device(get_device("h100"), mfu=MFU, mbu=MBU, fixed_overhead_s=FIXED)
    return CostModel(hw, ModelCost.from_spec(get_model("llama-3-70b"), tp=TP))


def test_model_constants_match_hand_counts(cost):
    m = cost.model
    assert m.matmul_params == N_MM == 68_451_041_280
    assert m.head_params == N_HEAD
    assert m.weight_read_bytes == D_W == 139_006_066_688
    assert m.m_token_device == M_TOKEN_DEV == 40_960


def test_decode_batch_is_memory_bound(cost):
    # 8 sequences decode one token each after 1,000 cached tokens.
    b, h = 8, 1000
    flops = (2 * N_MM * b + 2 * N_HEAD * b + 4 * L * DQ * b * (h + 1)) / TP
    nbytes = D_W / TP + M_TOKEN_DEV * b * (h + 1)
    t_comp, t_mem = flops / (P * MFU), nbytes / (BW * MBU)
    step = cost.step_for([(1, h)] * b)
    assert t_mem > t_comp  # decode streams the weights: memory-bound
    assert step.compute_s == pytest.approx(t_comp, rel=1e-12)
    assert step.memory_s == pytest.approx(t_mem, rel=1e-12)
    assert step.total_s == pytest.approx(t_mem + FIXED, rel=1e-12)
    assert not step.compute_bound
    assert step.total_s == pytest.approx(0.0096, abs=2e-4)  # ~7.4 ms of weights + KV + 2 ms fixed


def test_prefill_chunk_is_compute_bound_with_quadratic_attention(cost):
    c = 8192
    pairs = c * (c + 1) // 2  # N_pair = c h + c (c + 1) / 2 with h = 0 (8.2.3)
    flops = (2 * N_MM * c + 2 * N_HEAD * 1 + 4 * L * DQ * pairs) / TP
    nbytes = D_W / TP + M_TOKEN_DEV * c
    step = cost.step_for([(c, 0)])
    assert step.compute_bound
    assert step.compute_s == pytest.approx(flops / (P * MFU), rel=1e-12)
    assert step.memory_s == pytest.approx(nbytes / (BW * MBU), rel=1e-12)
    assert step.total_s == pytest.approx(flops / (P * MFU) + FIXED, rel=1e-12)


def test_attention_term_is_quadratic_in_the_chunk_and_linear_in_the_context(cost):
    per_pair = 4 * L * DQ / TP / (P * MFU)
    assert causal_pairs(4, 0) == 10 and causal_pairs(4, 8) == 42  # the spec's figs. 8-8, 8-9
    assert causal_pairs(512, 7680) == 4_063_488  # 8.2.3: the last 512-token chunk of an 8K prompt

    def compute(c, h):  # no row sampled: only the linear and attention terms
        return cost.step(c, causal_pairs(c, h), c + h, 1, 0).compute_s

    # Doubling a chunk doubles the linear work and adds c^2 pairs: the quadratic term.
    c = 2048
    assert compute(2 * c, 0) - 2 * compute(c, 0) == pytest.approx(c * c * per_pair, rel=1e-9)
    # The same chunk after H cached tokens: c H more pairs, nothing else.
    H = 30_000
    assert compute(c, H) - compute(c, 0) == pytest.approx(c * H * per_pair, rel=1e-9)


def test_mixed_batch_reads_weights_once_and_kv_per_sequence(cost):
    # 32 decodes at 2,000 tokens of context + one 512-token chunk after 1,024 cached.
    chunks = [(1, 2000)] * 32 + [(512, 1024)]
    step = cost.step_for(chunks)
    nbytes = D_W / TP + M_TOKEN_DEV * (32 * 2001 + 1536)
    assert step.memory_s == pytest.approx(nbytes / (BW * MBU), rel=1e-12)
    # Weights are not read once per sequence: 33 sequences cost far less than 33 decodes alone.
    alone = cost.step_for([(1, 2000)])
    assert step.memory_s < 2 * alone.memory_s


def test_spec_worked_example_decode_and_mixed_batch():
    """inference-optimization 8.2.2-8.2.3: a 70B model (140 GB of weights) at
    3.0 TB/s, 32 decodes: 46.7 ms memory vs 11.2 ms compute at 400 TFLOP/s;
    adding a 512-token chunk (544 tokens) at 480 TFLOP/s: 158.7 ms compute-bound."""
    cfg = ModelConfig("llama", 0, 8192, 0, 80, 1, 1, 1)  # attention shapes tiny: the example counts 2 P per token
    model = ModelCost("spec-70b", cfg, matmul_params=70_000_000_000, head_params=0,
                      weight_read_bytes=140e9, m_token=0.0)
    decode = CostModel(Hardware("spec", peak_flops=800e12, bandwidth=3.0e12, mfu=0.5, mbu=1.0,
                                fixed_overhead_s=0.0), model).step_for([(1, 0)] * 32)
    assert decode.memory_s * 1e3 == pytest.approx(46.7, abs=0.05)
    assert decode.compute_s * 1e3 == pytest.approx(11.2, abs=0.05)
    assert decode.total_s == decode.memory_s
    mixed = CostModel(Hardware("spec", peak_flops=960e12, bandwidth=3.0e12, mfu=0.5, mbu=1.0,
                               fixed_overhead_s=0.0), model).step_for([(1, 0)] * 32 + [(512, 0)])
    assert mixed.compute_s * 1e3 == pytest.approx(158.7, abs=0.1)
    assert mixed.total_s == mixed.compute_s


def test_tier_transfers_and_copy_on_write(cost):
    block = M_TOKEN_DEV * 16  # 655,360 B of one block on one device
    assert cost.transfer_time(1000, 16, "host") == pytest.approx(1000 * block / 64e9, rel=1e-12)  # 10.24 ms
    assert cost.transfer_time(1000, 16, "nvme") == pytest.approx(1000 * block / 7e9, rel=1e-12)
    assert cost.copy_time(3, 16) == pytest.approx(2 * 3 * block / (BW * MBU), rel=1e-12)
    with pytest.raises(ValueError, match="unknown link"):
        cost.transfer_time(1, 16, "floppy")


def test_calibrated_cpu_without_known_rates_is_refused():
    with pytest.raises(ValueError, match="calibrate"):
        Hardware.from_device(get_device("cpu-local"))
