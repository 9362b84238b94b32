"""A decode step's layer stack in one C call (decode_stack.c).

A step of decodes only (no prefill chunk, no adapter, no reload to wait for
layer by layer, one pool index for every layer) on a dense Llama-shaped
model runs its layers in `ts_decode_stack`: the same kernels, in the same
order, on the same buffers as LlamaModel._forward_kernels calls them one by
one, so the logits are the same bits; what goes is the Python and ctypes
around each layer's 8 calls (~60 us a layer) and the kernels' OpenMP
workers falling asleep between them (docs/benchmarks.md: the 1.7B model's
batch-1 step 1.29x). What it cannot run (latent attention,
experts, sinks, Gemma's norms and GELU, OLMoE's whole-q norm and clamp) keeps
the per-layer path; `--kernel-paths-off decode_stack` turns it off for comparisons.
"""
from __future__ import annotations

import ctypes

import torch

from trajserve.model.formats import CODES
from trajserve.model.kv_quant import pool_format
from trajserve.model.linear import GateUpSilu, Linear, QGateUpSilu, QLinear, QLinearParts

F32 = CODES["float32"]


class _Product(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("w2", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("n", ctypes.c_int64), ("col", ctypes.c_int64), ("fmt", ctypes.c_int64)]


class _Layer(ctypes.Structure):
    _fields_ = [("in_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("cos", ctypes.c_void_p),
                ("sin", ctypes.c_void_p), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                ("window", ctypes.c_int64), ("attn", ctypes.c_int64), ("nqkv", ctypes.c_int64),
                ("qkv", _Product * 3), ("o", _Product), ("gate_up", _Product), ("down", _Product)]


class _Stack(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int64), ("hq", ctypes.c_int64), ("hkv", ctypes.c_int64), ("d", ctypes.c_int64),
                ("inter", ctypes.c_int64), ("bs", ctypes.c_int64), ("kv_fmt", ctypes.c_int64),
                ("amx_int8", ctypes.c_int64), ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _parts(p) -> list[tuple] | None:
    """(weight, bias, out features, first column, format code) of each part
    of a product the stack runs, None for one it does not."""
    if isinstance(p, Linear) and p.packed is not None:
        return [(p.packed, p.bias, p.out_features, 0, F32)]
    if isinstance(p, QLinear):
        return [(p.panels.data, p.bias, p.out_features, 0, CODES[p.panels.fmt])]
    if isinstance(p, QLinearParts) and len(p.parts) <= 3:
        return [(q.panels.data, q.bias, q.out_features, a, CODES[q.panels.fmt]) for (a, _), q in zip(p.spans, p.parts)]
    return None


def _product(part: tuple, w2: torch.Tensor | None = None) -> _Product:
    w, bias, n, col, fmt = part
    return _Product(w.data_ptr(), _ptr(w2), _ptr(bias), n, col, fmt)


class DecodeStack:
    """The layers of a LlamaModel as decode_stack.c's structures, built once;
    the pool's pointers are filled per pool (a pool does not move). The
    model owns it (model.stack) and keeps the weights its pointers point at;
    it holds no reference back, so a dropped model and its pool are freed at
    once, not at the garbage collector's next cycle."""

    def __init__(self, model, layers: list[_Layer]) -> None:
        c = model.config
        self.config = c
        self.kernels = model.kernels
        self.layers = layers
        self.spec = _Stack(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, 0, 0,
                           int(model.kernels.paths.amx_int8), c.rms_norm_eps, model.scale)
        self._pool: tuple | None = None  # the pool the layers' pointers point into
        self._caches: list | None = None  # the list it was last bound from

    @classmethod
    def build(cls, model) -> DecodeStack | None:
        """The stack of `model`, or None where a layer needs what it does not run."""
        c = model.config
        if (model.kernels is None or c.mla is not None or c.moe is not None
                or c.attn_sinks or c.sandwich_norms or c.hidden_act != "silu" or c.qk_norm_whole
                or c.clip_qkv is not None):
            return None
        layers = []
        for L in model.layers:
            qkv, o, down = _parts(L.qkv), _parts(L.o), _parts(L.down)
            if qkv is None or o is None or down is None or len(o) != 1 or len(down) != 1:
                return None
            if isinstance(L.gate_up, GateUpSilu):
                gate_up = _Product(L.gate_up.packed.data_ptr(), None, None, L.gate_up.inter, 0, F32)
            elif isinstance(L.gate_up, QGateUpSilu):
                gate_up = _product((L.gate_up.gate.data, None, L.gate_up.gate.shape[0], 0,
                                    CODES[L.gate_up.gate.fmt]), L.gate_up.up.data)
            else:
                return None
            layer = _Layer(in_norm=L.in_norm.data_ptr(), post_norm=L.post_norm.data_ptr(), q_norm=_ptr(L.q_norm),
                           k_norm=_ptr(L.k_norm), cos=L.cos.data_ptr(),
                           sin=L.sin.data_ptr(), window=L.window, nqkv=len(qkv), o=_product(o[0]),
                           gate_up=gate_up, down=_product(down[0]))
            for i, part in enumerate(qkv):
                layer.qkv[i] = _product(part)
            layers.append(layer)
        return cls(model, (_Layer * len(layers))(*layers))

    def runs(self, meta, lora, before_layer) -> bool:
        """Whether this step is one the stack runs: decodes only, no
        adapters, no layer to wait for, one index for every layer's pool."""
        return (lora is None and before_layer is None and not meta.prefills and meta.layer_pages is None
                and meta.num_decodes > 0 and meta.dec_tables is not None)

    def _bind(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Point the layers at this pool (again only when the pool changed:
        the runner passes its one list every step, so most steps stop at the
        identity check)."""
        if kv_caches is self._caches:
            return
        key = tuple((k.data_ptr(), v.data_ptr()) for k, v in kv_caches)
        self._caches = kv_caches
        if key == self._pool:
            return
        c, K = self.config, self.kernels
        k0 = kv_caches[0][0]
        fmt = pool_format(k0, c.head_dim).code
        self.spec.bs, self.spec.kv_fmt = k0.shape[2], fmt
        for layer, (k, v) in zip(self.layers, kv_caches):
            layer.k_cache, layer.v_cache = k.data_ptr(), v.data_ptr()
            layer.attn = K.decode_path(fmt, c.head_dim, k.shape[2], c.num_heads // c.num_kv_heads, layer.window)
        self._pool = key

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, meta,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """x [T, hidden] float32, contiguous: every layer run on it in place."""
        if x.dtype != torch.float32 or not x.is_contiguous() or positions.dtype != torch.int64:
            raise TypeError(f"decode stack: x must be contiguous float32 and positions int64, got {x.dtype} "
                            f"and {positions.dtype}")
        self._bind(kv_caches)
        if self.kernels.lib.ts_decode_stack(
                ctypes.addressof(self.spec), ctypes.addressof(self.layers), len(self.layers), x.data_ptr(), x.shape[0],
                positions.data_ptr(), meta.slot_block.data_ptr(), meta.slot_offset.data_ptr(),
                meta.dec_tables.data_ptr(), meta.dec_table_start.data_ptr(), meta.dec_ctx.data_ptr(),
                meta.decode_rows.data_ptr(), self.kernels.threads()):
            raise MemoryError(f"decode stack: no memory for the buffers of {x.shape[0]} rows")
        return x
