"""What llama.cpp's converter writes differently per architecture, read
back into ModelConfig's terms: the routed experts of each MoE family, the
latent attention of deepseek2 files, YaRN RoPE, and the tensor names and
row orders that are not Llama's (model/gguf_reader.py reads the rest).

deepseek2 (DeepSeek V2 / V2-Lite / V3 as llama.cpp's graph runs them): the
file says MQA with one KV head whose key is the latent plus the RoPE key
(key_length = kv_lora_rank + rope dims); the per-head sizes are
key_length_mla / value_length_mla (older files: key_length / value_length
with an unsplit attn_kv_b). kv_b_proj is stored split and transposed for
llama.cpp's absorbed decode (attn_k_b [heads, kv_lora_rank, nope] and
attn_v_b [heads, v, kv_lora_rank], numpy order) and is put back together
here; q's and k_pe's RoPE rows stay in DeepSeek's interleaved pairs (the
converter leaves them, llama.cpp rotates adjacent pairs) and are
de-interleaved as the Hugging Face reader does.

gpt-oss: Q/K/V/O with biases, attention sinks (attn_sinks), the norm before
the experts named post_attention_norm, the router's bias, each expert
projection's rows and biases stacked over experts (gate and up already
split), a window in every other layer starting with the first (llama.cpp's
pattern 2 where the file gives none); the activation and its clamp are
llama.cpp's fixed ones (alpha 1.702, limit 7).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from trajserve.config import MLASpec, MoESpec
from trajserve.model.hf_reader import deinterleave_rope_rows

# llama.cpp's expert_gating_func values (gguf.ExpertGatingFuncType); 0 or
# absent: the architecture's own (softmax for every family read here).
_GATING_SOFTMAX, _GATING_SIGMOID = 1, 2
# Whether the chosen experts' weights are renormalised where a file does not
# say (expert_weights_norm): llama.cpp's graphs hard-code it per architecture.
_NORM_TOPK = {"qwen3moe": True, "olmoe": False, "deepseek2": False, "gpt-oss": False}

# llama.cpp name (after "blk.{i}.") -> HF name (after "model.layers.{i}."), per architecture (ours) beyond Llama's.
LAYER_NAMES = {
    "gemma3": {"ffn_norm.weight": "pre_feedforward_layernorm.weight",
               "post_attention_norm.weight": "post_attention_layernorm.weight",
               "post_ffw_norm.weight": "post_feedforward_layernorm.weight"},
    "deepseek2": {"attn_q_a.weight": "self_attn.q_a_proj.weight",
                  "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
                  "attn_q_b.weight": "self_attn.q_b_proj.weight",
                  "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
                  "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
                  "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
                  "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
                  "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
                  "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
                  "exp_probs_b.bias": "mlp.gate.e_score_correction_bias"},
    "gpt_oss": {"attn_sinks.weight": "self_attn.sinks",
                "post_attention_norm.weight": "post_attention_layernorm.weight",
                "ffn_gate_inp.bias": "mlp.gate.bias"},
}
# A layer's experts, stacked over experts in one tensor each (rows
# [experts, out, in], biases [experts, out]): llama.cpp name -> the HF leaf
# of one expert's (model.layers.i.mlp.experts.e.<leaf>).
EXPERT_NAMES = {"ffn_gate_exps.weight": "gate_proj.weight", "ffn_up_exps.weight": "up_proj.weight",
                "ffn_down_exps.weight": "down_proj.weight", "ffn_gate_exps.bias": "gate_proj.bias",
                "ffn_up_exps.bias": "up_proj.bias", "ffn_down_exps.bias": "down_proj.bias"}
# deepseek2's split kv_b_proj: put back together by merge_kv_b.
KV_B_PARTS = ("attn_k_b.weight", "attn_v_b.weight")

Get = Callable[..., Any]


def moe_spec(arch: str, get: Get, num_layers: int, tensor_names: set[str]) -> MoESpec | None:
    """The routed layers a file describes (None: a dense model)."""
    experts = int(get("expert_count") or 0)
    if not experts:
        return None
    top_k = int(get("expert_used_count", required=True))
    if not 1 <= top_k <= experts:
        raise ValueError(f"GGUF expert_used_count must be in [1, expert_count={experts}], got {top_k}")
    size = int(get("expert_feed_forward_length") or get("feed_forward_length", required=True))
    norm = bool(get("expert_weights_norm", _NORM_TOPK.get(arch, False)))
    if arch == "gpt-oss":  # a softmax over the chosen experts' logits
        return MoESpec(experts, top_k, size, False, tuple(range(num_layers)), scoring="topk_softmax")
    if arch != "deepseek2":  # qwen3moe, olmoe: every layer routes
        return MoESpec(experts, top_k, size, norm, tuple(range(num_layers)))
    first = int(get("leading_dense_block_count") or 0)
    gating = int(get("expert_gating_func") or _GATING_SOFTMAX)
    if gating not in (_GATING_SOFTMAX, _GATING_SIGMOID):
        raise ValueError(f"unsupported GGUF deepseek2.expert_gating_func {gating}; supported: "
                         f"{_GATING_SOFTMAX} (softmax, V2), {_GATING_SIGMOID} (sigmoid, V3)")
    sigmoid = gating == _GATING_SIGMOID
    n_group, topk_group = int(get("expert_group_count") or 1), int(get("expert_group_used_count") or 1)
    if experts % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(f"GGUF expert_group_count {n_group} must divide the {experts} experts and "
                         f"expert_group_used_count {topk_group} be in [1, expert_group_count]")
    # A group's score is what the model was trained with: V2's best expert,
    # V3's best two summed (llama.cpp sums the best two for both).
    return MoESpec(experts, top_k, size, norm, tuple(range(first, num_layers)),
                   int(get("expert_shared_count") or 0) * size, "sigmoid" if sigmoid else "softmax",
                   f"blk.{first}.exp_probs_b.bias" in tensor_names, n_group, topk_group,
                   "top2" if sigmoid else "max", float(get("expert_weights_scale") or 1.0))


def mla_spec(get: Get) -> MLASpec:
    """deepseek2's latent attention."""
    rank, rope = int(get("attention.kv_lora_rank", required=True)), int(get("rope.dimension_count", required=True))
    if get("attention.key_length_mla") is not None:
        qk, v = int(get("attention.key_length_mla")), int(get("attention.value_length_mla", required=True))
    else:  # files from before attn_kv_b was split
        qk, v = int(get("attention.key_length", required=True)), int(get("attention.value_length", required=True))
    if qk <= rope:
        raise ValueError(f"GGUF deepseek2 key length {qk} must exceed its {rope} RoPE dims")
    return MLASpec(rank, rope, qk - rope, v, int(get("attention.q_lora_rank") or 0))


def yarn_scaling(arch: str, get: Get) -> dict:
    """rope_scaling for rope.scaling.type yarn. llama.cpp always truncates
    the ramp's ends to whole dimensions (transformers' truncate=True), so a
    file is read that way whatever its source config said. deepseek2's
    yarn_log_multiplier is 0.1 x mscale_all_dim (its converter's
    convention), the rotation's mscale equal to it."""
    out = {"rope_type": "yarn", "factor": float(get("rope.scaling.factor", required=True)),
           "original_max_position_embeddings": int(get("rope.scaling.original_context_length", required=True))}
    for key, ours in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                      ("yarn_attn_factor", "attention_factor")):
        if get(f"rope.scaling.{key}") is not None:
            out[ours] = float(get(f"rope.scaling.{key}"))
    log_mul = get("rope.scaling.yarn_log_multiplier")
    if log_mul:
        if arch != "deepseek2":
            raise ValueError(f"unsupported GGUF rope.scaling.yarn_log_multiplier in a {arch} file; "
                             "supported: deepseek2's")
        out["mscale"] = out["mscale_all_dim"] = float(log_mul) / 0.1
    return out


def merge_kv_b(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """kv_b_proj [heads x (nope + v), kv_lora_rank] from llama.cpp's
    attn_k_b [heads, kv_lora_rank, nope] and attn_v_b [heads, v, kv_lora_rank]."""
    heads = k_b.shape[0]
    return np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(heads * (k_b.shape[2] + v_b.shape[1]), -1)


def rope_rows(arch: str, hf: str, a: np.ndarray, heads: int, kv_heads: int, mla: MLASpec | None) -> np.ndarray:
    """A Q or K matrix's rows in the rotate-half order the model applies RoPE in."""
    if arch == "llama" and ".self_attn.q_proj." in hf:
        return unpermute_llama_rows(a, heads)
    if arch == "llama" and ".self_attn.k_proj." in hf:
        return unpermute_llama_rows(a, kv_heads)
    if arch == "deepseek2" and mla is not None:  # as from a Hugging Face directory; rows (of blocks) move whole
        n = heads if hf.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")) else 1
        if n > 1 or hf.endswith("self_attn.kv_a_proj_with_mqa.weight"):
            return deinterleave_rope_rows(torch.from_numpy(np.array(a)), n, a.shape[0] // n,
                                          mla.qk_rope_head_dim).numpy()
    return a  # qwen2/qwen3/gemma3/gpt-oss: llama.cpp's NEOX RoPE is rotate-half already


def unpermute_llama_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation for its interleaved RoPE.

    The converter regroups each head's rows from [x0..x_{d/2-1}, y0..] (HF
    rotate_half pairs i with i+d/2) into [x0, y0, x1, y1, ...] (adjacent pairs):
    reshape(n_head, 2, d/2).swapaxes(1, 2). Swapping back is its inverse.
    """
    rest = w.shape[1:]
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)
