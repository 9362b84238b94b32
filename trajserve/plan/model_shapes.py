"""Parameter counts from a model's shapes, and reading a model's shapes from a
Hugging Face config.json or a GGUF file (metadata only, no weights).

Three counts matter and the spec uses each:
  total params        -> resident weights (eq. 4, kv-cache-management)
  matmul params       -> prefill FLOPs, 2 N per token (projections of every
                         layer; the embedding lookup is not a matmul and the
                         LM head runs on the last prompt token only)
  decode-read params  -> bytes one decode step reads: everything but the
                         input embedding (inference-optimization 8.2.1: D_w)

A mixture-of-experts layer counts all its experts in the total (they are
resident) and its top_k experts (plus any shared one) in the matmul and
decode-read counts: what one token multiplies by, what a decode step at
batch 1 reads. Latent attention (MLA) counts its own projections.
"""
from __future__ import annotations

import json
from pathlib import Path

from trajserve.config import MLASpec, ModelConfig, MoESpec, WindowSpec


# A decoder layer's projections (PEFT's target_modules names), SwiGLU MLP.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def projection_shape(c: ModelConfig, name: str) -> tuple[int, int]:
    """(in, out) features of one layer's projection `name` (one of PROJECTIONS)."""
    q, kv, h, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size, c.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}[name]


def _attention_params(c: ModelConfig) -> int:
    h, heads, m = c.hidden_size, c.num_heads, c.mla
    if m is None:
        return sum(i * o for i, o in (projection_shape(c, p) for p in PROJECTIONS[:4]))
    qk = heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)
    q = h * m.q_lora_rank + m.q_lora_rank * qk if m.q_lora_rank else h * qk
    kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
    return q + kv + heads * m.v_head_dim * h


def _mlp_params(c: ModelConfig, layer: int, active: bool) -> int:
    """The layer's MLP matrices (SwiGLU: 3 * hidden * intermediate); a routed
    layer's: its router, its experts (top_k of them when active) and any
    shared expert."""
    moe, h = c.moe, c.hidden_size
    if moe is None or layer not in moe.layers:
        return 3 * h * c.intermediate_size
    experts = moe.top_k if active else moe.num_experts
    return h * moe.num_experts + 3 * h * (experts * moe.expert_size + moe.shared_size)


def _layer_matmul_params(c: ModelConfig, layer: int, active: bool) -> int:
    return _attention_params(c) + _mlp_params(c, layer, active)


def _layer_other_params(c: ModelConfig, layer: int, active: bool) -> int:
    """Norms, biases and sinks: what the products do not multiply by."""
    qk = (c.num_heads + c.num_kv_heads) * c.head_dim if c.qk_norm_whole else 2 * c.head_dim
    norms = 2 * c.hidden_size + (qk if c.qk_norm else 0)
    if c.mla is not None:  # the latent's and the query bottleneck's norms
        norms += c.mla.kv_lora_rank + c.mla.q_lora_rank
    bias = 0
    if c.attention_bias:  # q, k, v; and o but on Qwen2 (transformers biases o_proj with attention_bias)
        bias = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + (c.hidden_size if c.architecture != "qwen2" else 0)
    if c.mlp_bias:  # gate, up and down of each expert (of a routed layer's router too), or of the dense MLP
        moe = c.moe
        if moe is not None and layer in moe.layers:
            bias += moe.num_experts + (moe.top_k if active else moe.num_experts) * (2 * moe.expert_size + c.hidden_size)
        else:
            bias += 2 * c.intermediate_size + c.hidden_size
    return norms + bias + (c.num_heads if c.attn_sinks else 0)


def matmul_params(c: ModelConfig) -> int:
    """What one token multiplies by (a MoE layer's chosen experts only)."""
    return sum(_layer_matmul_params(c, i, active=True) for i in range(c.num_layers))


def embedding_params(c: ModelConfig) -> int:
    return c.vocab_size * c.hidden_size


def lm_head_params(c: ModelConfig) -> int:
    return embedding_params(c)  # tied or not, the head multiplies by a vocab x hidden matrix


def _params(c: ModelConfig, active: bool) -> int:
    head = 0 if c.tie_word_embeddings else lm_head_params(c)
    return (sum(_layer_matmul_params(c, i, active) + _layer_other_params(c, i, active) for i in range(c.num_layers))
            + embedding_params(c) + head + c.hidden_size)  # + final norm


def total_params(c: ModelConfig) -> int:
    return _params(c, active=False)


def active_params(c: ModelConfig) -> int:
    """total_params with a MoE layer's top_k experts only (a "30B-A3B" model's 3B)."""
    return _params(c, active=True)


def decode_read_params(c: ModelConfig) -> int:
    """Parameters a decode step at batch 1 streams from memory: all but the
    embedding table (only one row per token is read), a MoE layer's chosen
    experts only. A tied head is read as the head."""
    other = active_params(c) - embedding_params(c)
    return other + (lm_head_params(c) if c.tie_word_embeddings else 0)


# ---------------------------------------------------------------- reading


def read_hf_config(path: str | Path) -> tuple[ModelConfig, str, bool]:
    """A config.json (or a directory holding one) -> (shapes, dtype name,
    whether it gives the trained context: max_position_embeddings).

    Lenient on purpose: planning needs shapes, not a model the engine can
    run, so any decoder with the usual fields is accepted, routed experts
    (MoESpec.from_hf), latent attention (kv_lora_rank) and sliding windows (_window)
    included.
    """
    p = Path(path).expanduser()
    f = p / "config.json" if p.is_dir() else p
    if not f.is_file():
        raise ValueError(f"model {str(path)!r}: no such config.json (or directory containing one)")
    try:
        raw = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"model config {str(f)!r} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"model config {str(f)!r} is not a JSON object")
    raw = raw.get("text_config", raw)  # multimodal wrappers nest the decoder
    missing = [k for k in ("num_hidden_layers", "num_attention_heads", "hidden_size") if k not in raw]
    if missing:
        raise ValueError(f"model config {str(f)!r} lacks {', '.join(missing)}")
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    sizes = {"num_hidden_layers": int(raw["num_hidden_layers"]), "num_attention_heads": heads,
             "num_key_value_heads": kv_heads, "hidden_size": hidden}
    bad = next((k for k, v in sizes.items() if v < 1), None)
    if bad is not None:
        raise ValueError(f"model config {str(f)!r}: {bad} must be >= 1, got {sizes[bad]}")
    if heads % kv_heads:
        raise ValueError(f"model config {str(f)!r}: num_attention_heads ({heads}) is not a multiple of "
                         f"num_key_value_heads ({kv_heads}): no grouped-query attention splits them so")
    if raw.get("head_dim") is not None and int(raw["head_dim"]) < 1:
        raise ValueError(f"model config {str(f)!r}: head_dim must be >= 1, got {raw['head_dim']}")
    if not raw.get("head_dim") and hidden % heads:
        raise ValueError(f"model config {str(f)!r}: hidden_size ({hidden}) is not a multiple of "
                         f"num_attention_heads ({heads}) and no head_dim is given")
    model_type = str(raw.get("model_type", "llama"))
    cfg = ModelConfig(
        architecture=model_type,
        vocab_size=int(raw.get("vocab_size", 0)),
        hidden_size=hidden,
        intermediate_size=int(raw.get("intermediate_size", 4 * hidden)),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(raw.get("head_dim") or hidden // heads),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
        attn_sinks=model_type == "gpt_oss",
        mlp_bias=model_type == "gpt_oss",
        qk_norm=model_type in ("qwen3", "qwen3_moe", "olmoe"),
        qk_norm_whole=model_type == "olmoe",
        moe=MoESpec.from_hf(raw, int(raw["num_hidden_layers"])),
        mla=MLASpec.from_hf(raw),
        window=WindowSpec.from_hf(raw, int(raw["num_hidden_layers"])),
        name=str(raw.get("_name_or_path") or f.parent.name),
    )
    dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16")
    return cfg, dtype, "max_position_embeddings" in raw  # without it, 2048 above is only a stand-in


def read_gguf_config(path: str | Path) -> ModelConfig:
    """GGUF metadata through the engine's own reader (no tensor data is read)."""
    from trajserve.model.loader import load_model_config  # imports torch: only when a GGUF is asked for

    return load_model_config(str(path))
