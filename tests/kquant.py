"""Q4_K, Q5_K and Q6_K bytes for tests: gguf has no K-quant quantizer, so this
writes valid super-blocks by plain rules (llama.cpp's quantizer searches
scales harder; the kernels read any valid block the same way), in ggml's
layouts. Q4_K: d and dmin (fp16), 12 bytes of 6-bit scales and minimums, 128
bytes of 4-bit codes (sub-block 2c in the low nibbles of chunk c, 2c + 1
high). Q6_K: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales (one
per 16 values), d (fp16)."""
import numpy as np
import torch

from trajserve.model.quant import QuantizedWeight


def _scaled_codes(a: np.ndarray, top: int) -> tuple[np.ndarray, ...]:
    """Q4_K's / Q5_K's rule on a grid of top + 1 codes: d, dmin (fp16 bytes),
    the 12 bytes of 6-bit scales and minimums, the codes [n, s, 8, 32]."""
    n, k = a.shape
    x = a.astype(np.float32).reshape(n, k // 256, 8, 32)
    lo = np.minimum(x.min(-1), 0)
    scale = (x.max(-1) - lo) / top
    mins = -lo
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (mins.max(-1) / 63).astype(np.float16)
    df, dmf = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    sc = np.clip(np.rint(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(np.divide(mins, dmf, out=np.zeros_like(mins), where=dmf > 0)), 0, 63).astype(np.uint8)
    step = (df * sc)[..., None]
    q = np.clip(np.rint(np.divide(x + (dmf * m)[..., None], step, out=np.zeros_like(x), where=step > 0)), 0, top)
    packed = np.zeros((n, k // 256, 12), np.uint8)
    packed[..., 0:4] = (sc[..., 0:4] & 63) | ((sc[..., 4:8] >> 4) << 6)
    packed[..., 4:8] = (m[..., 0:4] & 63) | ((m[..., 4:8] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:8] & 0x0F) | ((m[..., 4:8] & 0x0F) << 4)
    return d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), packed, q.astype(np.uint8)


def quantize_q4_k(a: np.ndarray) -> np.ndarray:
    """[n, k] float (k a multiple of 256) -> uint8 [n, k / 256 * 144]."""
    n, k = a.shape
    d, dmin, packed, q = _scaled_codes(a, 15)
    codes = q[..., 0::2, :] | (q[..., 1::2, :] << 4)  # [n, s, 4, 32]
    out = np.concatenate([d, dmin, packed, codes.reshape(n, k // 256, 128)], axis=-1)
    return np.ascontiguousarray(out.reshape(n, -1))


def quantize_q5_k(a: np.ndarray) -> np.ndarray:
    """[n, k] float (k a multiple of 256) -> uint8 [n, k / 256 * 176]: Q4_K's
    rule on a grid of 32, the fifth bits in 32 bytes before the nibbles."""
    n, k = a.shape
    d, dmin, packed, q = _scaled_codes(a, 31)
    low = q & 0x0F
    codes = low[..., 0::2, :] | (low[..., 1::2, :] << 4)  # [n, s, 4, 32]
    qh = ((q >> 4) << np.arange(8, dtype=np.uint8).reshape(8, 1)).sum(-2, dtype=np.uint8)  # bit s of byte l
    out = np.concatenate([d, dmin, packed, qh, codes.reshape(n, k // 256, 128)], axis=-1)
    return np.ascontiguousarray(out.reshape(n, -1))


def quantize_q6_k(a: np.ndarray) -> np.ndarray:
    """[n, k] float (k a multiple of 256) -> uint8 [n, k / 256 * 210]."""
    n, k = a.shape
    ns = k // 256
    x = a.astype(np.float32).reshape(n, ns, 16, 16)
    scale = np.abs(x).max(-1) / 31
    d = (scale.max(-1) / 127).astype(np.float16)
    df = d.astype(np.float32)[..., None]
    sc = np.clip(np.ceil(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 127).astype(np.int8)
    step = (df * sc)[..., None]
    q = np.clip(np.rint(np.divide(x, step, out=np.zeros_like(x), where=step != 0)), -32, 31) + 32
    q = q.astype(np.uint8).reshape(n, ns, 2, 4, 32)  # [half, quarter, l]: value 128 h + 32 q + l
    low = q & 0x0F
    ql = np.concatenate([low[..., 0, :] | (low[..., 2, :] << 4), low[..., 1, :] | (low[..., 3, :] << 4)], axis=-1)
    qh = (q[..., 0, :] >> 4) | ((q[..., 1, :] >> 4) << 2) | ((q[..., 2, :] >> 4) << 4) | ((q[..., 3, :] >> 4) << 6)
    out = np.concatenate([ql.reshape(n, ns, 128), qh.reshape(n, ns, 64),
                          sc.view(np.uint8), d[..., None].view(np.uint8)], axis=-1)
    return np.ascontiguousarray(out.reshape(n, -1))


def random_q4_k(n: int, k: int, seed: int, wild: bool = False) -> QuantizedWeight:
    """Valid Q4_K bytes: quantized from Gaussian rows, or (wild) every byte
    random but d and dmin, so every scale, minimum and code occurs."""
    rng = np.random.default_rng(seed)
    if wild:
        return QuantizedWeight.random_blocks("q4_k", n, k, rng)
    raw = quantize_q4_k(rng.standard_normal((n, k)).astype(np.float32))
    return QuantizedWeight(torch.from_numpy(raw), "q4_k", (n, k))


def random_q5_k(n: int, k: int, seed: int) -> QuantizedWeight:
    """Valid Q5_K bytes (Q4_K's fields and 32 bytes of fifth bits a
    super-block), every scale, minimum, code and fifth bit random, d and dmin small."""
    return QuantizedWeight.random_blocks("q5_k", n, k, np.random.default_rng(seed))


def random_q6_k(n: int, k: int, seed: int) -> QuantizedWeight:
    """Valid Q6_K bytes, every code and int8 scale random, d small."""
    return QuantizedWeight.random_blocks("q6_k", n, k, np.random.default_rng(seed))


def random_mxfp4(n: int, k: int, g: torch.Generator) -> QuantizedWeight:
    """Gaussian rows scaled from 2^-30 to 2^30 (their e8m0 scales reach
    past fp16's range), as gguf's MXFP4 quantizer writes them."""
    import gguf

    a = torch.randn(n, k, generator=g) * torch.logspace(-30, 30, n, base=2.0)[:, None]
    raw = gguf.quants.quantize(a.numpy(), gguf.GGMLQuantizationType.MXFP4)
    return QuantizedWeight.from_gguf(raw, "mxfp4", (n, k))
