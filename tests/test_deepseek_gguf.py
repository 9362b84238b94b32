"""DeepSeek V2 / V3 GGUF files as llama.cpp's converter writes them
(architecture deepseek2: one "KV head" holding the latent and the RoPE key,
the per-head sizes as key_length_mla / value_length_mla, kv_b_proj split
into attn_k_b (transposed) and attn_v_b, RoPE rows left in DeepSeek's
interleaved pairs, the leading dense layers, shared experts, the router's
gating function and groups, V3's correction bias, YaRN's log multiplier as
0.1 x mscale_all_dim): logits as transformers computes them, over a chunked
prefill and a decode, with the C kernels and with torch; quantized files as
their dequantized selves."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from greedy_runs import assert_served_as_transformers_generates
from test_loader import add_test_vocabulary, finish_gguf, gguf_header, hf_params
from test_reference_hf_tiny import chunked_logits
from tiny_models import tiny_hf_model
from trajserve.model.llama import LlamaModel
from trajserve.model.loader import load_weights
from trajserve.model.quant import QuantizedWeight

F32, Q8_0 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0
# HF name (after model.layers.i.) -> llama.cpp's, written here independently of the loader's tables.
LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
         "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_a_proj.weight": "attn_q_a.weight",
         "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight", "self_attn.q_b_proj.weight": "attn_q_b.weight",
         "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
         "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight", "self_attn.o_proj.weight": "attn_output.weight",
         "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
         "mlp.down_proj.weight": "ffn_down.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
         "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
         "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
         "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
         "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight"}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707, "rope_theta": 10000.0}


def write_deepseek_gguf(path, model, kind: str, qtype=F32, split_kv_b: bool = True,
                        skip: frozenset[str] = frozenset(), gating: int | None = None) -> None:
    """`skip`: metadata keys (without the architecture) and tensors left out; `gating`: another gating function."""
    c = model.config
    a = "deepseek2"
    w = gguf.GGUFWriter(str(path), a)
    gguf_header(w, c, head_count_kv=1)  # MLA written as MQA
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_expert_count(c.n_routed_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_group_count(c.n_group)
    w.add_expert_group_used_count(c.topk_group)
    # The converter writes the config's scoring_func: V2's softmax, V3's sigmoid.
    w.add_uint32(f"{a}.expert_gating_func", gating or (gguf.ExpertGatingFuncType.SIGMOID if kind == "deepseek_v3"
                                                       else gguf.ExpertGatingFuncType.SOFTMAX))
    w.add_leading_dense_block_count(c.first_k_dense_replace)
    w.add_vocab_size(c.vocab_size)
    if c.q_lora_rank:
        w.add_q_lora_rank(c.q_lora_rank)
    if "attention.kv_lora_rank" not in skip:
        w.add_kv_lora_rank(c.kv_lora_rank)
    if split_kv_b:
        w.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
        w.add_value_length(c.kv_lora_rank)
        w.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
        w.add_value_length_mla(c.v_head_dim)
    else:  # a file from before the split
        w.add_key_length(c.qk_nope_head_dim + c.qk_rope_head_dim)
        w.add_value_length(c.v_head_dim)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_shared_count(c.n_shared_experts)
    w.add_expert_weights_scale(c.routed_scaling_factor)
    if c.norm_topk_prob and kind == "deepseek_v3":
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(c.qk_rope_head_dim)
    rope = c.rope_parameters
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])

    def add(name: str, arr: np.ndarray) -> None:
        if name in skip:
            return
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if qtype != F32 and arr.ndim >= 2 and arr.shape[-1] % 32 == 0:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, arr)

    params = {k: v.detach().float().numpy() for k, v in hf_params(model).items()}
    heads, nope, v = c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        kv_b = params.pop(p + "self_attn.kv_b_proj.weight")
        if split_kv_b:
            k_b, v_b = np.split(kv_b.reshape(heads, nope + v, -1), [nope], axis=1)
            add(f"blk.{i}.attn_k_b.weight", k_b.transpose(0, 2, 1))
            add(f"blk.{i}.attn_v_b.weight", v_b)
        else:
            add(f"blk.{i}.attn_kv_b.weight", kv_b)
        if p + "mlp.experts.gate_up_proj" in params:  # transformers 5: gate|up [E, 2I, H], down [E, H, I]
            gate_up = params.pop(p + "mlp.experts.gate_up_proj")
            inter = gate_up.shape[1] // 2
            add(f"blk.{i}.ffn_gate_exps.weight", gate_up[:, :inter])
            add(f"blk.{i}.ffn_up_exps.weight", gate_up[:, inter:])
            add(f"blk.{i}.ffn_down_exps.weight", params.pop(p + "mlp.experts.down_proj"))
    for name, arr in params.items():
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            add(f"blk.{layer}.{LAYER[rest]}", arr)
        else:
            add({"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}[name], arr)
    add_test_vocabulary(w, c.vocab_size)
    finish_gguf(w)


def _logits_agree(cfg, weights, hf, cpu_kernels: bool, atol: float) -> None:
    model = LlamaModel(cfg, weights, 256, torch.float32, "cpu", use_cpu_kernels=cpu_kernels)
    torch.manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (40,)).tolist()
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(chunked_logits(model, ids), ref, atol=atol, rtol=atol)


@pytest.mark.parametrize("kind, overrides, split", [
    ("deepseek_v2", {}, True),
    ("deepseek_v2", {"rope_parameters": YARN, "q_lora_rank": None}, False),  # V2-Lite's shape: no q bottleneck, YaRN
    ("deepseek_v3", {}, True),
])
@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["c-kernels", "torch"])
def test_a_deepseek_gguf_scores_as_transformers(tmp_path, kind, overrides, split, cpu_kernels):
    hf = tiny_hf_model(kind, num_hidden_layers=3, **overrides)
    path = tmp_path / "ds.gguf"
    write_deepseek_gguf(path, hf, kind, split_kv_b=split)
    cfg, weights = load_weights(path, torch.float32, "cpu")
    c = hf.config
    assert cfg.architecture == "deepseek2" and cfg.num_kv_heads == c.num_attention_heads
    assert (cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim, cfg.mla.qk_nope_head_dim, cfg.mla.v_head_dim,
            cfg.mla.q_lora_rank) == (32, 8, 16, 16, c.q_lora_rank or 0)
    moe = cfg.moe
    assert moe.layers == (1, 2) and moe.shared_size == 32 and moe.top_k == c.num_experts_per_tok
    assert (moe.scoring, moe.score_bias, moe.group_score) == (
        ("sigmoid", True, "top2") if kind == "deepseek_v3" else ("softmax", False, "max"))
    assert (moe.n_group, moe.topk_group, moe.routed_scale) == (c.n_group, c.topk_group, c.routed_scaling_factor)
    if "rope_parameters" in overrides:
        assert cfg.rope_scaling["mscale_all_dim"] == pytest.approx(0.707)
    _logits_agree(cfg, weights, hf, cpu_kernels, 1e-4)


def test_a_q8_0_deepseek_gguf_is_its_dequantized_self(tmp_path):
    """Every matrix of a blockable width in Q8_0, the experts kept as
    stored: logits as transformers gives for the file's values (the model's
    weights rounded to Q8_0 first, so the file holds them exactly), through
    torch's products of the dequantized weights. (The C kernels' q8_0
    products also round the activations, which on this tiny model flips a
    router's near-ties: their bounds are tests/test_quant_kernels.py's.)"""
    hf = tiny_hf_model("deepseek_v3", num_hidden_layers=3)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() >= 2 and p.shape[-1] % 32 == 0:
                a = p.detach().float().numpy()
                p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(a, Q8_0), Q8_0).reshape(a.shape)))
    path = tmp_path / "q.gguf"
    write_deepseek_gguf(path, hf, "deepseek_v3", Q8_0)
    cfg, weights = load_weights(path, torch.float32, "cpu", quantization="auto")
    down = weights["model.layers.1.mlp.experts.3.down_proj.weight"]
    assert isinstance(down, QuantizedWeight) and down.fmt == "q8_0"  # as stored
    _logits_agree(cfg, weights, hf, False, 1e-4)


@pytest.mark.parametrize("change, message", [
    ({"skip": frozenset({"attention.kv_lora_rank"})}, "GGUF metadata lacks deepseek2.attention.kv_lora_rank"),
    ({"skip": frozenset({"blk.1.attn_v_b.weight"})}, "GGUF layer 1 has attn_k_b.weight without attn_v_b.weight"),
    ({"gating": 3}, "unsupported GGUF deepseek2.expert_gating_func 3; supported: 1 .softmax, V2., 2"),
])
def test_what_a_deepseek_gguf_lacks_or_the_engine_does_not_run_is_named(tmp_path, change, message):
    hf = tiny_hf_model("deepseek_v2", num_hidden_layers=2)
    path = tmp_path / "ds.gguf"
    write_deepseek_gguf(path, hf, "deepseek_v2", **change)
    with pytest.raises(ValueError, match=message):
        load_weights(path, torch.float32, "cpu")


def test_the_engine_serves_a_deepseek_gguf_as_transformers_generates(tmp_path):
    """A deepseek2 GGUF through the engine: greedy_runs.assert_served_as_transformers_generates."""
    hf = tiny_hf_model("deepseek_v3", num_hidden_layers=3)
    path = tmp_path / "ds.gguf"
    write_deepseek_gguf(path, hf, "deepseek_v3")
    assert_served_as_transformers_generates(path, hf)
