"""`bench kv-agreement --emulate` and `--json`'s teacher-forced counts:
the emulated stores put exactly the loss they name into exactly the rows
they name, and the bench's per-position counts agree with its rows."""
from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch

from trajserve.bench.kv_emulation import EMULATIONS, EmulatedStore, round_mantissa
from trajserve.model.kv_quant import FORMATS, load_rows, store_rows


def test_seven_mantissa_bits_are_bfloat16s_rounding_ties_included():
    x = torch.randn(4096) * torch.logspace(-6, 6, 4096)
    # values halfway between two bfloat16 numbers, with an even and an odd last kept bit
    ties = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x40418000], dtype=np.uint32).view(np.float32)
    x = torch.cat([x, torch.from_numpy(ties)])
    assert torch.equal(round_mantissa(x, 7), x.bfloat16().float())
    small = torch.randn(4096)  # within float16's range and normal: float16's own rounding
    assert torch.equal(round_mantissa(small[small.abs() > 1e-4], 10), small[small.abs() > 1e-4].half().float())


class _Kernels:
    """Stands in for the C kernels: rope_store writes the given rows."""

    def __init__(self, rows):
        self.rows, self.other = rows, "real"

    def rope_store(self, qkv, nh, nkv, hd, cos, sin, positions, k_cache, v_cache, slot_block, slot_offset):
        k_cache[slot_block, :, slot_offset] = self.rows
        v_cache[slot_block, :, slot_offset] = -self.rows


@pytest.mark.parametrize("emulation", EMULATIONS)
def test_each_emulation_changes_exactly_the_rows_it_names(emulation):
    torch.manual_seed(0)
    T, kvh, d = 6, 2, 64
    rows = torch.randn(T, kvh, d) * 3
    k_cache, v_cache = torch.zeros(4, kvh, 16, d), torch.zeros(4, kvh, 16, d)
    blocks, offsets, positions = torch.tensor([1, 1, 1, 2, 2, 3]), torch.tensor([0, 5, 15, 0, 9, 3]), torch.arange(T)
    store = EmulatedStore(_Kernels(rows), emulation)
    store.full_from = 4  # the -recent64 ones: positions 4 and 5 stay float32
    assert store.other == "real"  # every other kernel is the real one's
    store.rope_store(None, 0, kvh, d, None, None, positions, k_cache, v_cache, blocks, offsets)
    k, v = k_cache[blocks, :, offsets], v_cache[blocks, :, offsets]
    f = FORMATS[emulation.partition("-")[0]] if emulation[0] == "q" else None

    def rt(x):  # the format's round trip, written out here
        return load_rows(store_rows(x, f), f, d, torch.float32)

    if emulation.startswith("mantissa"):
        bits = int(emulation.removeprefix("mantissa"))
        assert torch.equal(k, round_mantissa(rows, bits)) and torch.equal(v, round_mantissa(-rows, bits))
        assert not torch.equal(k, rows)
    elif emulation.endswith("-recent64"):
        assert torch.equal(k[:4], rt(rows[:4])) and torch.equal(v[:4], rt(-rows[:4]))
        assert torch.equal(k[4:], rows[4:]) and torch.equal(v[4:], -rows[4:])
    else:
        assert torch.equal(k, rt(rows) if not emulation.endswith("-v") else rows)
        assert torch.equal(v, rt(-rows) if not emulation.endswith("-k") else -rows)
    assert not torch.equal(k, rows) or not torch.equal(v, -rows)
    assert k_cache[0].abs().sum() == 0 and v_cache[0].abs().sum() == 0  # no other slot written
    with pytest.raises(ValueError, match="--emulate must be one of"):
        EmulatedStore(_Kernels(rows), "q4_1")


def test_kv_agreement_emulated_and_its_teacher_forced_counts(capsys):
    """On the 200-token prompt: float16-like rows disagree with float32 by a
    KL far under rotated q8_0's (the two are the ends of the study in
    docs/benchmarks.md); the teacher-forced counts match the positions the
    bench scored, and float32's prefill picks its own decode's tokens."""
    from trajserve.bench.kv_agreement import TOKENS, run

    def bench(emulation):
        assert run(argparse.Namespace(model=None, kv_cache_dtype="q8_0", quantization="none", prompts=1,
                                      num_blocks=64, emulate=emulation, json=True)) == 0
        return json.loads(capsys.readouterr().out)

    fine, q8 = bench("mantissa10"), bench("q8_0")
    assert fine["emulation"] == "mantissa10" and fine["kv_dtype"] == "float32"
    assert fine["summary"]["mean_kl"] * 10 < q8["summary"]["mean_kl"] < 0.01
    for out in (fine, q8):
        s, (r,) = out["summary"], out["rows"]
        assert s["forced_positions"] == TOKENS and s["forced_flip_rate"] == r["forced_flips"] / TOKENS
        assert len(r["forced_flip_gaps"]) == r["forced_flips"] and all(g >= 0 for g in r["forced_flip_gaps"])
        # where the continuations first part, both sides scored the same tokens before: a teacher-forced flip
        assert r["identical_tokens"] == TOKENS or r["forced_flips"] >= 1
        assert s["float32_self_flips"] == 0
        assert s["expected_share_identical_for_64"] == pytest.approx((1 - s["forced_flip_rate"]) ** TOKENS)


def test_emulation_needs_a_float32_pool_on_the_c_kernels():
    from types import SimpleNamespace

    from trajserve.bench.kv_emulation import emulated

    for kernels, pool in ((None, "float32"), (object(), "q8_0")):
        llm = SimpleNamespace(engine=SimpleNamespace(model=SimpleNamespace(kernels=kernels),
                                                     kv_format=SimpleNamespace(name=pool)))
        with pytest.raises(ValueError, match="--emulate needs the C kernels and a float32 pool"):
            emulated(llm, "q8_0")
