"""The load-time check of the LoRA kernel's AVX512-BF16 path
(cpu_kernels.c lora_tile_dp), run by cpu_kernels.load() on a CpuKernels
(passed in: this module imports nothing of the kernels')."""
from __future__ import annotations

import numpy as np
import torch


def _lora_rows_call(k, x: torch.Tensor, order: torch.Tensor, slot: torch.Tensor, scale: torch.Tensor,
                   words: np.ndarray, r_max: int, overwrite: bool, dp: bool) -> int:
    return k.lib.ts_lora_rows(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), order.data_ptr(), slot.data_ptr(),
                              scale.data_ptr(), words.ctypes.data, words.shape[0], r_max, int(overwrite), int(dp),
                              k.threads())


def lora_dp_usable(k, flags: frozenset[str]) -> bool:
    """Whether bf16 adapters' products run on AVX512-BF16 (cpu_kernels.c
    lora_tile_dp): an avx512 build, the flag in /proc/cpuinfo, and rows of
    two slots (ranks 16 and 6, an input and outputs off the 32- and
    16-blocks) within bf16 rounding of the vector path, each row the same
    bits whichever rows share its call."""
    if k.isa != "avx512" or "avx512_bf16" not in flags:
        return False
    g = torch.Generator().manual_seed(5)
    fan_in, fan_out, r_max, m = 100, 40, 16, 7
    a = (torch.randn(2, r_max, fan_in, generator=g) / 10).bfloat16()
    bt = (torch.randn(2, -(-fan_out // 16), r_max, 16, generator=g) / 10).bfloat16()
    a[1, 6:], bt[1, :, 6:] = 0, 0
    rank = torch.tensor([16, 6], dtype=torch.int32)
    scale = torch.tensor([0.5, 2.0])
    x = torch.randn(m, fan_in, generator=g)
    slot = torch.tensor([0, 1, -1, 0, 0, 1, 0], dtype=torch.int32)

    def run(rows: torch.Tensor, dp: bool) -> torch.Tensor:
        y = torch.full((m, fan_out), 7.0)
        words = np.array([[0, 0, 0, a.data_ptr(), bt.data_ptr(), rank.data_ptr(), fan_out, y.data_ptr(), fan_out]],
                         dtype=np.int64)
        _lora_rows_call(k, x, torch.sort(rows, stable=True).indices.to(torch.int32), rows, scale, words, r_max,
                       False, dp)
        return y
    want, got = run(slot, False), run(slot, True)
    alone = run(torch.tensor([0, -1, -1, -1, -1, -1, -1], dtype=torch.int32), True)
    return bool(torch.allclose(got, want, rtol=0.02, atol=0.02) and torch.equal(got[slot < 0], want[slot < 0])
                and torch.equal(alone[0], got[0]) and not torch.equal(got, want))
