"""Choosing the compute/KV dtype for a device.

bfloat16 halves weight and KV bytes, but on a CPU without native bf16 matrix
instructions (AVX-512 BF16 or AMX) torch falls back to a scalar path that is
~20-40x slower than float32 (measured here on an AVX2-only EPYC: a 3072x576
linear took 8 ms in bf16 vs 0.2 ms in fp32). "auto" picks per device.
"""
from __future__ import annotations

import functools

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@functools.cache
def cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((l for l in f if l.startswith("flags")), "").split()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_dtype(name: str, device: torch.device) -> tuple[torch.dtype, str]:
    """Returns the dtype and a short reason for the start-up line."""
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES) + ['auto']}, got {name!r}")
        return DTYPES[name], "requested"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "auto: CUDA with bf16"
        return torch.float16, "auto: CUDA without bf16"
    if cpu_has_native_bf16():
        return torch.bfloat16, "auto: CPU has AVX-512 BF16/AMX"
    return torch.float32, "auto: CPU lacks native bf16 matmul (AVX2 only)"
