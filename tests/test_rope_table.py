"""The RoPE table is the same in every process: numpy's float64 cos / sin of
HF's float32 angles, rounded once. torch's float32 cos at start-up gave a
wrong half table in some processes (trajserve/model/rope.py)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import torch

from trajserve.model.rope import cos_sin_table, inv_frequencies


def test_table_is_the_correctly_rounded_cos_and_sin_of_hfs_angles():
    cos, sin = cos_sin_table(64, 4096, 100000.0, None, "cpu")
    inv = inv_frequencies(64, 100000.0, None).float()
    angles = torch.outer(torch.arange(4096, dtype=torch.float32), inv).double()  # HF's float32 products
    angles = torch.cat([angles, angles], -1).numpy()
    assert np.array_equal(cos.numpy(), np.cos(angles).astype(np.float32))
    assert np.array_equal(sin.numpy(), np.sin(angles).astype(np.float32))
    # Against torch's own float32 cos (what HF computes): within an ulp or two.
    assert torch.allclose(cos, torch.from_numpy(angles).float().cos(), rtol=0, atol=3e-7)


def test_the_engines_table_is_the_same_in_separate_processes():
    """Three processes build the embedded model; their tables hash the same
    (before the fix, about 3 in 10 processes had a wrong half)."""
    code = ("import hashlib, torch\n"
            "torch.set_num_threads(2)\n"
            "from trajserve.config import CacheConfig, EngineConfig\n"
            "from trajserve.engine.engine import LLMEngine\n"
            "e = LLMEngine(EngineConfig(dtype='float32', quantization='none', "
            "cache=CacheConfig(num_blocks=16, kv_cache_dtype='float32')))\n"
            "print(hashlib.sha256(e.model.cos.numpy().tobytes() + e.model.sin.numpy().tobytes()).hexdigest())\n")
    hashes = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             timeout=300).stdout.split()[-1] for _ in range(3)}
    cos, sin = cos_sin_table(64, 8192, 100000.0, None, "cpu")
    import hashlib
    assert hashes == {hashlib.sha256(cos.numpy().tobytes() + sin.numpy().tobytes()).hexdigest()}
