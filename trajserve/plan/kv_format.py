"""Storage formats for KV (and weights): bytes per stored value, scales included.

Block formats keep one 2-byte scale per group of 32 values, so q8_0 stores
34 bytes and q4_0 18 bytes where BF16 stores 64 (inference-optimization
8.4.2): the scale is the reason q8_0 is 8.5 bits per value, not 8.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from trajserve.config import ModelConfig


@dataclass(frozen=True, slots=True)
class StorageFormat:
    name: str
    group: int          # values per group sharing one scale (1: no scale)
    code_bytes: Fraction  # bytes of codes per group
    scale_bytes: int    # bytes of scale/metadata per group

    @property
    def bytes_per_value(self) -> Fraction:
        return (self.code_bytes + self.scale_bytes) / self.group

    @property
    def bits_per_value(self) -> float:
        return float(self.bytes_per_value * 8)


FORMATS: dict[str, StorageFormat] = {
    "fp32": StorageFormat("fp32", 1, Fraction(4), 0),
    "bf16": StorageFormat("bf16", 1, Fraction(2), 0),
    "fp16": StorageFormat("fp16", 1, Fraction(2), 0),
    # Per-tensor FP8 scales are a few bytes per layer: negligible, not counted.
    "fp8": StorageFormat("fp8", 1, Fraction(1), 0),
    "q8_0": StorageFormat("q8_0", 32, Fraction(32), 2),  # 34/64 of BF16 (8.4.2)
    "q4_0": StorageFormat("q4_0", 32, Fraction(16), 2),  # 18/64 of BF16 (8.4.2)
    "q4_1": StorageFormat("q4_1", 32, Fraction(16), 4),  # a scale and a minimum: GGUF weights
    # K-quant super-blocks of 256: d, dmin (fp16) and 8 x (6-bit scale, 6-bit min) in 12 bytes
    "q4_k": StorageFormat("q4_k", 256, Fraction(128), 16),
    # as q4_k, and each code's fifth bit (32 bytes a super-block)
    "q5_k": StorageFormat("q5_k", 256, Fraction(160), 16),
    # 6-bit codes (4 low bits, 2 high) of 256 values, 16 int8 scales, an fp16 d
    "q6_k": StorageFormat("q6_k", 256, Fraction(192), 18),
    # 4-bit e2m1 codes of 32 values and one e8m0 (power-of-two) scale byte: gpt-oss's experts
    "mxfp4": StorageFormat("mxfp4", 32, Fraction(16), 1),
}
_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32",
            "float8": "fp8", "fp8_e4m3": "fp8", "e4m3": "fp8", "q8": "q8_0", "q4": "q4_0"}


def storage_format(name: str, what: str = "dtype") -> StorageFormat:
    key = _ALIASES.get(name.strip().lower(), name.strip().lower())
    if key not in FORMATS:
        raise ValueError(f"unknown {what} {name!r}; allowed: {', '.join(FORMATS)}")
    return FORMATS[key]


def m_token(model: ModelConfig, fmt: StorageFormat | str = "bf16") -> float:
    """Bytes of K and V per token over all layers:
    m_token = 2 * L * H_kv * d_head * b   (eq. 1, kv-cache-management).

    ModelConfig.kv_bytes_per_token is eq. 1 for whole-byte elements; a block
    format's b is fractional (34/32 bytes for q8_0), so eq. 1 is evaluated
    with b = 1 and scaled, which keeps one implementation of the formula.
    """
    f = storage_format(fmt) if isinstance(fmt, str) else fmt
    value = model.kv_bytes_per_token(1) * f.bytes_per_value
    return int(value) if value.denominator == 1 else float(value)


def read_time_saving(delta_bytes: float, bandwidth: float, convert_time: float) -> float:
    """Net time saved by reading a compressed KV: dT = dD / beta - T_c
    (inference-optimization 8.4.2). Negative: the conversion costs more
    than the smaller read saves."""
    return delta_bytes / bandwidth - convert_time
