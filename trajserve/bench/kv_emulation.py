"""`bench kv-agreement --emulate`: where a quantized pool's disagreement
with a float32 pool comes from.

An emulated side runs a float32 pool and the float32 C kernels, but each K/V
row it stores is first replaced by what a lossy format would give back
(rounded, or quantized and dequantized). Compute is then float32 on both
sides, so the difference is the stored rows' error alone, and the rule can
pick which rows lose precision:

    mantissa7     K and V rounded to bfloat16's 8 significant bits
    mantissa10    K and V rounded to float16's 11 (range not limited)
    q8_0          K and V through rotated q8_0 (model/kv_quant.py) and back
    q8_0-k        only K;  q8_0-v: only V
    q8_0-recent64 q8_0, but the prompt's last 64 tokens and every generated
                  token keep float32 (a window of recent tokens held at full
                  precision, as KIVI keeps its residual)
    q4_0, q4_0-recent64   likewise with rotated q4_0

This is a measuring tool: no pool format of the engine works this way.
"""
from __future__ import annotations

# torch is imported where it is used: cli.py reads EMULATIONS when it builds the parser.
EMULATIONS = ("mantissa7", "mantissa10", "q8_0", "q8_0-k", "q8_0-v", "q8_0-recent64", "q4_0", "q4_0-recent64")
RECENT = 64


def round_mantissa(x, bits: int):
    """float32 values rounded (half to even) to `bits` stored mantissa bits;
    bits = 7 gives exactly what a bfloat16 conversion gives (finite x)."""
    import torch

    i = x.float().contiguous().view(torch.int32)
    drop = 23 - bits
    half_even = (1 << (drop - 1)) - 1 + ((i >> drop) & 1)
    return ((i + half_even) & ~((1 << drop) - 1)).view(torch.float32)


def round_trip(x, name: str):
    """Rows through a quantized pool format and back, as attention reads them."""
    import torch

    from trajserve.model.kv_quant import FORMATS, load_rows, store_rows

    f = FORMATS[name]
    return load_rows(store_rows(x, f), f, x.shape[-1], torch.float32)


class EmulatedStore:
    """The C kernels with rope_store followed by the emulation's loss on the
    rows it just wrote; every other kernel is the real one (getattr)."""

    def __init__(self, kernels, emulation: str) -> None:
        if emulation not in EMULATIONS:
            raise ValueError(f"--emulate must be one of {', '.join(EMULATIONS)}, got {emulation!r}")
        self._kernels, self.emulation = kernels, emulation
        self.full_from = 1 << 62  # *-recent64: positions from here on stay float32 (set per prompt)

    def __getattr__(self, name):
        return getattr(self._kernels, name)

    def _lossy(self, x, which: str):
        e = self.emulation
        if e.startswith("mantissa"):
            return round_mantissa(x, int(e.removeprefix("mantissa")))
        fmt, _, part = e.partition("-")
        return round_trip(x, fmt) if part in ("", "recent64", which) else x

    def rope_store(self, qkv, num_heads, num_kv_heads, head_dim, cos, sin, positions, k_cache, v_cache,
                   slot_block, slot_offset) -> None:
        self._kernels.rope_store(qkv, num_heads, num_kv_heads, head_dim, cos, sin, positions, k_cache, v_cache,
                                 slot_block, slot_offset)
        lossy = positions < (self.full_from if self.emulation.endswith("-recent64") else 1 << 62)
        if not lossy.any():
            return
        blk, off = slot_block[lossy], slot_offset[lossy]
        for which, cache in (("k", k_cache), ("v", v_cache)):
            cache[blk, :, off] = self._lossy(cache[blk, :, off].contiguous(), which)


def emulated(llm, emulation: str) -> EmulatedStore:
    """Puts the emulation in `llm`'s forward (a float32 pool on the C kernels)."""
    model = llm.engine.model
    if model.kernels is None or llm.engine.kv_format.name != "float32":
        raise ValueError("--emulate needs the C kernels and a float32 pool (float32 weights on the CPU)")
    model.kernels = EmulatedStore(model.kernels, emulation)
    return model.kernels
