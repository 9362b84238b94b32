"""The C kernels of cpu_kernels.c: built on first use, loaded with ctypes.

The source ships with the package and is compiled once per machine with the
system C compiler (`cc`, ~2 s) into the user's cache directory, keyed by a
hash of the source and flags. No compiler, no AVX2/FMA, a failed build or
TRAJSERVE_CPU_KERNELS=0: `load()` returns None and the model keeps its torch
path (same results within float rounding; the kernels are only faster).

ctypes releases the GIL for the call, so the copy engine's thread runs
beside a kernel like beside a torch op.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
PANEL = 16  # weight rows per packed panel (two AVX2 vectors)

_P = ctypes.c_void_p
_I = ctypes.c_int64
_SIGNATURES = {
    "ts_linear": [_P, _I, _I, _I, _P, _I, _P, _P, _I, ctypes.c_int, ctypes.c_int],
    "ts_gate_up_silu": [_P, _I, _I, _I, _P, _I, _P, _I, ctypes.c_int],
    "ts_rms_norm": [_P, _I, _I, _I, _P, ctypes.c_float, _P, _I, ctypes.c_int],
    "ts_rope_store": [_P, _I, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P, _P, _I, ctypes.c_int],
    "ts_decode_attention": [_P, _I, _I, _I, _I, _I, _P, _P, _I, _P, _P, _P, _P, ctypes.c_float, _P, _I,
                            ctypes.c_int],
    "ts_prefill_attention": [_P, _I, _I, _I, _I, _I, _P, _P, _I, _P, _I, ctypes.c_float, _P, _I, ctypes.c_int],
}
_RETURNS_FAILURES = ("ts_decode_attention", "ts_prefill_attention")


def _cpu_supported() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "trajserve" / "kernels"


def _build(cc: str) -> Path:
    src = SOURCE.read_bytes()
    key = hashlib.sha256(src + " ".join([cc, *FLAGS]).encode()).hexdigest()[:16]
    out = _cache_dir() / f"cpu_kernels-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent first uses never load a
    # half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], check=True, capture_output=True, text=True)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.cache
def load() -> CpuKernels | None:
    if os.environ.get("TRAJSERVE_CPU_KERNELS", "1") == "0":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None or not _cpu_supported():
        log.info("CPU kernels off: %s", "no C compiler" if cc is None else "CPU lacks AVX2/FMA")
        return None
    try:
        return CpuKernels(ctypes.CDLL(str(_build(cc))))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("CPU kernels off: build or load failed: %s", detail)
        return None


def _row_groups(w: torch.Tensor, rows: int) -> torch.Tensor:
    """[n, k] -> [ceil(n / rows), rows, k] float32, zero rows past n."""
    n, k = w.shape
    groups = -(-n // rows)
    padded = torch.zeros(groups * rows, k, dtype=torch.float32)
    padded[:n] = w
    return padded.view(groups, rows, k)


def pack(w: torch.Tensor) -> torch.Tensor:
    """[n, k] -> panels [ceil(n / 16), k, 16]: panel p, step kk holds
    w[16p : 16p + 16, kk] contiguously (rows past n are zero)."""
    return _row_groups(w, PANEL).transpose(1, 2).contiguous()


def pack_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Panels of 8 gate rows then the same 8 up rows, so one tile yields
    silu(gate) * up for 8 outputs (ts_gate_up_silu)."""
    half = PANEL // 2
    both = torch.cat([_row_groups(gate, half), _row_groups(up, half)], dim=1)  # [panels, 16, k]
    return both.transpose(1, 2).contiguous()


def packed_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the matrix behind pack(): a tied embedding is looked up
    in the LM head's panels instead of being kept twice."""
    return packed[ids // PANEL, :, ids % PANEL]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _check_index(*ts: torch.Tensor) -> None:
    # The C side reads these as int64 arrays: anything else is read as garbage.
    for t in ts:
        if t.dtype != torch.int64 or not t.is_contiguous():
            raise TypeError(f"index tensors must be contiguous int64, got {t.dtype}")


class CpuKernels:
    """Thin, checked wrappers. Every tensor is float32 on the CPU; matrices
    need a unit stride along their last dimension (row strides are passed)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        for name, args in _SIGNATURES.items():
            getattr(lib, name).argtypes = args
            getattr(lib, name).restype = ctypes.c_int if name in _RETURNS_FAILURES else None
        self.lib = lib

    @staticmethod
    def threads() -> int:
        return torch.get_num_threads()

    def linear(self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """x [m, k] @ w[n, k]^T (+ bias), w given as pack(w). With `out`, the
        product is added into it (the residual stream) and `out` returned."""
        m, k = x.shape
        if packed.shape[1] != k:
            raise ValueError(f"input has {k} features, the packed weight {packed.shape[1]}")
        acc = out is not None
        if out is None:
            out = torch.empty((m, n), dtype=torch.float32)
        self.lib.ts_linear(x.data_ptr(), m, k, x.stride(0), packed.data_ptr(), n, _ptr(bias),
                           out.data_ptr(), out.stride(0), int(acc), self.threads())
        return out

    def gate_up_silu(self, x: torch.Tensor, packed: torch.Tensor, inter: int) -> torch.Tensor:
        """silu(x @ gate^T) * (x @ up^T), the weights given as pack_gate_up."""
        m, k = x.shape
        if packed.shape[1] != k:
            raise ValueError(f"input has {k} features, the packed weight {packed.shape[1]}")
        out = torch.empty((m, inter), dtype=torch.float32)
        self.lib.ts_gate_up_silu(x.data_ptr(), m, k, x.stride(0), packed.data_ptr(), inter, out.data_ptr(),
                                 out.stride(0), self.threads())
        return out

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        m, d = x.shape
        out = torch.empty((m, d), dtype=torch.float32)
        self.lib.ts_rms_norm(x.data_ptr(), m, d, x.stride(0), w.data_ptr(), eps, out.data_ptr(), d,
                             self.threads())
        return out

    def rope_store(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                   cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_block: torch.Tensor, slot_offset: torch.Tensor) -> None:
        """RoPE in place on qkv's q and k heads; k and v into their slots."""
        _check_index(positions, slot_block, slot_offset)
        self.lib.ts_rope_store(qkv.data_ptr(), qkv.shape[0], qkv.stride(0), num_heads, num_kv_heads, head_dim,
                               cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), k_cache.data_ptr(),
                               v_cache.data_ptr(), slot_block.data_ptr(), slot_offset.data_ptr(),
                               k_cache.shape[2], self.threads())

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         tables: torch.Tensor, table_start: torch.Tensor, ctx: torch.Tensor,
                         rows: torch.Tensor, scale: float, out: torch.Tensor) -> None:
        """q, out: [T, H, d] (q may have a row stride); writes out[rows]."""
        _, num_heads, d = q.shape
        _check_index(tables, table_start, ctx, rows)
        failed = self.lib.ts_decode_attention(
            q.data_ptr(), q.stride(0), rows.shape[0], num_heads, k_cache.shape[1], d, k_cache.data_ptr(),
            v_cache.data_ptr(), k_cache.shape[2], tables.data_ptr(), table_start.data_ptr(), ctx.data_ptr(),
            rows.data_ptr(), scale, out.data_ptr(), out.stride(0), self.threads())
        if failed:
            raise MemoryError(f"decode attention: no memory for the partial results of {failed} sequences")

    def prefill_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_ids: torch.Tensor, ctx_len: int, scale: float, out: torch.Tensor) -> None:
        """One sequence's chunk: q, out [n, H, d] (row strides allowed), the
        chunk's last query at position ctx_len - 1; K/V of all ctx_len tokens
        are in the blocks `block_ids` (in order)."""
        n, num_heads, d = q.shape
        _check_index(block_ids)
        bs = k_cache.shape[2]
        if d % 8 or q.stride(2) != 1 or q.stride(1) != d or out.stride(2) != 1 or out.stride(1) != d:
            raise ValueError(f"prefill attention needs head_dim % 8 == 0 and contiguous heads, got d={d}")
        if not n <= ctx_len <= block_ids.shape[0] * bs:
            raise ValueError(f"chunk of {n} tokens, context {ctx_len}, {block_ids.shape[0]} blocks of {bs}")
        failed = self.lib.ts_prefill_attention(
            q.data_ptr(), q.stride(0), n, num_heads, k_cache.shape[1], d, k_cache.data_ptr(), v_cache.data_ptr(),
            bs, block_ids.data_ptr(), ctx_len, scale, out.data_ptr(), out.stride(0), self.threads())
        if failed:
            raise MemoryError(f"prefill attention: no memory for {failed} (query block, head) tasks")
