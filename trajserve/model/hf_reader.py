"""Hugging Face model directories: config.json and safetensors weights
(one file, or shards named by model.safetensors.index.json). model/loader.py
is the entry point."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from trajserve.config import MLASpec, ModelConfig, MoESpec, WindowSpec
from trajserve.model.hf_mxfp4 import is_packed, split_packed_experts

# HF model_type -> our architecture. Mistral is Llama with other defaults.
HF_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe",
                  "olmoe": "olmoe", "gemma3_text": "gemma3", "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2",
                  "gpt_oss": "gpt_oss"}
# hidden_act (Gemma: hidden_activation) -> ours.
HF_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def _read_hf_config(d: Path) -> dict:
    if not d.is_dir():
        raise FileNotFoundError(f"{str(d)!r} is neither a .gguf file nor a directory")
    cfg_file = d / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{str(d)!r} has no config.json; a Hugging Face model directory needs one")
    with cfg_file.open() as f:
        return json.load(f)


def _hf_rope(raw: dict) -> tuple[float, dict | None]:
    """rope_theta and RoPE scaling (llama3, linear, yarn: model/rope.py), from
    transformers 4 (`rope_theta`, `rope_scaling`) or 5 (`rope_parameters`)
    style configs."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or params
    theta = float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind in (None, "default"):
        return theta, None
    required = {"llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                "linear": ("factor",), "yarn": ("factor",)}
    if kind not in required:
        raise ValueError(f"unsupported rope scaling {kind!r}; supported: default (none), {', '.join(required)}")
    missing = [k for k in required[kind] if k not in scaling]
    if missing:
        raise ValueError(f"{kind} rope scaling lacks {', '.join(missing)}")
    out = {"rope_type": kind, **{k: scaling[k] for k in required[kind]}}
    if kind == "yarn":
        out["original_max_position_embeddings"] = scaling.get("original_max_position_embeddings") \
            or raw.get("max_position_embeddings")
        out.update({k: scaling[k] for k in ("beta_fast", "beta_slow", "attention_factor", "mscale",
                                            "mscale_all_dim", "truncate") if scaling.get(k) is not None})
    return theta, out


def _context(raw: dict, scaling: dict | None) -> int:
    """The positions the model serves: a config's YaRN or linear scaling
    stretches its trained context by the factor, as vLLM derives it (YaRN
    from original_max_position_embeddings); Llama 3's configs already say
    the stretched length."""
    trained = int(raw.get("max_position_embeddings", 2048))
    if scaling is None or scaling["rope_type"] == "llama3":
        return trained
    base = scaling["original_max_position_embeddings"] if scaling["rope_type"] == "yarn" else trained
    return max(trained, int(base * scaling["factor"]))


def _hf_config(raw: dict, name: str = "") -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type == "gemma3":
        raise ValueError("model_type 'gemma3' is Gemma 3's image-text checkpoint; supported: its text model "
                         "(model_type gemma3_text, Gemma3ForCausalLM)")
    arch = HF_MODEL_TYPES.get(model_type)
    if arch is None:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(HF_MODEL_TYPES)}"
        )
    method = (raw.get("quantization_config") or {}).get("quant_method")
    if raw.get("quantization_config") and not (arch == "gpt_oss" and method == "mxfp4"):
        raise ValueError(f"unsupported quantization_config {method!r} for {model_type}; supported: none, "
                         "gpt_oss's mxfp4 experts")
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
    if act not in HF_ACTIVATIONS or (act != "silu" and arch != "gemma3"):
        raise ValueError(f"unsupported hidden_act {act!r}; supported: silu (gelu_pytorch_tanh in gemma3_text)")
    if raw.get("mlp_bias"):
        raise ValueError("unsupported mlp_bias=True; supported: MLP projections without bias")
    for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if raw.get(key):
            raise ValueError(f"unsupported {key}={raw[key]!r}; supported: none")
    mla = MLASpec.from_hf(raw) if arch == "deepseek2" else None
    if arch == "deepseek2" and (mla is None or raw.get("attention_bias")):
        raise ValueError(f"a {model_type} config needs kv_lora_rank (latent attention) and no attention_bias")
    hidden = int(raw["hidden_size"])
    heads = int(raw["num_attention_heads"])
    layers = int(raw["num_hidden_layers"])
    params = raw.get("rope_parameters") or {}
    by_type = "full_attention" in params  # transformers 5's RoPE per layer kind (Gemma 3)
    theta, rope_scaling = _hf_rope({"rope_parameters": params["full_attention"]} if by_type else raw)
    # Qwen2 hard-codes q/k/v bias; Llama and Qwen3 take it from the config.
    bias = True if arch == "qwen2" else bool(raw.get("attention_bias", False))
    gemma, oss = arch == "gemma3", arch == "gpt_oss"
    return ModelConfig(
        architecture=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads if mla else int(raw.get("num_key_value_heads") or heads),
        # A latent attention's RoPE rows are qk_rope_head_dim wide (its cache: ModelConfig.kv_pool_shape).
        head_dim=mla.qk_rope_head_dim if mla else int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=rope_scaling,
        # Gemma 3's max_position_embeddings already counts its linear scaling.
        max_position_embeddings=_context(raw, None if gemma else rope_scaling),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bias,
        qk_norm=arch in ("qwen3", "qwen3_moe", "olmoe", "gemma3"),
        qk_norm_whole=arch == "olmoe",
        clip_qkv=float(raw["clip_qkv"]) if arch == "olmoe" and raw.get("clip_qkv") is not None else None,
        moe=_moe(raw, layers) if arch in ("qwen3_moe", "olmoe", "deepseek2", "gpt_oss") else None,
        mla=mla,
        window=_window(raw, layers),
        norm_plus_one=gemma,
        sandwich_norms=gemma,
        embed_scale=hidden ** 0.5 if gemma else None,
        attn_scale=float(raw.get("query_pre_attn_scalar") or 256) ** -0.5 if gemma else None,
        # gpt-oss's config says silu; its experts run the clamped SwiGLU.
        hidden_act="swiglu_clamp" if oss else HF_ACTIVATIONS[act],
        swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
        attn_sinks=oss,
        mlp_bias=oss,
        final_logit_softcap=float(raw["final_logit_softcapping"]) if raw.get("final_logit_softcapping") else None,
        name=str(raw.get("_name_or_path") or name),
    )


def _window(raw: dict, num_layers: int) -> WindowSpec | None:
    """The sliding-window layers (WindowSpec.from_hf), refusing what the
    engine does not run: other layer kinds (chunked, bidirectional) and
    window layers with a scaled RoPE of their own."""
    types = raw.get("layer_types") or []
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"unsupported layer_types {unknown}; supported: full_attention, sliding_attention")
    if types and len(types) != num_layers:
        raise ValueError(f"layer_types names {len(types)} layers, the model has {num_layers}")
    local = (raw.get("rope_parameters") or {}).get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"unsupported rope_type {local['rope_type']!r} in sliding layers; supported: default")
    return WindowSpec.from_hf(raw, num_layers)


def _moe(raw: dict, num_layers: int) -> MoESpec | None:
    """Qwen3-MoE's and OLMoE's routed layers (MoESpec.from_hf); the engine
    takes the experts a token runs from the file, never a default."""
    spec = MoESpec.from_hf(raw, num_layers)
    if spec is not None and "num_experts_per_tok" not in raw:
        raise ValueError("a mixture-of-experts config.json needs num_experts_per_tok")
    return spec


def _rope_interleaved(raw: dict) -> bool:
    """DeepSeek's RoPE dims come in interleaved pairs (x0, x1), (x2, x3), ...
    (V2 always; V3 unless rope_interleave is false)."""
    return raw.get("model_type") == "deepseek_v2" or (raw.get("model_type") == "deepseek_v3"
                                                       and raw.get("rope_interleave", True))


def deinterleave_rope_rows(w: torch.Tensor, heads: int, head_rows: int, rope: int) -> torch.Tensor:
    """w's rows regrouped so that each head's last `rope` rows, in
    interleaved pairs, come evens first, then odds: the rotate-half layout
    (model/rope.py apply_rope) of the same rotation. Queries and keys
    regrouped alike keep every score."""
    w = w.reshape(heads, head_rows, *w.shape[1:]).clone()
    tail = w[:, head_rows - rope:]
    w[:, head_rows - rope:] = torch.cat([tail[:, 0::2], tail[:, 1::2]], dim=1)
    return w.reshape(heads * head_rows, *w.shape[2:])


def _latent_rope_rows(out: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    """De-interleave DeepSeek's RoPE rows of q (q_b_proj or q_proj) and of k_pe (kv_a_proj_with_mqa's last rows)."""
    m = cfg.mla
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}.self_attn."
        q = p + ("q_b_proj.weight" if m.q_lora_rank else "q_proj.weight")
        if q in out:
            out[q] = deinterleave_rope_rows(out[q], cfg.num_heads, m.qk_nope_head_dim + m.qk_rope_head_dim,
                                            m.qk_rope_head_dim)
        if p + "kv_a_proj_with_mqa.weight" in out:
            out[p + "kv_a_proj_with_mqa.weight"] = deinterleave_rope_rows(out[p + "kv_a_proj_with_mqa.weight"], 1,
                                                                          m.row, m.qk_rope_head_dim)


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


def _hf_tensors(d: Path, cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device) -> dict:
    """Every tensor under its HF name in `dtype`, but for a checkpoint's MXFP4
    experts (model/hf_mxfp4.py): QuantizedWeights of their own blocks."""
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
                t = f.get_tensor(name)
                out[name] = t if is_packed(name) else t.to(device=device, dtype=dtype)  # MXFP4 bytes stay bytes
    if cfg.mla is not None and _rope_interleaved(_read_hf_config(d)):
        _latent_rope_rows(out, cfg)
    if cfg.architecture == "gpt_oss":
        split_packed_experts(out, cfg.num_layers)
        _split_stacked_experts(out, cfg)
    return out


def _split_stacked_experts(out: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    """gpt-oss keeps each layer's experts stacked and transposed
    (gate_up_proj [experts, hidden, 2 x size], gate and up columns
    interleaved; down_proj [experts, size, hidden]) with their biases, and
    names its router mlp.router: as one matrix an expert, as every MoE here."""
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}.mlp."
        if p + "experts.gate_up_proj" not in out:
            continue
        gu, gu_b = out.pop(p + "experts.gate_up_proj"), out.pop(p + "experts.gate_up_proj_bias")
        down, down_b = out.pop(p + "experts.down_proj"), out.pop(p + "experts.down_proj_bias")
        for e in range(gu.shape[0]):
            q = f"{p}experts.{e}."
            out[q + "gate_proj.weight"], out[q + "up_proj.weight"] = gu[e, :, 0::2].T.contiguous(), gu[e, :, 1::2].T.contiguous()
            out[q + "gate_proj.bias"], out[q + "up_proj.bias"] = gu_b[e, 0::2].contiguous(), gu_b[e, 1::2].contiguous()
            out[q + "down_proj.weight"], out[q + "down_proj.bias"] = down[e].T.contiguous(), down_b[e]
        out[p + "gate.weight"], out[p + "gate.bias"] = out.pop(p + "router.weight"), out.pop(p + "router.bias")
