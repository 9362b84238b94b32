"""Which builds of the C kernels (cpu_kernels.py) this CPU can run.

The CPU's flags as the kernel reports them in /proc/cpuinfo (Linux lists
AVX-512 only where the OS saves its registers) and torch's own cpuid +
xgetbv probe must both allow a build: a build the CPU cannot run is never
loaded.
"""
from __future__ import annotations

import torch

# /proc/cpuinfo flags each build needs.
ISA_NEEDS = {"avx2": ("avx2", "fma", "f16c"),
             "avx512": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni")}


def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((l for l in f if l.startswith("flags")), "").split())
    except OSError:
        return frozenset()


def supported_isas() -> list[str]:
    """The builds this CPU can run, best first."""
    capability = torch.backends.cpu.get_cpu_capability()  # torch's cpuid + xgetbv probe
    if capability not in ("AVX2", "AVX512"):
        return []
    flags = cpu_flags()
    isas = [isa for isa in ("avx512", "avx2") if all(f in flags for f in ISA_NEEDS[isa])]
    return [isa for isa in isas if isa != "avx512" or capability == "AVX512"]
