"""The KV pool's storage formats, and q8_0 / q4_0 rows in torch.

A pool stores K and V of each (block, kv head, token) as one row of
head_dim values. float32 and bfloat16 rows are the values; a quantized row
is head_dim / 32 groups of 32 values, each group one scale (float16) and
its codes, laid out as

    codes of every group | the groups' float16 scales

    q8_0: 32 signed bytes a group, x ~= d * q, d = amax / 127, q = round(x / d)
          (half to even): head_dim + head_dim / 16 bytes a row (68 for 64)
    q4_0: 16 bytes a group, byte j holding values j (low nibble) and j + 16
          (high), x ~= d * (q - 8), d = max / -8 where max is the value of
          largest magnitude (the first such), q = min(15, trunc(x / d + 8.5)):
          head_dim / 2 + head_dim / 16 bytes a row (36 for 64)

the formats of llama.cpp's --cache-type-k/v (inference-optimization 8.4.2:
34 and 18 bytes per 32 values), with the codes of a row contiguous so a
kernel reads them as one run. The bytes per token of every format come from
one definition, trajserve.plan.kv_format (eq. 1 with its bytes per value).

Quantizing here (torch) and in the C kernels (cpu_kernels.c ts_rope_store)
gives the same bytes: the same float32 operations in the same order (the
scale computed once in float32, then rounded to float16 to be stored; the
codes from the unrounded scale's reciprocal, as llama.cpp does), tested.
A dequantized value, code x float16 scale, is exact in float32, so every
kernel that reads a row sees the same K and V.

Rotated groups. A quantized row holds the codes of H x, not of x: each
group of 32 values goes through the (unnormalized) Walsh-Hadamard transform
H before it is quantized (QuaRot's and SpinQuant's observation: K carries
a few channels far larger than the rest, and one such channel sets a
group's scale and the other 31 values get a coarse grid; rotated, the
group's energy is spread over all 32 and its largest value is close to its
root mean square). H is symmetric with H H = 32 I, so attention never
rotates a key or a value back: q . k = (H q) . (H k) / 32 per group, and
sum_i p_i v_i = H (sum_i p_i H v_i) / 32. The kernels rotate the query once
and the output once (kv_rows.h), the torch path rotates the rows it
gathers back (load_rows). H's butterfly is additions and subtractions only,
the same float32 operations in C and torch, and / 32 is exact, so the bytes
and the values stay identical between the two. Measured on the embedded
model (bench kv-agreement, docs/benchmarks.md): q8_0's mean KL against a
float32 pool fell 2.2x (0.00033 to 0.00015) and its largest 4.7x; q4_0's
mean KL 2.3x. (Its count of whole 64-token greedy continuations did not
follow: 13 of 16 before, 12 after, every divergence at a near tie.)
Groups of 32 rather than the whole head: the rotation then matches the
quantization group (any head_dim the format takes), and a 64-wide one
measured no better (torch path: mean KL 0.000166 vs 0.000154).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from trajserve.model.formats import CODES

GROUP = 32
MAX_HEAD_DIM = 256  # the C kernels rotate a row in a buffer of this many values


@dataclass(frozen=True, slots=True)
class KVFormat:
    name: str  # --kv-cache-dtype's value
    storage: torch.dtype  # the pool tensor's dtype
    plan_name: str  # trajserve.plan.kv_format's name for its bytes per value
    code: int  # the C kernels' format code (formats.h)

    @property
    def quantized(self) -> bool:
        return self.storage == torch.uint8

    @property
    def disk_name(self) -> str:
        """The name a disk block's header gives its rows (kv/tiers.py):
        quantized rows say they hold rotated groups, so a block written before
        rows were rotated is refused as another layout, never read as one."""
        return f"{self.name}+h{GROUP}" if self.quantized else self.name

    def row_elems(self, head_dim: int) -> int:
        """The pool's last dimension: values, or bytes of a quantized row."""
        if not self.quantized:
            return head_dim
        if head_dim % GROUP or head_dim > MAX_HEAD_DIM:
            raise ValueError(f"kv_cache_dtype (--kv-cache-dtype) {self.name} needs head_dim a multiple of {GROUP} "
                             f"up to {MAX_HEAD_DIM}, this model's is {head_dim}")
        return (head_dim if self.name == "q8_0" else head_dim // 2) + head_dim // GROUP * 2

    def bytes_per_token(self, model) -> int:
        """m_token (eq. 1) in this format: trajserve.plan.kv_format's one definition."""
        from trajserve.plan.kv_format import m_token, storage_format

        value = m_token(model, storage_format(self.plan_name))
        if value != int(value):
            raise ValueError(f"{self.name} KV needs head_dim a multiple of {GROUP}")
        return int(value)


FORMATS: dict[str, KVFormat] = {
    "float32": KVFormat("float32", torch.float32, "fp32", CODES["float32"]),
    "bfloat16": KVFormat("bfloat16", torch.bfloat16, "bf16", CODES["bfloat16"]),
    "q8_0": KVFormat("q8_0", torch.uint8, "q8_0", CODES["q8_0"]),
    "q4_0": KVFormat("q4_0", torch.uint8, "q4_0", CODES["q4_0"]),
}


def kv_format(name_or_dtype: str | torch.dtype) -> KVFormat:
    if isinstance(name_or_dtype, torch.dtype):
        name_or_dtype = str(name_or_dtype).removeprefix("torch.")
    return FORMATS[name_or_dtype]


def pool_format(cache: torch.Tensor, head_dim: int) -> KVFormat:
    """A pool tensor's format: its dtype, and for bytes its row length."""
    if cache.dtype != torch.uint8:
        return kv_format(cache.dtype)
    for f in (FORMATS["q8_0"], FORMATS["q4_0"]):
        if head_dim % GROUP == 0 and cache.shape[-1] == f.row_elems(head_dim):
            return f
    raise ValueError(f"a uint8 KV pool with rows of {cache.shape[-1]} bytes is neither q8_0 nor q4_0 "
                     f"for head_dim {head_dim}")


def rotate(x: torch.Tensor) -> torch.Tensor:
    """H x for each group of 32 values along the last dimension (unnormalized
    Walsh-Hadamard: H H = 32 I), as kv_rows.h's rotate32 computes it:
    five butterfly stages, pairs (j, j + h) in runs of 2 h becoming
    (a + b, a - b)."""
    y = x.float().reshape(-1, GROUP)
    h = 1
    while h < GROUP:
        y = y.view(-1, GROUP // (2 * h), 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack((a + b, a - b), 2)
        h *= 2
    return y.reshape(x.shape)


def _scales_bytes(d: torch.Tensor) -> torch.Tensor:
    """float32 scales [..., g] -> their float16 bytes [..., 2 g]."""
    return d.to(torch.float16).view(torch.uint8).reshape(*d.shape[:-1], -1)


def _scales(row: torch.Tensor, start: int, groups: int) -> torch.Tensor:
    """The float16 scales of rows [..., bytes] as float32 [..., groups, 1]."""
    raw = row[..., start:start + 2 * groups].contiguous()
    return raw.view(torch.float16).float().reshape(*row.shape[:-1], groups, 1)


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """[..., d] float -> [..., d + d / 16] bytes."""
    x = x.float()
    g = x.reshape(*x.shape[:-1], -1, GROUP)
    d = g.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(g * inv).clamp_(-127, 127).to(torch.int8).view(torch.uint8)
    return torch.cat([q.reshape(*x.shape), _scales_bytes(d.squeeze(-1))], -1)


def quantize_q4_0(x: torch.Tensor) -> torch.Tensor:
    """[..., d] float -> [..., d / 2 + d / 16] bytes."""
    x = x.float()
    g = x.reshape(*x.shape[:-1], -1, GROUP)
    peak = g.gather(-1, g.abs().argmax(-1, keepdim=True))  # the first value of largest magnitude, with its sign
    d = peak / -8.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.trunc(g * inv + 8.5).clamp_(0, 15).to(torch.uint8)  # g * inv + 8.5 >= 0.5: trunc is floor
    packed = q[..., :GROUP // 2] | (q[..., GROUP // 2:] << 4)
    return torch.cat([packed.reshape(*x.shape[:-1], -1), _scales_bytes(d.squeeze(-1))], -1)


def dequantize_q8_0(row: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[..., d + d / 16] bytes -> [..., d] float32."""
    groups = head_dim // GROUP
    q = row[..., :head_dim].contiguous().view(torch.int8).float().reshape(*row.shape[:-1], groups, GROUP)
    return (q * _scales(row, head_dim, groups)).reshape(*row.shape[:-1], head_dim)


def dequantize_q4_0(row: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[..., d / 2 + d / 16] bytes -> [..., d] float32."""
    groups = head_dim // GROUP
    packed = row[..., :head_dim // 2].reshape(*row.shape[:-1], groups, GROUP // 2)
    q = torch.cat([packed & 0x0F, packed >> 4], -1).float() - 8.0
    return (q * _scales(row, head_dim // 2, groups)).reshape(*row.shape[:-1], head_dim)


_QUANTIZE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"q8_0": quantize_q8_0, "q4_0": quantize_q4_0}
_DEQUANTIZE = {"q8_0": dequantize_q8_0, "q4_0": dequantize_q4_0}


def store_rows(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """Values as the pool stores them (a quantized row: the codes of H x)."""
    return _QUANTIZE[fmt.name](rotate(x)) if fmt.quantized else x.to(fmt.storage)


def load_rows(rows: torch.Tensor, fmt: KVFormat, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Pool rows as values of `dtype` (a quantized row rotated back: H y / 32)."""
    if not fmt.quantized:
        return rows.to(dtype)
    return (rotate(_DEQUANTIZE[fmt.name](rows, head_dim)) * (1.0 / GROUP)).to(dtype)
