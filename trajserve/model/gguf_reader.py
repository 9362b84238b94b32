"""GGUF weights and metadata (llama.cpp's format): a ModelConfig and tensors
under Hugging Face Llama names (model/loader.py is the entry point).

Matrices run quantized keep their GGUF bytes (model/quant.py target_format
says which; other types are requantized), the rest are dequantized with the
gguf package; Q/K rows, stored by llama.cpp in interleaved RoPE order, are
put back in HF order (rotate_half); Llama 3's rope_freqs tensor becomes
rope_scaling. What differs per architecture (experts, latent attention,
YaRN, names): model/gguf_families.py.
"""
from __future__ import annotations

import functools
import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import gguf
import numpy as np
import torch

from trajserve.config import ModelConfig, WindowSpec
from trajserve.model.gguf_families import (EXPERT_NAMES, KV_B_PARTS, LAYER_NAMES, merge_kv_b, mla_spec, moe_spec,
                                           rope_rows, yarn_scaling)
from trajserve.model.quant import QuantizedWeight, requantize, target_format

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "olmoe", "gemma3", "deepseek2", "gpt-oss")
# llama.cpp's architecture name -> ours (config.ModelConfig.architecture)
_ARCHITECTURES = {"qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss"}
PathLike = str | os.PathLike[str]


def _to_torch(a: np.ndarray, dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    # The array may be a read-only view into the mmap; torch wants writable memory.
    a = np.require(a, dtype=np.float32, requirements=["C", "W"])
    return torch.from_numpy(a).to(device=device, dtype=dtype)


# ---------------------------------------------------------------- GGUF


class _FastGGUFReader(gguf.GGUFReader):
    """GGUFReader over a plain ndarray view of the mmap.

    The reader slices its buffer once per metadata element (~150K times for a
    49K-token vocabulary); slicing an np.memmap runs Python-level finalizers
    each time, a plain view does not. Same bytes, ~2.5x faster open.
    """

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain = value.view(np.ndarray)


@functools.lru_cache(maxsize=2)
def _open_gguf_cached(path: str, mtime_ns: int, size: int) -> gguf.GGUFReader:
    return _FastGGUFReader(path)


def open_gguf(path: PathLike) -> gguf.GGUFReader:
    """A GGUFReader, shared between the weight loader and the tokenizer."""
    p = os.path.realpath(path)
    st = os.stat(p)
    return _open_gguf_cached(p, st.st_mtime_ns, st.st_size)


def gguf_value(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _gguf_config(reader: gguf.GGUFReader) -> ModelConfig:
    arch = gguf_value(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def get(key: str, default: Any = None, required: bool = False) -> Any:
        value = gguf_value(reader, f"{arch}.{key}", default)
        if required and value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}, needed for a {arch} model")
        return value

    hidden = int(get("embedding_length", required=True))
    heads = int(get("attention.head_count", required=True))
    tensor_shapes = {t.name: tuple(int(d) for d in t.shape.tolist()) for t in reader.tensors}
    tensor_names = set(tensor_shapes)
    # The embedding's rows are what the logits span; the metadata only
    # restates them (or, in padded vocabularies, counts fewer).
    if "token_embd.weight" in tensor_names:
        vocab = int(_gguf_tensor(reader, "token_embd.weight").shape[1])
    else:
        tokens = reader.get_field("tokenizer.ggml.tokens")
        vocab = get("vocab_size", len(tokens.data) if tokens is not None else None, required=True)
    num_layers = int(get("block_count", required=True))
    mla = mla_spec(get) if arch == "deepseek2" else None
    # A latent attention's RoPE rows are qk_rope_head_dim wide (its cache: ModelConfig.kv_pool_shape).
    head_dim = mla.qk_rope_head_dim if mla else int(get("attention.key_length", hidden // heads))
    rope_dims = get("rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise ValueError(
            f"unsupported partial RoPE ({rope_dims} of {head_dim} head dims); supported: RoPE on the whole head"
        )
    theta = float(get("rope.freq_base", 10000.0))
    q_norm = tensor_shapes.get("blk.0.attn_q_norm.weight")
    scaling_type = get("rope.scaling.type")
    if scaling_type not in (None, "none", "linear", "yarn"):
        raise ValueError(f"unsupported GGUF rope scaling {scaling_type!r}; supported: none, linear, yarn, "
                         "llama3 (rope_freqs)")
    rope_scaling = None
    if scaling_type == "linear" and float(get("rope.scaling.factor", 1.0)) != 1.0:
        rope_scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    if scaling_type == "yarn":
        rope_scaling = yarn_scaling(arch, get)
    if "rope_freqs.weight" in tensor_names:
        factors = gguf.quants.dequantize(*_raw(reader, "rope_freqs.weight")).reshape(-1)
        rope_scaling = _llama3_scaling_from_factors(factors, head_dim, theta)
    moe = moe_spec(arch, get, num_layers, tensor_names)
    clip = get("attention.clamp_kqv")
    gemma, oss = arch == "gemma3", arch == "gpt-oss"
    softcap = get("final_logit_softcapping")
    return ModelConfig(
        architecture=_ARCHITECTURES.get(arch, arch),
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length", required=True)),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=heads if mla else int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm=q_norm is not None,
        # OLMoE's q norm spans all heads (a q-sized weight), Qwen3's one head.
        qk_norm_whole=q_norm is not None and q_norm[0] == heads * head_dim != head_dim,
        clip_qkv=float(clip) if clip else None,
        moe=moe,
        mla=mla,
        window=_gguf_window(get, num_layers, 6 if gemma else 2, 10000.0 if gemma else None, oss) if gemma or oss
        else None,
        # Gemma 3 (llama.cpp's graph): the converter stored its norms' (1 + w)
        # already; the query scale is llama.cpp's rule, which the file does not say.
        sandwich_norms=gemma,
        embed_scale=hidden ** 0.5 if gemma else None,
        attn_scale=((hidden // heads) if num_layers == 62 else head_dim) ** -0.5 if gemma else None,
        hidden_act="gelu_tanh" if gemma else "swiglu_clamp" if oss else "silu",
        attn_sinks=oss,
        mlp_bias=oss,
        final_logit_softcap=float(softcap) if gemma and softcap else None,
        name=str(gguf_value(reader, "general.name", "") or ""),
    )


def _gguf_window(get, num_layers: int, period: int, local_theta: float | None,
                 scaled: bool = False) -> WindowSpec | None:
    """The window layers as llama.cpp reads them: attention.sliding_window
    tokens in every layer but each pattern-th (sliding_window_pattern;
    where the file does not say, the architecture's period: Gemma 3's 6,
    gpt-oss's 2; an array names each layer's kind), their RoPE base
    rope.freq_base_swa (where the file does not say: Gemma 3's 10,000,
    gpt-oss's the global one). `scaled` (gpt-oss): the window layers share
    the global RoPE's scaling, so their base must be the global one too."""
    size = get("attention.sliding_window")
    if not size:
        return None
    pattern = get("attention.sliding_window_pattern", period)
    if isinstance(pattern, list):
        layers = tuple(i for i, swa in enumerate(pattern[:num_layers]) if swa)
    else:
        n = int(pattern)
        layers = tuple(i for i in range(num_layers) if n == 0 or i % n < n - 1)
    theta = get("rope.freq_base_swa", local_theta)
    if scaled and theta is not None:
        if float(theta) != float(get("rope.freq_base", 10000.0)):
            raise ValueError(f"unsupported rope.freq_base_swa {theta} beside rope.freq_base "
                             f"{get('rope.freq_base', 10000.0)}; supported: the global base in the window layers")
        theta = None
    return WindowSpec(int(size), layers, float(theta) if theta is not None else None) if layers else None


def _llama3_scaling_from_factors(factors: np.ndarray, head_dim: int, theta: float) -> dict:
    """Llama 3.1+ GGUFs store the RoPE scaling as per-frequency divisors
    (`rope_freqs`), not as parameters. Every Llama 3.x release uses
    low/high_freq_factor 1/4 over an original 8192 context; the factor is the
    largest divisor. Rebuild the divisors from that and insist they agree."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    params = {
        "rope_type": "llama3",
        "factor": float(factors.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    if factors.shape == inv_freq.shape and np.allclose(_llama3_divisors(inv_freq, params), factors, rtol=1e-3):
        return params
    raise ValueError(
        "GGUF has a rope_freqs tensor that does not match Llama 3 RoPE scaling "
        "(factor=max, low_freq_factor=1, high_freq_factor=4, original context 8192); "
        "unsupported: load the Hugging Face directory instead"
    )


def _llama3_divisors(inv_freq: np.ndarray, p: dict) -> np.ndarray:
    """Per-frequency divisor of Llama 3 RoPE scaling (as in HF `_compute_llama3_parameters`)."""
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = p["original_max_position_embeddings"] / p["low_freq_factor"]
    high_wavelen = p["original_max_position_embeddings"] / p["high_freq_factor"]
    smooth = (p["original_max_position_embeddings"] / wavelen - p["low_freq_factor"]) / (
        p["high_freq_factor"] - p["low_freq_factor"]
    )
    mid = 1.0 / ((1 - smooth) / p["factor"] + smooth)
    return np.where(wavelen < high_wavelen, 1.0, np.where(wavelen > low_wavelen, p["factor"], mid))


# llama.cpp name (after "blk.{i}.") -> HF name (after "model.layers.{i}.")
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",  # a MoE layer's router
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Folded into ModelConfig.rope_scaling instead of being a parameter.
_GGUF_CONFIG_TENSORS = {"rope_freqs.weight"}


def gguf_to_hf_name(name: str, architecture: str = "llama") -> str | None:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    if name.startswith("blk."):
        _, layer, rest = name.split(".", 2)
        names = _GGUF_LAYER_NAMES | LAYER_NAMES.get(architecture, {})
        if rest in names and layer.isdigit():
            return f"model.layers.{layer}.{names[rest]}"
    return None


def _raw(reader: gguf.GGUFReader, name: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    t = _gguf_tensor(reader, name)
    return t.data, t.tensor_type


def _gguf_tensor(reader: gguf.GGUFReader, name: str) -> Any:
    for t in reader.tensors:
        if t.name == name:
            return t
    raise ValueError(f"GGUF has no tensor {name!r}")


def _dequantize(tensor: Any) -> np.ndarray:
    try:
        flat = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ValueError(
            f"GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}, which this gguf library "
            "cannot dequantize; supported: F32, F16, BF16 and the Q*/IQ* types gguf.quants implements"
        ) from None
    # GGUF lists dims fastest-first ([in, out]); torch wants [out, in].
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    return flat.reshape(shape)


def _gguf_tensors(
    reader: gguf.GGUFReader, cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device,
    quantization: str = "none", requantized: dict[str, int] | None = None,
) -> dict[str, torch.Tensor | QuantizedWeight]:
    """`requantized`, if given, counts the matrices brought to another block
    format ("Q3_K -> q8_0": n), for the start-up line."""
    wanted = []
    unknown = []
    kv_b_parts: dict[str, dict[str, Any]] = {}  # deepseek2's split kv_b_proj, by layer
    for t in reader.tensors:
        hf = gguf_to_hf_name(t.name, cfg.architecture)
        rest = t.name.split(".", 2)[-1] if t.name.startswith("blk.") else ""
        if hf is not None:
            wanted.append((hf, t, None))
        elif rest in EXPERT_NAMES and cfg.moe is not None:
            layer = t.name.split(".")[1]
            wanted += [(f"model.layers.{layer}.mlp.experts.{e}.{EXPERT_NAMES[rest]}", t, e)
                       for e in range(cfg.moe.num_experts)]
        elif rest in KV_B_PARTS and cfg.mla is not None:
            kv_b_parts.setdefault(t.name.split(".")[1], {})[rest] = t
        elif t.name not in _GGUF_CONFIG_TENSORS:
            unknown.append(t.name)
    if unknown:
        raise ValueError(
            f"GGUF has tensors a {cfg.architecture} model does not use: {', '.join(unknown[:8])}; "
            f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def unpermute(hf: str, a: np.ndarray) -> np.ndarray:
        # Rows move whole, so a quantized tensor's rows of blocks move the same way.
        return rope_rows(cfg.architecture, hf, a, cfg.num_heads, cfg.num_kv_heads, cfg.mla)

    def to_format(hf: str, a: np.ndarray, source: str) -> torch.Tensor | QuantizedWeight:
        fmt = target_format(hf, source, quantization, a.shape[-1]) if a.ndim == 2 else None
        return _to_torch(a, dtype, device) if fmt is None else requantize(a, fmt, source, requantized)

    def convert(item: tuple[str, Any, int | None]) -> torch.Tensor | QuantizedWeight:
        hf, t, expert = item
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        data = t.data
        if expert is not None:  # one expert's rows of the stacked tensor
            shape, data = shape[1:], t.data[expert]
        fmt = target_format(hf, t.tensor_type.name, quantization, shape[-1]) if len(shape) == 2 else None
        if fmt is not None and t.tensor_type.name.lower() == fmt:
            return QuantizedWeight.from_gguf(unpermute(hf, data), fmt, shape)
        a = unpermute(hf, _dequantize(t) if expert is None else _dequantize_rows(t, data, shape))
        return to_format(hf, a, t.tensor_type.name)

    def kv_b(layer: str) -> torch.Tensor | QuantizedWeight:
        parts = kv_b_parts[layer]
        if set(parts) != set(KV_B_PARTS):
            raise ValueError(f"GGUF layer {layer} has {', '.join(sorted(parts))} without "
                             f"{', '.join(sorted(set(KV_B_PARTS) - set(parts)))}")
        # Merged from its dequantized parts, then formatted as a float checkpoint's kv_b_proj.
        return to_format(f"model.layers.{layer}.self_attn.kv_b_proj.weight",
                         merge_kv_b(*(_dequantize(parts[n]) for n in KV_B_PARTS)), "F32")

    # numpy and torch release the GIL for the bulk work (dequantization, the
    # first touch of fresh output memory): a thread per core pays.
    workers = max(1, min(4, os.cpu_count() or 1))
    with ThreadPoolExecutor(workers) as pool:
        out = dict(zip((hf for hf, _, _ in wanted), pool.map(convert, wanted)))
    out.update({f"model.layers.{layer}.self_attn.kv_b_proj.weight": kv_b(layer) for layer in kv_b_parts})
    return out


def _dequantize_rows(tensor: Any, data: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A slice of a tensor's data (an expert of a stacked tensor) as floats of `shape`."""
    try:
        return gguf.quants.dequantize(data, tensor.tensor_type).reshape(shape)
    except NotImplementedError:
        return _dequantize(tensor)  # names the type it cannot read
