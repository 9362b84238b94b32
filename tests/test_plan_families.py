"""The planner beyond dense full attention (config MoESpec / MLASpec /
WindowSpec, plan/model_shapes.py): latent attention's m_token (the chapter's
DeepSeek-V3: (512 + 64) x 61 x 2 = 70,272 B a token, 549 MiB at 8K), sliding
windows' bytes per sequence (Gemma 3's 5:1 layout), routed experts' total
and active parameters, and config.json files of each family read with
parameter counts equal to transformers' own."""
from __future__ import annotations

import pytest

from trajserve.plan import memory_budget, model_shapes
from trajserve.plan.catalog import get_model
from trajserve.plan.kv_format import m_token
from trajserve.plan.planner import PlanRequest, plan

MIB = 2**20


def test_deepseek_v3_caches_a_latent_not_heads():
    cfg = get_model("deepseek-v3").config
    assert m_token(cfg, "bf16") == (512 + 64) * 61 * 2 == 70_272  # kv-cache-management's figure
    assert cfg.kv_bytes(8192, 2) / MIB == 549.0  # inference-optimization 8.4.2's compact MLA state at 8K
    # Per-head K and V for its 128 heads would be 2 * 128 * 128 values a layer: the latent is 57x smaller.
    assert 2 * 128 * 128 / (512 + 64) > 56
    assert memory_budget.kv_share_per_device(cfg, tp=8, pp=1) == 1.0  # no head to split: every rank holds it
    assert memory_budget.kv_share_per_device(cfg, tp=8, pp=61) == 1 / 61
    total, active = model_shapes.total_params(cfg), model_shapes.active_params(cfg)
    assert 670e9 < total < 672e9 and 37e9 < active < 38e9  # "671B total, 37B activated"
    assert model_shapes.decode_read_params(cfg) < active  # a decode step reads the chosen experts only


def test_gemma_3_keeps_a_window_in_five_layers_of_six():
    cfg = get_model("gemma-3-27b").config
    assert len(cfg.window.layers) == 52 and cfg.window.size == 1024  # 62 layers: 10 global
    per_layer = cfg.kv_bytes_per_token(2) // 62
    for tokens in (512, 1024, 8192, 32768):
        assert cfg.kv_bytes(tokens, 2) == per_layer * (10 * tokens + 52 * min(tokens, 1024))
    assert cfg.kv_bytes(512, 2) == cfg.kv_bytes_per_token(2) * 512  # inside the window: eq. 1 as it is
    twin = type(cfg)(**{**{f: getattr(cfg, f) for f in cfg.__slots__}, "window": None})
    ratio = twin.kv_bytes(8192, 2) / cfg.kv_bytes(8192, 2)
    assert ratio == pytest.approx(62 * 8192 / (10 * 8192 + 52 * 1024))  # 3.76x at 8K, growing with context
    assert twin.kv_bytes(32768, 2) / cfg.kv_bytes(32768, 2) > 5
    # The planner's trajectories per pool follow: at 8K the window model holds ~3.7x its all-global twin.
    spec = get_model("gemma-3-27b")
    rows = [plan(PlanRequest(model=m, device=_h100(), contexts=[8192], output_tokens=0)).rows[0]
            for m in (spec, type(spec)(**{**_fields(spec), "config": twin}))]
    assert rows[0].max_unshared >= 3.5 * rows[1].max_unshared
    assert rows[0].kv_bytes == pytest.approx(rows[1].kv_bytes / ratio)


def test_gpt_oss_alternates_windows_and_routes_four_of_128_experts():
    cfg = get_model("gpt-oss-120b").config
    assert cfg.window.layers == tuple(range(0, 36, 2)) and cfg.window.size == 128
    assert cfg.moe.top_k == 4 and len(cfg.moe.layers) == 36
    assert 116e9 < model_shapes.total_params(cfg) < 118e9
    assert model_shapes.matmul_params(cfg) < 0.05 * model_shapes.total_params(cfg)  # 2N FLOPs: active N


def test_qwen3_30b_a3b_is_3b_active():
    cfg = get_model("qwen3-30b-a3b").config
    assert 30e9 < model_shapes.total_params(cfg) < 31e9 and 3e9 < model_shapes.active_params(cfg) < 3.5e9
    assert m_token(cfg, "bf16") == 2 * 48 * 4 * 128 * 2  # attention is dense GQA: eq. 1 unchanged


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "deepseek_v3", "gemma3_text", "qwen2_window", "gpt_oss",
                                    "llama_bias"])
def test_config_json_of_each_family_counts_as_transformers(tmp_path, family):
    """A tiny config of the family, written by transformers: the planner
    reads it, and its parameter count is the model's own (every tensor)."""
    import transformers as tf

    common = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    made = {
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, dict(num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, head_dim=16, mlp_only_layers=[1], decoder_sparse_step=1)),
        "olmoe": (tf.OlmoeConfig, tf.OlmoeForCausalLM, dict(num_experts=8, num_experts_per_tok=2)),
        "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM, dict(
            n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, kv_lora_rank=32, q_lora_rank=48,
            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=1, n_shared_experts=1,
            n_group=1, topk_group=1, num_key_value_heads=4)),
        "gemma3_text": (tf.Gemma3TextConfig, None, dict(sliding_window=16, head_dim=16)),
        "qwen2_window": (tf.Qwen2Config, tf.Qwen2ForCausalLM, dict(use_sliding_window=True, sliding_window=16,
                                                                  max_window_layers=2)),
        # sinks, q/k/v/o biases, the router's and every expert's biases
        "gpt_oss": (tf.GptOssConfig, tf.GptOssForCausalLM, dict(num_local_experts=8, num_experts_per_tok=2,
                                                                head_dim=16, sliding_window=16)),
        "llama_bias": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(attention_bias=True)),  # o_proj's bias too
    }
    config_cls, model_cls, extra = made[family]
    config = config_cls(**{**common, **extra})
    config.save_pretrained(tmp_path)
    cfg, _, _ = model_shapes.read_hf_config(tmp_path)
    if family == "deepseek_v3":
        assert m_token(cfg, "bf16") == (32 + 8) * 6 * 2 and cfg.moe.layers == (1, 2, 3, 4, 5)
    if family == "gemma3_text":  # every 6th layer global (layer_types as transformers writes them)
        assert cfg.window.layers == (0, 1, 2, 3, 4) and cfg.window.size == 16
        return  # its extra norms (pre/post feed-forward) are not counted: shapes only
    if family == "qwen2_window":
        assert cfg.window.layers == (2, 3, 4, 5)
    if family in ("qwen3_moe", "olmoe"):
        assert cfg.moe.num_experts == 8 and cfg.moe.top_k == 2
    model = model_cls(config)
    assert model_shapes.total_params(cfg) == sum(p.numel() for p in model.parameters())


def _h100():
    from trajserve.plan.catalog import get_device
    return get_device("h100")


def _fields(spec) -> dict:
    return {f: getattr(spec, f) for f in spec.__slots__}


def test_the_simulators_cost_model_reads_only_active_experts():
    from trajserve.sim.hardware import ModelCost

    spec = get_model("qwen3-30b-a3b")
    cost = ModelCost.from_spec(spec)
    assert cost.weight_read_bytes == model_shapes.decode_read_params(spec.config) * 2  # bf16
    assert cost.weight_read_bytes < 0.15 * spec.params * 2  # not the 30B resident
    assert cost.matmul_params == model_shapes.matmul_params(spec.config)
    # A profile round-trips the nested shapes (a calibrated profile of such a model).
    back = ModelCost.from_profile({"model": cost.to_profile()})
    assert back.config == spec.config
    mla = ModelCost.from_spec(get_model("deepseek-v3"))
    assert ModelCost.from_profile({"model": mla.to_profile()}).config == mla.config
