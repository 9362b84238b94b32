"""Quantized weight matrices, kept in GGUF's own block formats (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, MXFP4).

A QuantizedWeight is the bytes of a GGUF tensor of one of those types, row by
row ([n, k / group * group bytes]): the C kernels (quant_kernels.c) multiply
by it directly, so a Q4_1 model reads 0.625 bytes a weight per decode step
instead of float32's 4 (inference-optimization 8.2.1, 8.4.1). Group sizes and
bytes come from the one table of storage formats (plan/kv_format.py) the
planner and simulator price weights and KV with.

`quantize` and `dequantize` use the gguf package's reference implementations,
so a float checkpoint quantized here holds the bytes llama.cpp's tools would
write (gguf has no K-quant quantizer: Q4_K, Q5_K and Q6_K come from GGUF files as stored);
`reference_product` is the float64 product the kernels are tested against.
"""
from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import torch

from trajserve.config import QUANTIZATIONS
from trajserve.plan.kv_format import FORMATS

QK = 32  # values per block
PANEL = 16  # weight rows per packed panel, float (cpu_kernels.pack) and quantized (pack_panels)
QK_K = 256  # values per K-quant super-block
GGML_TYPES = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
              "q4_1": gguf.GGMLQuantizationType.Q4_1, "q4_k": gguf.GGMLQuantizationType.Q4_K,
              "q5_k": gguf.GGMLQuantizationType.Q5_K, "q6_k": gguf.GGMLQuantizationType.Q6_K,
              "mxfp4": gguf.GGMLQuantizationType.MXFP4}
STORED_FORMATS = tuple(GGML_TYPES)  # what the kernels run as stored
QUANT_FORMATS = ("q8_0", "q4_0", "q4_1")  # what a float matrix can be quantized to here (--quantization)


def group_size(fmt: str) -> int:
    """Values per group (block or super-block) of the format: a row's width must be a multiple."""
    return FORMATS[fmt].group


def block_bytes(fmt: str) -> int:
    """Bytes of one group of the format (34 for a q8_0 block, 144 for a q4_k super-block)."""
    f = FORMATS[fmt]
    return int(f.code_bytes + f.scale_bytes)


def row_bytes(fmt: str, k: int) -> int:
    return k // group_size(fmt) * block_bytes(fmt)


@dataclass(eq=False)
class QuantizedWeight:
    data: torch.Tensor  # uint8 [n, row_bytes(fmt, k)], contiguous
    fmt: str
    shape: tuple[int, int]  # (n, k): out and in features

    def __post_init__(self) -> None:
        n, k = self.shape
        if self.fmt not in GGML_TYPES:
            raise ValueError(f"unsupported quantized format {self.fmt!r}; supported: {', '.join(STORED_FORMATS)}")
        if k % group_size(self.fmt):
            raise ValueError(f"a {self.fmt} row needs a multiple of {group_size(self.fmt)} values, got {k}")
        want = (n, row_bytes(self.fmt, k))
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != want or not self.data.is_contiguous():
            raise ValueError(f"{self.fmt} weight {self.shape}: expected contiguous uint8 bytes {want}, "
                             f"got {self.data.dtype} {tuple(self.data.shape)}")

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @classmethod
    def from_gguf(cls, raw: np.ndarray, fmt: str, shape: tuple[int, int]) -> QuantizedWeight:
        """A GGUF tensor's bytes ([n, row bytes], maybe a read-only mmap view)."""
        return cls(torch.from_numpy(np.require(raw, dtype=np.uint8, requirements=["C", "W"])), fmt, shape)

    @classmethod
    def quantize(cls, w: torch.Tensor | np.ndarray, fmt: str) -> QuantizedWeight:
        if fmt not in QUANT_FORMATS:
            kept = ", ".join(f for f in STORED_FORMATS if f not in QUANT_FORMATS)
            raise ValueError(f"cannot quantize to {fmt!r}; supported: {', '.join(QUANT_FORMATS)} "
                             f"({kept} run only as a GGUF file stores them)")
        a = w.detach().float().cpu().numpy() if isinstance(w, torch.Tensor) else np.asarray(w, np.float32)
        if a.ndim != 2 or a.shape[1] % QK:
            raise ValueError(f"a {fmt} matrix needs rows of a multiple of {QK} values, got shape {a.shape}")
        return cls.from_gguf(gguf.quants.quantize(a, GGML_TYPES[fmt]), fmt, tuple(a.shape))

    def dequantize(self) -> torch.Tensor:
        flat = gguf.quants.dequantize(self.data.numpy(), GGML_TYPES[self.fmt])
        return torch.from_numpy(np.ascontiguousarray(flat.reshape(self.shape), dtype=np.float32))

    @classmethod
    def cat(cls, parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Rows of several matrices of one format and width (fused q|k|v)."""
        fmt, k = parts[0].fmt, parts[0].shape[1]
        if any(p.fmt != fmt or p.shape[1] != k for p in parts):
            raise ValueError("only matrices of one format and width concatenate: "
                             + ", ".join(f"{p.fmt} {p.shape}" for p in parts))
        return cls(torch.cat([p.data for p in parts]), fmt, (sum(p.shape[0] for p in parts), k))

    @classmethod
    def random_blocks(cls, fmt: str, n: int, k: int, rng: np.random.Generator) -> QuantizedWeight:
        """Valid bytes of a stored format with every code, scale and minimum
        random and the block scales small (finite fp16 d and dmin, MXFP4 scales
        2^-10 .. 2^-3): the inputs the load-time path checks multiply, where no
        quantizer exists here for the K-quants."""
        rows = rng.integers(0, 256, size=(n, k // group_size(fmt), block_bytes(fmt)), dtype=np.uint8)
        small = lambda top: (rng.random((n, k // group_size(fmt), 1)) * top).astype(np.float16).view(np.uint8)
        if fmt in ("q4_k", "q5_k"):  # d, dmin first
            rows[..., 0:2], rows[..., 2:4] = small(1e-3), small(2e-3)
        elif fmt == "q6_k":  # d last
            rows[..., -2:] = small(1e-3)
        elif fmt == "mxfp4":  # the e8m0 exponent byte first
            rows[..., 0] = rng.integers(117, 125, size=rows.shape[:2], dtype=np.uint8)
        else:  # Q8_0 / Q4_0 / Q4_1: fp16 d (and m) first
            rows[..., 0:2] = small(1e-2)
            if fmt == "q4_1":
                rows[..., 2:4] = small(1e-2)
        return cls(torch.from_numpy(np.ascontiguousarray(rows.reshape(n, -1))), fmt, (n, k))

    def pack(self) -> QuantizedPanels:
        """The layout the kernels multiply by (quant_kernels.c, "Panel layout")."""
        return QuantizedPanels(pack_panels(self), self.fmt, self.shape)

    def reference_product(self, x: torch.Tensor, quantize_input: bool = True) -> torch.Tensor:
        """x @ W^T in float64 over the dequantized weights, with x first
        quantized to 8-bit blocks as the kernels do (quantize_input) or not."""
        xs = quantize_input_rows(x.float().numpy()) if quantize_input else x.double().numpy()
        return torch.from_numpy(xs.astype(np.float64) @ self.dequantize().double().numpy().T).float()


@dataclass(eq=False)
class QuantizedPanels:
    """A QuantizedWeight repacked into panels of PANEL rows: the same bytes
    per weight (rows padded to a multiple of PANEL), laid out so that one
    vector instruction multiplies 16 rows by 4 input values."""
    data: torch.Tensor  # uint8 [ceil(n / 16), k // 32 * panel_block_bytes(fmt)]
    fmt: str
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def panel_block_bytes(fmt: str) -> int:
    """One block of 32 values of 16 rows: fp16 scales (and minimums) then
    codes; q4_k: its 6-bit scales and minimums as bytes then codes, with the
    super-block's d and -dmin (64 bytes) before every 8 blocks; q5_k: q4_k's
    block and the codes' fifth bits (64 bytes); q6_k: two int8 scales
    (values 0-15, 16-31), the codes' low 4 bits, their high 2 bits, with the
    super-block's d (32 bytes) before every 8 blocks; mxfp4: float32 scales
    2^(e - 128) (no fp16 holds every one), then the raw 4-bit codes."""
    return {"q8_0": 32 + 512, "q4_0": 32 + 256, "q4_1": 64 + 256, "q4_k": 32 + 256 + 64 // 8,
            "q5_k": 32 + 256 + 64 + 64 // 8, "q6_k": 32 + 256 + 128 + 32 // 8, "mxfp4": 64 + 256}[fmt]


def _nibble_codes(u: np.ndarray, panels: int, nb: int) -> np.ndarray:
    """4-bit codes [panels * 16, nb, 32] in the kernels' groups: group g holds
    values 4g..4g+3 in the low nibbles and 16+4g.. in the high ones."""
    u = u.reshape(panels, PANEL, nb, QK)
    lo = u[..., :16].reshape(panels, PANEL, nb, 4, 4)
    hi = u[..., 16:].reshape(panels, PANEL, nb, 4, 4)
    return (lo | (hi << np.uint8(4))).transpose(0, 2, 3, 1, 4).reshape(panels, nb, -1)


def _by_panel(a: np.ndarray, panels: int, nb: int) -> np.ndarray:
    """[panels * 16, nb, b] per-row bytes -> [panels, nb, 16 * b]: each block's 16 rows together."""
    b = a.shape[-1]
    return a.reshape(panels, PANEL, nb, b).transpose(0, 2, 1, 3).reshape(panels, nb, PANEL * b)


def q4_k_fields(raw: np.ndarray) -> tuple[np.ndarray, ...]:
    """Q4_K super-blocks [..., 144] -> d, dmin (fp16 bytes [..., 2] each), the
    8 sub-blocks' 6-bit scales and minimums [..., 8] and the 256 codes in
    element order [..., 256] (ggml's layout, as gguf's dequantize reads it)."""
    d, dmin, sc, qs = raw[..., 0:2], raw[..., 2:4], raw[..., 4:16], raw[..., 16:144]
    scales = np.concatenate([sc[..., 0:4] & 0x3F, (sc[..., 8:12] & 0x0F) | ((sc[..., 0:4] >> 6) << 4)], axis=-1)
    mins = np.concatenate([sc[..., 4:8] & 0x3F, (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)], axis=-1)
    q = qs.reshape(*qs.shape[:-1], 4, 32)  # 4 chunks of 32 bytes: sub-block 2c in the low nibbles, 2c+1 high
    codes = np.stack([q & 0x0F, q >> 4], axis=-2).reshape(*qs.shape[:-1], 256)
    return d, dmin, scales.astype(np.uint8), mins.astype(np.uint8), codes


def q5_k_fields(raw: np.ndarray) -> tuple[np.ndarray, ...]:
    """Q5_K super-blocks [..., 176] -> Q4_K's fields, the codes 0-31: the
    low 4 bits as Q4_K's (128 bytes after the 32 of high bits), the fifth
    of value l of sub-block s bit s of high byte l (ggml's layout)."""
    lead = raw.shape[:-1]
    d, dmin, scales, mins, low = q4_k_fields(np.concatenate([raw[..., 0:16], raw[..., 48:176]], axis=-1))
    qh = raw[..., 16:48].reshape(*lead, 1, 32)
    high = (qh >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1  # [..., 8 sub-blocks, 32]
    return d, dmin, scales, mins, low | (high.reshape(*lead, 256) << 4)


def q6_k_fields(raw: np.ndarray) -> tuple[np.ndarray, ...]:
    """Q6_K super-blocks [..., 210] -> d (fp16 bytes [..., 2]), the 16
    sub-blocks' int8 scales [..., 16] and the 256 codes (0-63, value + 32)
    in element order [..., 256] (ggml's layout)."""
    ql, qh, sc, d = raw[..., 0:128], raw[..., 128:192], raw[..., 192:208], raw[..., 208:210]
    lead = raw.shape[:-1]
    ql = ql.reshape(*lead, 2, 2, 32)  # [half, l / 32, l]
    qh = qh.reshape(*lead, 2, 1, 32)
    lo = np.concatenate([ql & 0x0F, ql >> 4], axis=-2)  # quarters 0..3 of a half: ql[l], ql[l+32], ql[l]>>4, ...
    hi = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=-2)
    codes = (lo | (hi << 4)).reshape(*lead, 256)
    return d, sc.view(np.int8), codes


def _pack_q6_k(w: QuantizedWeight, panels: int) -> np.ndarray:
    n, k = w.shape
    ns, nb = k // QK_K, k // QK
    raw = np.zeros((panels * PANEL, ns, 210), np.uint8)
    raw[:n] = w.data.numpy().reshape(n, ns, 210)
    d, sc, codes = q6_k_fields(raw)
    head = _by_panel(d, panels, ns)  # [panels, ns, 32]
    scales = sc.view(np.uint8).reshape(-1, nb, 2)  # a block's two sub-block scales
    codes = codes.reshape(-1, nb, QK)
    high = (codes >> 4).reshape(panels, PANEL, nb, 2, 4, 4)  # [.., half (lo / hi nibble), group, t]
    # Per group g, lane 4r + t: the high bits of value 4g + t and 16 + 4g + t
    # (the codes' low and high nibble); groups 2p and 2p + 1 share a byte.
    lane = (high[..., 0, :, :] | (high[..., 1, :, :] << 2)).transpose(0, 2, 3, 1, 4)  # [panels, nb, 4, 16, 4]
    lane = lane.reshape(panels, nb, 2, 2, 64)
    hbits = (lane[:, :, :, 0] | (lane[:, :, :, 1] << 4)).reshape(panels, nb, 128)
    sub = np.concatenate([_by_panel(scales[..., 0:1], panels, nb), _by_panel(scales[..., 1:2], panels, nb),
                          _nibble_codes(codes & 0x0F, panels, nb), hbits], axis=-1)  # [panels, nb, 416]
    return np.concatenate([head, sub.reshape(panels, ns, -1)], axis=-1).reshape(panels, -1)


def _fifth_bits(codes: np.ndarray, panels: int, nb: int) -> np.ndarray:
    """Q5_K's fifth bits [panels * 16, nb, 32] -> [panels, nb, 64]: byte
    4r + t holds, at bit g, that of value 4g + t (group g's low nibble) and,
    at bit 4 + g, that of value 16 + 4g + t (its high nibble)."""
    h = (codes >> 4).reshape(panels, PANEL, nb, 2, 4, 4)  # [.., nibble, group, t]
    g = np.arange(4, dtype=np.uint8).reshape(4, 1)
    byte = ((h[..., 0, :, :] << g) | (h[..., 1, :, :] << (g + 4))).sum(-2, dtype=np.uint8)  # [p, 16, nb, 4]
    return byte.transpose(0, 2, 1, 3).reshape(panels, nb, 64)


def _pack_q4_k(w: QuantizedWeight, panels: int) -> np.ndarray:
    """Q4_K, or Q5_K (the same and each block's fifth bits after its codes)."""
    n, k = w.shape
    ns = k // QK_K
    size = block_bytes(w.fmt)
    raw = np.zeros((panels * PANEL, ns, size), np.uint8)
    raw[:n] = w.data.numpy().reshape(n, ns, size)
    d, dmin, scales, mins, codes = (q4_k_fields if w.fmt == "q4_k" else q5_k_fields)(raw)
    neg = dmin.copy()
    neg[..., 1] ^= 0x80  # -dmin: the kernels add (-dmin * m) * s_x as Q4_1 adds m * s_x; negation is exact
    head = np.concatenate([_by_panel(d, panels, ns), _by_panel(neg, panels, ns)], axis=-1)  # [panels, ns, 64]
    nb = k // QK
    codes = codes.reshape(-1, nb, QK)
    sub = [_by_panel(scales.reshape(-1, nb, 1), panels, nb), _by_panel(mins.reshape(-1, nb, 1), panels, nb),
           _nibble_codes(codes & 0x0F, panels, nb)]  # [panels, nb, 288]
    if w.fmt == "q5_k":
        sub.append(_fifth_bits(codes, panels, nb))
    sub = np.concatenate(sub, axis=-1)
    return np.concatenate([head, sub.reshape(panels, ns, -1)], axis=-1).reshape(panels, -1)


def pack_panels(w: QuantizedWeight) -> torch.Tensor:
    n, k = w.shape
    nb, panels = k // QK, -(-n // PANEL)
    if w.fmt in ("q4_k", "q5_k", "q6_k"):
        out = np.ascontiguousarray((_pack_q6_k if w.fmt == "q6_k" else _pack_q4_k)(w, panels))
        assert out.shape[1] == nb * panel_block_bytes(w.fmt)
        return torch.from_numpy(out)
    raw = np.zeros((panels * PANEL, nb, block_bytes(w.fmt)), np.uint8)
    raw[:n] = w.data.numpy().reshape(n, nb, -1)
    d = raw[..., 0:2]
    if w.fmt == "mxfp4":  # the e8m0 byte as the float32 2^(e - 128): its value tables' codes count halves
        d = np.ldexp(np.float32(1), raw[..., 0].astype(np.int32) - 128).astype(np.float32)[..., None].view(np.uint8)
    if w.fmt == "q8_0":
        scales = [d]
        u = raw[..., 2:34] ^ np.uint8(0x80)  # int8 q -> q + 128
    else:
        scales = [d, raw[..., 2:4]] if w.fmt == "q4_1" else [d]
        qs = raw[..., -16:]
        u = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)  # element order
    # [panel, row, block, ...] -> [panel, block, ...(row inside)]
    parts = [_by_panel(s, panels, nb) for s in scales]
    if w.fmt == "q8_0":
        codes = u.reshape(panels, PANEL, nb, 8, 4).transpose(0, 2, 3, 1, 4).reshape(panels, nb, -1)
    else:
        codes = _nibble_codes(u, panels, nb)
    parts.append(codes)
    out = np.ascontiguousarray(np.concatenate(parts, axis=-1).reshape(panels, -1))
    assert out.shape[1] == nb * panel_block_bytes(w.fmt)
    return torch.from_numpy(out)


def requantize(a: torch.Tensor | np.ndarray, fmt: str, source: str, counts: dict[str, int] | None) -> QuantizedWeight:
    """a in block format fmt, counted as "source -> fmt" in `counts` (the start-up line's tally) where given."""
    if counts is not None:
        counts[f"{source} -> {fmt}"] = counts.get(f"{source} -> {fmt}", 0) + 1  # dict ops are atomic under the GIL
    return QuantizedWeight.quantize(a, fmt)


def quantize_input_rows(x: np.ndarray) -> np.ndarray:
    """The float values of the 8-bit input blocks of quant_kernels.c's
    quantize_row: d = amax / 127, q = round-half-even(x * (127 / amax)),
    every step in float32 as in C."""
    m, k = x.shape
    b = np.asarray(x, np.float32).reshape(m, k // QK, QK)
    amax = np.abs(b).max(axis=-1, keepdims=True)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(b * inv)
    return (q * d).reshape(m, k)


def input_quantization_bound(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """|x W^T - q(x) W^T| <= sum over blocks of (d_x / 2) * sum |w| in the
    block: each input value moves by at most half its block's step."""
    m, k = x.shape
    half_step = (x.abs().reshape(m, k // QK, QK).amax(-1) / 127 / 2).double()  # [m, blocks]
    wabs = w.dequantize().abs().reshape(w.shape[0], k // QK, QK).sum(-1).double()  # [n, blocks]
    return (half_step @ wabs.T).float()


# ---------------------------------------------------------------- which format a matrix runs in

QUANTIZATION_CHOICES = QUANTIZATIONS  # auto, none and the block formats
assert QUANTIZATIONS[2:] == QUANT_FORMATS, "config.QUANTIZATIONS must list the formats quantize() writes"
# GGUF types the kernels run as stored, by their gguf enum name.
KEPT_GGUF_TYPES = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1", "Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k",
                   "MXFP4": "mxfp4"}
FLOAT_GGUF_TYPES = ("F32", "F16", "BF16", "F64")
_EDGE_MATRICES = ("model.embed_tokens.weight", "lm_head.weight")


def is_matrix(name: str) -> bool:
    """A weight a product (or the embedding lookup) reads: what quantization touches."""
    return name.endswith("_proj.weight") or name in _EDGE_MATRICES


def target_format(name: str, source: str, quantization: str, width: int) -> str | None:
    """The format matrix `name` (GGUF type `source`, or "F32" etc. for a float
    checkpoint) runs in under --quantization, None for float.

    none: every matrix float (dequantized at load).
    auto: Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K / MXFP4 as stored; any other quantized
          type (Q2_K, Q3_K, Q5_0, Q5_1, IQ*) requantized to q8_0, which loses
          no more than the file already did (an 8-bit grid over a 2-5 bit
          one); float stays float.
    q8_0 / q4_0 / q4_1: the decoder's projections in that format; the
          embedding and LM head as under auto but at least q8_0 (llama.cpp's
          quantizer, like vLLM's methods, spares them too: a 4-bit LM head
          costs the most quality per byte saved).
    A width that is not a multiple of 32 cannot be blocked: float.
    """
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {quantization!r}")
    if quantization == "none" or not is_matrix(name) or width % QK:
        return None
    own = KEPT_GGUF_TYPES.get(source)
    if own is not None and width % group_size(own):
        own = None  # (a GGUF's own tensors always fit their groups)
    if quantization == "auto" or name in _EDGE_MATRICES:
        if own is not None:
            return own
        if source in FLOAT_GGUF_TYPES:
            return None if quantization == "auto" else "q8_0"
        return "q8_0"
    return quantization

