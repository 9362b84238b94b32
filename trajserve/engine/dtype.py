"""Choosing the compute/KV dtype and the weight format for a device.

bfloat16 halves weight and KV bytes, but on a CPU without native bf16 matrix
instructions (AVX-512 BF16 or AMX) torch falls back to a scalar path that is
~20-40x slower than float32 (measured on an AVX2-only EPYC: a 3072x576
linear took 8 ms in bf16 vs 0.2 ms in fp32). Where the CPU has them, the
float32 C kernels (model/cpu_kernels.c) still decode faster than torch's
bf16 forward: on an AVX-512 BF16 EPYC (Zen 4), SmolLM2-135M decoded 47.9 vs
20.7 tok/s at batch 1, 217 vs 152 at 16 and 373 vs 315 at 64 (a 16-agent
load: 76 s vs 136 s); only a 2,048-token prefill was faster in bf16 (649 vs
456 tok/s). With the kernels a GGUF's weights also run as stored
(resolve_quantization): on a Sapphire Rapids Xeon with AMX that decoded
197 / 607 / 683 tok/s at batch 1 / 16 / 64 against bf16's 24.7 / 262 /
526, and prefilled 2,048 tokens at 1,282 tok/s against bf16's 2,200
(docs/benchmarks.md). Agent serving is mostly decode, so "auto" on the CPU
is float32 with the kernels wherever they load, bf16 only where they do
not and the CPU has native bf16, float32 otherwise. The prefill gap closed
where AMX runs it (resolve_kv_dtype: a bf16 KV pool, attention and the
quantized products on tiles): 3,006 tok/s against bf16's 2,996 on a later,
faster host, the decode figures unchanged.
"""
from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@functools.cache
def cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((l for l in f if l.startswith("flags")), "").split()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_dtype(name: str, device: torch.device, cpu_kernels: bool = True) -> tuple[torch.dtype, str]:
    """Returns the dtype and a short reason for the start-up line.
    cpu_kernels: whether the engine may use the C kernels (--no-cpu-kernels)."""
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES) + ['auto']}, got {name!r}")
        return DTYPES[name], "requested"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "auto: CUDA with bf16"
        return torch.float16, "auto: CUDA without bf16"
    if cpu_kernels:
        from trajserve.model import cpu_kernels as kernels  # the build runs once, on first use

        if kernels.load() is not None:
            return torch.float32, "auto: the float32 C kernels decode faster than torch's bf16 on this CPU"
    if cpu_has_native_bf16():
        return torch.bfloat16, "auto: CPU has AVX-512 BF16/AMX and the C kernels are off"
    return torch.float32, "auto: CPU lacks native bf16 matmul (AVX2 only)"


def resolve_quantization(name: str, dtype: torch.dtype, device: torch.device,
                         cpu_kernels: bool = True) -> tuple[str, str]:
    """What --quantization becomes here, and why, for the start-up line.
    Block formats run only in the float32 C kernels; anywhere else a
    quantized file is dequantized at load, which an explicit format asks
    for in vain: said, not an error, so the engine still serves."""
    if name == "none":
        return "none", "requested"
    why_not = None
    if device.type != "cpu":
        why_not = f"block formats run on the CPU, not {device.type}"
    elif dtype != torch.float32:
        why_not = f"block formats run with float32 activations, not {str(dtype).removeprefix('torch.')}"
    elif not cpu_kernels:
        why_not = "--no-cpu-kernels"
    else:
        from trajserve.model import cpu_kernels as kernels

        if kernels.load() is None:
            why_not = "the C kernels did not load (see the log)"
    if why_not is not None:
        if name != "auto":
            log.warning("--quantization %s cannot run here (%s): weights dequantized to %s", name, why_not,
                        str(dtype).removeprefix("torch."))
        return "none", f"{name} -> none: {why_not}"
    return name, ("requested" if name != "auto"
                  else "block types as stored (a GGUF's, a checkpoint's MXFP4), other matrices float")


def resolve_kv_dtype(name: str, dtype: torch.dtype, kernels, head_dim: int = 64,
                     block_size: int = 16, group: int = 1):
    """What the KV pool stores (--kv-cache-dtype), a KVFormat
    (model/kv_quant.py), and why, for the start-up line. `kernels`: the
    model's CpuKernels, or None where torch runs it.

    A bfloat16 pool under float32 compute runs in the C kernels only
    (model/attention_bf16.c: K/V, queries and probabilities rounded to bf16,
    float32 sums). auto picks it where AMX tiles run its prefill for this
    head_dim and block size: a 512-token chunk's attention over 2,048 keys
    3.2x faster than the float32 kernel (docs/benchmarks.md), at half the
    bytes per token. Without AMX a bf16 chunk runs as one decode per query
    (~6x the float32 kernel's time), so auto keeps float32 there; asked for
    explicitly it runs. q8_0 and q4_0 run under any compute dtype (the C
    kernels and torch's attention dequantize the rows they read; with AMX,
    and `group` query heads per kv head up to 16, the C kernels read them as
    bf16 on the bf16 pool's tiles) for a head_dim that is a multiple of 32;
    auto never picks them: they trade quality for capacity, the user's call
    (as llama.cpp's --cache-type-k/v and vLLM's --kv-cache-dtype fp8)."""
    from trajserve.model.kv_quant import FORMATS

    if name == "auto":
        if dtype == torch.float32 and kernels is not None and kernels.amx_attention(head_dim, block_size):
            return FORMATS["bfloat16"], "auto: AMX tiles run the prefill attention on bf16 K/V"
        return FORMATS[str(dtype).removeprefix("torch.")], "auto: as the compute dtype"
    if name not in FORMATS:
        raise ValueError(f"kv_cache_dtype (--kv-cache-dtype) must be one of auto, {', '.join(FORMATS)}, got {name!r}")
    fmt = FORMATS[name]
    if fmt.quantized:
        fmt.row_elems(head_dim)  # a ValueError naming the field for a head_dim it cannot group
        if kernels is None or dtype != torch.float32:
            return fmt, "requested: rows dequantized as read in torch's attention"
        if kernels.amx_quantized(head_dim, group):
            return fmt, "requested: rows read as bf16 by the C kernels' attention on AMX tiles"
        return fmt, "requested: rows dequantized as read in the C kernels' attention"
    if fmt.storage == dtype:
        return fmt, "requested"
    if dtype == torch.float32 and fmt.storage == torch.bfloat16:
        if kernels is None:
            raise ValueError("kv_cache_dtype (--kv-cache-dtype) bfloat16 under float32 compute runs in the C "
                             "kernels, which are off here (--no-cpu-kernels, no compiler, an unsupported "
                             "head_dim, or not a CPU): use --kv-cache-dtype float32 or --dtype bfloat16")
        fast = kernels.amx_attention(head_dim, block_size)
        return fmt, "requested" + ("" if fast else " (no AMX tiles for it here: a prefill chunk runs as decodes, "
                                                    "slower)")
    raise ValueError(f"kv_cache_dtype (--kv-cache-dtype) {name} cannot run under --dtype "
                     f"{str(dtype).removeprefix('torch.')}: the pool stores the compute dtype, q8_0 or q4_0, or, "
                     f"under float32 with the C kernels, bfloat16")
