"""The C kernels of cpu_kernels.c, quant_kernels.c, attention_bf16.c and decode_stack.c: built on first use, loaded with ctypes.

The sources ship with the package and are compiled once per machine with the
system C compiler (`cc`, ~3 s) into the user's cache directory, keyed by a
hash of the sources and flags, in one of two builds:

    avx2     AVX2 + FMA + F16C: every x86-64 server since 2013
    avx512   the same plus AVX-512 F/BW/VL and VNNI (the quantized products'
             integer dot is one `vpdpbusd`): Intel since Cascade Lake, AMD Zen 4

The build is chosen from the CPU's flags as the kernel reports them in
/proc/cpuinfo (Linux lists AVX-512 only where the OS saves its registers,
the xgetbv check) and torch's own probe (model/cpu_isa.py); TRAJSERVE_CPU_ISA=avx2|avx512 asks
for one, and a build the CPU cannot run is never loaded. Each build must pass
a known-answer check at load (a float and a quantized product against numpy)
or it is dropped with a warning: an avx512 build that fails falls back to
avx2, an avx2 build that fails to none. In the avx512 build on a CPU with
AMX (Sapphire Rapids and later) two tile paths are checked too, each
against the vector kernel's bits, and used only if they match: the prefill
attention of a bf16 KV pool (AMX-BF16) and quantized products of prefill
chunks (AMX-INT8); on a CPU with AVX512-BF16, bf16 LoRA adapters' products
on dot products (model/lora_check.py, within bf16 rounding of the vector
path, rows independent of their neighbours). No compiler, no AVX2/FMA, a failed
build or TRAJSERVE_CPU_KERNELS=0: `load()` returns None and the model keeps
its torch path (same results within float rounding; the kernels are only
faster).

ctypes releases the GIL for the call, so the copy engine's thread runs
beside a kernel like beside a torch op.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from trajserve.model.amx_check import amx_int8_usable, amx_kv_quant_usable, amx_usable
from trajserve.model.cpu_isa import ISA_NEEDS, cpu_flags, supported_isas  # noqa: F401 (ISA_NEEDS: the tests')
from trajserve.model.formats import CODES
from trajserve.model.lora_check import lora_dp_usable
from trajserve.model.quant import PANEL, QuantizedWeight

log = logging.getLogger(__name__)

_DIR = Path(__file__).parent
SOURCES = [_DIR / f"{n}.c" for n in ("cpu_kernels", "quant_kernels", "attention_bf16", "decode_stack", "mla_attention")]
HEADERS = [_DIR / "simd_math.h", _DIR / "kv_rows.h", _DIR / "formats.h"]
# -ffp-contract=off: an expression rounds the same way in both builds (the
# compiler may not fuse a * b + c into an FMA in one and not the other).
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
ISA_FLAGS = {"avx2": [], "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]}
_P, _I, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "ts_exp_widths": [_P, _I, _P, _P, _C],
    "ts_linear": [_P, _I, _I, _I, _P, _I, _P, _P, _I, _C, _C],
    "ts_linear_heads": [_P, _I, _I, _I, _I, _P, _I, _I, _P, _I, _I, _C],
    "ts_gate_up_silu": [_P, _I, _I, _I, _P, _I, _P, _I, _P, _I, _C],
    "ts_lora_rows": [_P, _I, _I, _I, _P, _P, _P, _P, _I, _I, _C, _C, _C],
    "ts_rms_norm": [_P, _I, _I, _I, _P, ctypes.c_float, _P, _I, _C],
    "ts_rms_norm_heads": [_P, _I, _I, _I, _I, _P, ctypes.c_float, _C],
    "ts_rope_store": [_P, _I, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P, _P, _I, _C, _C],
    "ts_decode_attention": [_P, _I, _I, _I, _I, _I, _P, _P, _I, _P, _P, _P, _P, ctypes.c_float, _P, _I, _C],
    "ts_prefill_attention": [_P, _I, _I, _I, _I, _I, _P, _P, _I, _P, _I, ctypes.c_float, _P, _I, _C],
    "ts_decode_attention_q": [_P, _I, _I, _I, _I, _I, _P, _P, _I, _P, _P, _P, _P, ctypes.c_float, _P, _I, _C, _I, _P, _C],
    "ts_prefill_attention_q": [_P, _I, _I, _I, _I, _I, _P, _P, _I, _P, _I, ctypes.c_float, _P, _I, _C, _I, _P, _C],
    "ts_decode_attention_bf16": [_P, _I, _I, _I, _I, _I, _P, _P, _I, _P, _P, _P, _P, ctypes.c_float, _P, _I, _I, _P, _C],
    "ts_prefill_attention_bf16": [_P, _I, _I, _I, _I, _I, _P, _P, _I, _P, _I, ctypes.c_float, _P, _I, _I, _P, _C],
    "ts_prefill_attention_amx": [_P, _I, _I, _I, _I, _I, _P, _P, _I, _P, _I, ctypes.c_float, _P, _I, _C, _P, _C],
    "ts_prefill_attention_amx_decodes": [_P, _I, _I, _I, _I, _I, _P, _P, _I, _P, _I, ctypes.c_float, _P, _I, _C, _P, _C],
    "ts_decode_attention_amx": [_P, _I, _I, _I, _I, _I, _P, _P, _I, _P, _P, _P, _P, ctypes.c_float, _P, _I, _C, _P, _C],
    "ts_amx_init": [],
    "ts_quant_isa": [],
    "ts_quantize_rows_q8": [_P, _I, _I, _I, _P, _C],
    "ts_qlinear": [_P, _I, _I, _I, _P, _C, _I, _P, _P, _I, _C, _C, _C],
    "ts_qgate_up_silu": [_P, _I, _I, _I, _P, _P, _C, _I, _P, _I, _P, _I, _C, _C],
    "ts_quant_amx_init": [],
    "ts_quant_tile_rows": [_C],
    "ts_dequant_rows": [_P, _C, _I, _P, _I, _P, _I],
    "ts_decode_stack": [_P, _P, _I, _P, _I, _P, _P, _P, _P, _P, _P, _P, _C],
    "ts_latent_attention": [_P, _I, _I, _I, _I, _I, _P, _I, _I, _P, _P, _P, _P, ctypes.c_float, _P, _I, _C],
}
_RETURNS_INT = ("ts_lora_rows", "ts_decode_stack", "ts_prefill_attention", "ts_prefill_attention_q", "ts_prefill_attention_amx", "ts_amx_init", "ts_quant_amx_init", "ts_quant_tile_rows",
                "ts_quant_isa", "ts_qlinear", "ts_qgate_up_silu", "ts_latent_attention")
# AMX prefill of a bf16 pool: head_dim a multiple of 32 (one tile row of
# pairs), up to 256; 16 keys of a block contiguous; chunks from AMX_MIN_QUERIES
# queries (a shorter chunk runs as decodes, which need no V^T copy of the context).
AMX_MIN_QUERIES = 4
DECODE_VECTOR, DECODE_BF16, DECODE_AMX = 0, 1, 2  # decode attention kernels (decode_path)
Q8X_BLOCK_BYTES = 48  # quant_kernels.c block_q8x: float d, s; int32 sum, sum_lo; int8 q[32]


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "trajserve" / "kernels"


def _build(cc: str, isa: str) -> Path:
    flags = FLAGS + ISA_FLAGS[isa]
    src = b"".join(p.read_bytes() for p in SOURCES + HEADERS)
    key = hashlib.sha256(src + " ".join([cc, *flags]).encode()).hexdigest()[:16]
    out = _cache_dir() / f"cpu_kernels-{isa}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent first uses never load a
    # half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *flags, *map(str, SOURCES), "-o", tmp, "-lm"], check=True, capture_output=True,
                       text=True)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _known_answer(k: CpuKernels) -> str | None:
    """None if a float product, a Q8_0 and a Q4_1 product and the prefill
    attention agree with numpy / torch, else what failed."""
    rng = np.random.default_rng(7)
    x = torch.from_numpy(rng.standard_normal((3, 64), dtype=np.float32))
    w = torch.from_numpy(rng.standard_normal((20, 64), dtype=np.float32))
    if not torch.allclose(k.linear(x, pack(w), 20, None), x @ w.T, atol=1e-4):
        return "float product"
    for fmt in ("q8_0", "q4_1"):
        q = QuantizedWeight.quantize(w, fmt)
        if not torch.allclose(k.qlinear(x, q.pack()), q.reference_product(x), atol=1e-4):
            return f"{fmt.upper()} product"
    # 5 queries (2 heads, one kv head) over 5 causal keys in two blocks of 4.
    qa = torch.from_numpy(rng.standard_normal((5, 2, 16), dtype=np.float32))
    kv = torch.from_numpy(rng.standard_normal((2, 2, 1, 4, 16), dtype=np.float32))
    out = torch.empty(5, 2, 16)
    k.prefill_attention(qa, kv[0], kv[1], torch.tensor([1, 0]), 5, 0.25, out)
    keys = kv[:, [1, 0], 0].reshape(2, 8, 16)[:, :5]  # block 1 holds positions 0-3, block 0 position 4
    scores = torch.einsum("qhd,kd->hqk", qa, keys[0]) * 0.25 + torch.full((5, 5), float("-inf")).triu(1)
    want = torch.einsum("hqk,kd->qhd", scores.softmax(-1), keys[1])
    if not torch.allclose(out, want, atol=1e-5):
        return "prefill attention"
    # The same over a bf16 pool (attention_bf16.c; decodes, as a CPU without AMX runs it), within bf16 rounding.
    k.prefill_attention(qa, kv[0].bfloat16(), kv[1].bfloat16(), torch.tensor([1, 0]), 5, 0.25, out)
    if not torch.allclose(out, want, atol=0.05):
        return "bf16 attention"
    return None


def _checked_paths(k: CpuKernels) -> dict[str, bool]:
    """The optional paths this CPU runs and whose checks pass (model/amx_check.py,
    model/lora_check.py), each checked on a twin of `k` with it on."""
    flags = cpu_flags()
    amx = amx_usable(k, flags)
    return {"amx": amx, "amx_kv_quant": amx and amx_kv_quant_usable(k.with_paths(amx=True)),
            "amx_int8": amx_int8_usable(k, flags), "lora_dp": lora_dp_usable(k, flags)}


@functools.cache
def load(isa: str | None = None) -> CpuKernels | None:
    """The kernels for `isa` (None: TRAJSERVE_CPU_ISA or the best this CPU
    runs), or None with the reason logged."""
    if os.environ.get("TRAJSERVE_CPU_KERNELS", "1") == "0":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    runnable = supported_isas()
    if cc is None or not runnable:
        log.info("CPU kernels off: %s", "no C compiler" if cc is None else "CPU lacks AVX2/FMA/F16C")
        return None
    wanted = isa or os.environ.get("TRAJSERVE_CPU_ISA") or None
    if wanted is not None and wanted not in runnable:
        log.warning("CPU kernels: %s requested, this CPU runs only %s", wanted, ", ".join(runnable))
        return None
    for candidate in [wanted] if wanted else runnable:
        try:
            kernels = CpuKernels(ctypes.CDLL(str(_build(cc, candidate))), candidate)
        except (OSError, subprocess.CalledProcessError) as e:
            log.warning("CPU kernels (%s) off: build or load failed: %s", candidate, getattr(e, "stderr", "") or e)
            continue
        failed = _known_answer(kernels)
        if failed is None:
            return kernels.with_paths(**_checked_paths(kernels))
        log.warning("CPU kernels (%s) off: the %s failed its known-answer check", candidate, failed)
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


def _check_sinks(sinks: torch.Tensor | None, num_heads: int) -> None:
    """Sinks (every attention kernel takes them): contiguous float32, one a query head."""
    if sinks is not None and (sinks.dtype != torch.float32 or sinks.shape != (num_heads,) or not sinks.is_contiguous()):
        raise ValueError(f"sinks must be contiguous float32 [{num_heads}], got {sinks.dtype} {tuple(sinks.shape)}")


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _pool_format(k_cache: torch.Tensor, v_cache: torch.Tensor, head_dim: int) -> int:
    """The pool's format code (formats.h): float32, bfloat16
    (attention_bf16.c), q8_0 or q4_0 rows (model/kv_quant.py)."""
    from trajserve.model.kv_quant import pool_format

    if k_cache.dtype != v_cache.dtype or k_cache.shape != v_cache.shape or \
            k_cache.dtype not in (torch.float32, torch.bfloat16, torch.uint8):
        raise TypeError(f"KV pool must be float32, bfloat16 or uint8 (q8_0, q4_0), got {k_cache.dtype} / "
                        f"{v_cache.dtype}")
    return pool_format(k_cache, head_dim).code



def _check_pre(pre: torch.Tensor | None, m: int, inter: int) -> None:
    if pre is not None and (pre.shape != (m, 2 * inter) or pre.dtype != torch.float32 or pre.stride(1) != 1):
        raise ValueError(f"gate/up deltas must be float32 [{m}, {2 * inter}] with unit column stride, "
                         f"got {pre.dtype} {tuple(pre.shape)}")


def _check_index(*ts: torch.Tensor) -> None:
    # The C side reads these as int64 arrays: anything else is read as garbage.
    for t in ts:
        if t.dtype != torch.int64 or not t.is_contiguous():
            raise TypeError(f"index tensors must be contiguous int64, got {t.dtype}")


@dataclass(frozen=True, slots=True)
class KernelPaths:
    """The optional paths of a build, each on only where this CPU runs it and
    load()'s check found it gives the bits of the path it stands in for."""
    amx: bool = False           # attention over a bf16 pool on AMX-BF16 tiles
    amx_kv_quant: bool = False  # q8_0 / q4_0 pools' attention on the same tiles (rows read as bf16)
    amx_int8: bool = False      # quantized products of >= 16 rows on AMX-INT8 tiles
    lora_dp: bool = False       # bf16 adapters' products on AVX512-BF16 dot products


class CpuKernels:
    """Thin, checked wrappers. Every tensor is float32 on the CPU; matrices
    need a unit stride along their last dimension (row strides are passed)."""

    def __init__(self, lib: ctypes.CDLL, isa: str = "avx2", paths: KernelPaths = KernelPaths()) -> None:
        for name, args in _SIGNATURES.items():
            getattr(lib, name).argtypes = args
            getattr(lib, name).restype = ctypes.c_int if name in _RETURNS_INT else None
        self.lib = lib
        self.isa = isa
        self.paths = paths
        # The integer dot product the build compiled (1 AVX2, 2 AVX512-VNNI).
        self.dot_product = {1: "avx2 vpmaddubsw", 2: "avx512 vpdpbusd"}[lib.ts_quant_isa()]

    def with_paths(self, **paths: bool) -> CpuKernels:
        """A twin over the same library with these paths set: load() turns
        on what its checks passed, the checks try a path on a twin first."""
        return CpuKernels(self.lib, self.isa, dataclasses.replace(self.paths, **paths))

    def tile_rows(self, fmt: str) -> int:
        """The fewest input rows a product of this format takes AMX-INT8 tiles from here (0: never)."""
        return self.lib.ts_quant_tile_rows(CODES[fmt]) if self.paths.amx_int8 else 0

    def without(self, *names: str) -> CpuKernels:
        """A twin with these paths off (--kernel-paths-off)."""
        return self.with_paths(**{n: False for n in names if n in KernelPaths.__dataclass_fields__})

    def __getattr__(self, name: str):
        """The optional paths read as attributes by callers (kernels.amx,
        kernels.lora_dp); the per-step calls below read self.paths directly."""
        if name in KernelPaths.__dataclass_fields__:
            return getattr(self.paths, name)
        raise AttributeError(name)

    def amx_attention(self, head_dim: int, block_size: int) -> bool:
        """Whether a bf16 pool's prefill runs on AMX tiles for this shape."""
        return self.paths.amx and head_dim % 32 == 0 and head_dim <= 256 and block_size % 16 == 0

    def amx_quantized(self, head_dim: int, group: int) -> bool:
        """Whether a q8_0 / q4_0 pool's attention, decode and prefill alike,
        runs on AMX tiles (rows read as bf16; attention_bf16.c): one choice for
        both, so a token scores the same decoded or in a chunk. Not the block
        size's to decide (the rows are read one by one into buffers), so a
        block size never changes a quantized pool's tokens."""
        return self.paths.amx_kv_quant and head_dim % 32 == 0 and head_dim <= 256 and group <= 16

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

    def gate_up_silu(self, x: torch.Tensor, packed: torch.Tensor, inter: int,
                     pre: torch.Tensor | None = None) -> torch.Tensor:
        """silu(x @ gate^T) * (x @ up^T), the weights given as pack_gate_up;
        `pre` [m, 2 * inter] (LoRA deltas) is added to gate | up before silu."""
        m, k = x.shape
        if packed.shape[1] != k:
            raise ValueError(f"input has {k} features, the packed weight {packed.shape[1]}")
        _check_pre(pre, m, inter)
        out = torch.empty((m, inter), dtype=torch.float32)
        self.lib.ts_gate_up_silu(x.data_ptr(), m, k, x.stride(0), packed.data_ptr(), inter, out.data_ptr(),
                                 out.stride(0), _ptr(pre), 0 if pre is None else pre.stride(0), self.threads())
        return out

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        m, d = x.shape
        out = torch.empty((m, d), dtype=torch.float32)
        self.lib.ts_rms_norm(x.data_ptr(), m, d, x.stride(0), w.data_ptr(), eps, out.data_ptr(), d,
                             self.threads())
        return out

    def rms_norm_heads(self, x: torch.Tensor, start: int, heads: int, head_dim: int, w: torch.Tensor,
                       eps: float) -> None:
        """In place: each of `heads` heads of head_dim values from column
        `start` of each row of x [T, width] (unit column stride)."""
        if x.dtype != torch.float32 or x.stride(1) != 1 or start + heads * head_dim > x.shape[1]:
            raise ValueError(f"{heads} heads of {head_dim} from column {start} of a float32 {tuple(x.shape)}")
        self.lib.ts_rms_norm_heads(x.data_ptr() + 4 * start, x.shape[0], x.stride(0), heads, head_dim, w.data_ptr(),
                                   eps, self.threads())

    def rope_store(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                   cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_block: torch.Tensor, slot_offset: torch.Tensor) -> None:
        """RoPE in place on qkv's q and k heads; k and v into their slots
        (rounded to bf16 in a bfloat16 pool)."""
        _check_index(positions, slot_block, slot_offset)
        self.lib.ts_rope_store(qkv.data_ptr(), qkv.shape[0], qkv.stride(0), num_heads, num_kv_heads, head_dim,
                               cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), k_cache.data_ptr(),
                               v_cache.data_ptr(), slot_block.data_ptr(), slot_offset.data_ptr(),
                               k_cache.shape[2], _pool_format(k_cache, v_cache, head_dim), self.threads())

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         tables: torch.Tensor, table_start: torch.Tensor, ctx: torch.Tensor,
                         rows: torch.Tensor, scale: float, out: torch.Tensor, window: int = 0,
                         sinks: torch.Tensor | None = None) -> None:
        """q, out: [T, H, d] (q may have a row stride); writes out[rows]. window > 0: each query over
        its latest `window` keys (on the vector kernels). sinks: each head's sink logit [H] (gpt-oss)."""
        _, num_heads, d = q.shape
        _check_index(tables, table_start, ctx, rows)
        fmt = _pool_format(k_cache, v_cache, d)
        args = (q.data_ptr(), q.stride(0), rows.shape[0], num_heads, k_cache.shape[1], d, k_cache.data_ptr(),
                v_cache.data_ptr(), k_cache.shape[2], tables.data_ptr(), table_start.data_ptr(), ctx.data_ptr(),
                rows.data_ptr(), scale, out.data_ptr(), out.stride(0))
        path = self.decode_path(fmt, d, k_cache.shape[2], num_heads // k_cache.shape[1], window)
        _check_sinks(sinks, num_heads)
        if path == DECODE_AMX:
            self.lib.ts_decode_attention_amx(*args, fmt, _ptr(sinks), self.threads())
        elif path == DECODE_BF16:
            self.lib.ts_decode_attention_bf16(*args, window, _ptr(sinks), self.threads())
        else:
            self.lib.ts_decode_attention_q(*args, fmt, window, _ptr(sinks), self.threads())

    def decode_path(self, fmt: int, head_dim: int, block_size: int, group: int, window: int) -> int:
        """Which kernel runs a decode's attention over a pool of format code
        `fmt`: AMX tiles (a bf16 pool, or q8_0 / q4_0 rows read as bf16; no
        window), the bf16 vector kernel, or the vector kernel of float32 and
        q8_0 / q4_0 rows dequantized as read (decode_stack.c's TS_ATTN_*)."""
        if fmt == 1 and not window and self.amx_attention(head_dim, block_size) and group <= 16:
            return DECODE_AMX
        if fmt == 1:
            return DECODE_BF16
        if fmt != 0 and not window and self.amx_quantized(head_dim, group):
            return DECODE_AMX
        return DECODE_VECTOR

    def prefill_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor,
                          ctx_len: int, scale: float, out: torch.Tensor, window: int = 0, sinks=None) -> None:
        """One sequence's chunk: q, out [n, H, d] (row strides allowed), the
        chunk's last query at position ctx_len - 1; K/V of all ctx_len tokens
        are in the blocks `block_ids` (in order; window > 0: a sliding-window
        layer's, whose blocks before the chunk's first window are not read)."""
        n, num_heads, d = q.shape
        _check_index(block_ids)
        bs = k_cache.shape[2]
        if d % 8 or q.stride(2) != 1 or q.stride(1) != d or out.stride(2) != 1 or out.stride(1) != d:
            raise ValueError(f"prefill attention needs head_dim % 8 == 0 and contiguous heads, got d={d}")
        if not n <= ctx_len <= block_ids.shape[0] * bs:
            raise ValueError(f"chunk of {n} tokens, context {ctx_len}, {block_ids.shape[0]} blocks of {bs}")
        fmt = _pool_format(k_cache, v_cache, d)
        args = (q.data_ptr(), q.stride(0), n, num_heads, k_cache.shape[1], d, k_cache.data_ptr(), v_cache.data_ptr(),
                bs, block_ids.data_ptr(), ctx_len, scale, out.data_ptr(), out.stride(0))
        failed = 0
        amx_rows = fmt and not window and self.amx_quantized(d, num_heads // k_cache.shape[1])  # q8_0 / q4_0 as bf16
        _check_sinks(sinks, num_heads)
        if fmt == 1 and not window and self.amx_attention(d, bs) and n >= AMX_MIN_QUERIES:
            failed = self.lib.ts_prefill_attention_amx(*args, fmt, _ptr(sinks), self.threads())
        elif fmt == 1:
            self.lib.ts_prefill_attention_bf16(*args, window, _ptr(sinks), self.threads())
        elif amx_rows:
            if n >= AMX_MIN_QUERIES:
                failed = self.lib.ts_prefill_attention_amx(*args, fmt, _ptr(sinks), self.threads())
            else:
                self.lib.ts_prefill_attention_amx_decodes(*args, fmt, _ptr(sinks), self.threads())
        else:  # float32, or q8_0 / q4_0 key blocks dequantized as read
            failed = self.lib.ts_prefill_attention_q(*args, fmt, window, _ptr(sinks), self.threads())
        if failed:
            raise MemoryError(f"prefill attention: no memory for {failed} (query block, head) tasks")

    # ------------------------------------------------ quantized weights (quant_kernels.c)

    def qlinear(self, x: torch.Tensor, w, bias: torch.Tensor | None = None,
                out: torch.Tensor | None = None, into: torch.Tensor | None = None) -> torch.Tensor:
        """x [m, k] @ w^T (+ bias) for QuantizedPanels w [n, k]; with `out`
        the product is added into it and `out` returned; with `into` (a
        [m, n] view with unit column stride, e.g. some columns of a wider
        output) written there."""
        m, k = x.shape
        n = w.shape[0]
        if w.shape[1] != k or x.stride(1) != 1:
            raise ValueError(f"input has {k} features (unit stride needed), the weight {w.shape[1]}")
        acc = out is not None
        y = out if acc else into if into is not None else torch.empty((m, n), dtype=torch.float32)
        if y.shape != (m, n) or y.dtype != torch.float32 or y.stride(1) != 1:
            raise ValueError(f"output must be float32 [{m}, {n}] with unit column stride, got {y.dtype} "
                             f"{tuple(y.shape)}")
        if self.lib.ts_qlinear(x.data_ptr(), m, k, x.stride(0), w.data.data_ptr(), CODES[w.fmt], n,
                               _ptr(bias), y.data_ptr(), y.stride(0), int(acc), int(self.paths.amx_int8),
                               self.threads()):
            raise MemoryError(f"quantized product: no memory for the input blocks of {m} rows")
        return y

    def qgate_up_silu(self, x: torch.Tensor, gate, up, pre: torch.Tensor | None = None) -> torch.Tensor:
        """silu(x @ gate^T) * (x @ up^T) for two QuantizedPanels of one format;
        `pre` as in gate_up_silu."""
        m, k = x.shape
        if gate.fmt != up.fmt or gate.shape != up.shape or gate.shape[1] != k or x.stride(1) != 1:
            raise ValueError(f"gate {gate.fmt} {gate.shape} and up {up.fmt} {up.shape} for {k} input features")
        inter = gate.shape[0]
        _check_pre(pre, m, inter)
        out = torch.empty((m, inter), dtype=torch.float32)
        if self.lib.ts_qgate_up_silu(x.data_ptr(), m, k, x.stride(0), gate.data.data_ptr(), up.data.data_ptr(),
                                     CODES[gate.fmt], inter, out.data_ptr(), out.stride(0), _ptr(pre),
                                     0 if pre is None else pre.stride(0), int(self.paths.amx_int8), self.threads()):
            raise MemoryError(f"quantized product: no memory for the input blocks of {m} rows")
        return out

    def dequant_rows(self, w, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of QuantizedPanels as float32 (an embedding lookup)."""
        _check_index(ids)
        n, k = w.shape
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
            raise IndexError(f"row ids must lie in [0, {n})")
        out = torch.empty((ids.shape[0], k), dtype=torch.float32)
        self.lib.ts_dequant_rows(w.data.data_ptr(), CODES[w.fmt], k, ids.data_ptr(), ids.shape[0],
                                 out.data_ptr(), k)
        return out

    def quantize_rows_q8(self, x: torch.Tensor) -> torch.Tensor:
        """The input blocks a quantized product makes of x [m, k], as raw
        bytes [m, k / 32 * 48] (float d, s; int32 sum, sum_lo; int8 q[32] per block)."""
        m, k = x.shape
        if k % 32 or x.stride(1) != 1:
            raise ValueError(f"input rows need a multiple of 32 features and unit stride, got {k}")
        out = torch.empty((m, k // 32 * Q8X_BLOCK_BYTES), dtype=torch.uint8)
        self.lib.ts_quantize_rows_q8(x.data_ptr(), m, k, x.stride(0), out.data_ptr(), self.threads())
        return out
