"""Q4_K bytes for tests: gguf has no K-quant quantizer, so this writes valid
super-blocks by a plain min-max rule (llama.cpp's quantizer searches scales
harder; the kernels read any valid block the same way). The layout is
ggml's: d and dmin (fp16), 12 bytes of 6-bit scales and minimums, 128 bytes
of 4-bit codes (sub-block 2c in the low nibbles of chunk c, 2c + 1 high)."""
import numpy as np
import torch

from trajserve.model.quant import QuantizedWeight


def quantize_q4_k(a: np.ndarray) -> np.ndarray:
    """[n, k] float (k a multiple of 256) -> uint8 [n, k / 256 * 144]."""
    n, k = a.shape
    x = a.astype(np.float32).reshape(n, k // 256, 8, 32)
    lo = np.minimum(x.min(-1), 0)
    scale = (x.max(-1) - lo) / 15
    mins = -lo
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (mins.max(-1) / 63).astype(np.float16)
    df, dmf = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    sc = np.clip(np.rint(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(np.divide(mins, dmf, out=np.zeros_like(mins), where=dmf > 0)), 0, 63).astype(np.uint8)
    step = (df * sc)[..., None]
    q = np.clip(np.rint(np.divide(x + (dmf * m)[..., None], step, out=np.zeros_like(x), where=step > 0)), 0, 15)
    q = q.astype(np.uint8)
    packed = np.zeros((n, k // 256, 12), np.uint8)
    packed[..., 0:4] = (sc[..., 0:4] & 63) | ((sc[..., 4:8] >> 4) << 6)
    packed[..., 4:8] = (m[..., 0:4] & 63) | ((m[..., 4:8] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:8] & 0x0F) | ((m[..., 4:8] & 0x0F) << 4)
    codes = q[..., 0::2, :] | (q[..., 1::2, :] << 4)  # [n, s, 4, 32]
    out = np.concatenate([d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), packed,
                          codes.reshape(n, k // 256, 128)], axis=-1)
    return np.ascontiguousarray(out.reshape(n, -1))


def random_q4_k(n: int, k: int, seed: int, wild: bool = False) -> QuantizedWeight:
    """Valid Q4_K bytes: quantized from Gaussian rows, or (wild) every byte
    random but d and dmin, so every scale, minimum and code occurs."""
    rng = np.random.default_rng(seed)
    if not wild:
        raw = quantize_q4_k(rng.standard_normal((n, k)).astype(np.float32))
    else:
        raw = rng.integers(0, 256, size=(n, k // 256, 144), dtype=np.uint8)
        raw[..., 0:2] = (rng.random((n, k // 256, 1)) * 2e-3).astype(np.float16).view(np.uint8)
        raw[..., 2:4] = (rng.random((n, k // 256, 1)) * 4e-3).astype(np.float16).view(np.uint8)
        raw = raw.reshape(n, -1)
    return QuantizedWeight(torch.from_numpy(np.ascontiguousarray(raw)), "q4_k", (n, k))
