"""Tiny random Hugging Face models for loader and reference tests."""
from __future__ import annotations

import torch


def tiny_hf_model(kind: str, tie: bool = False, **overrides) -> torch.nn.Module:
    """A 2-layer random model; norms and biases randomized too, so a norm
    loaded into the wrong slot (or left at its init of ones) shows."""
    from transformers import (
        DeepseekV2Config,
        DeepseekV2ForCausalLM,
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        Gemma3ForCausalLM,
        GptOssConfig,
        GptOssForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        MistralForCausalLM,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        OlmoeConfig,
        OlmoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        # 8 experts of 32, 2 chosen per token, in every layer unless overridden
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
        # q/k RMSNorm over all heads together, q/k/v clamped; 8 experts of 32, 2 a token
        "olmoe": (OlmoeConfig, OlmoeForCausalLM),
        # every layer a sliding window of 8 tokens
        "mistral": (MistralConfig, MistralForCausalLM),
        # 4 layers, the third global: windows of 8 with their own RoPE base, a
        # linearly scaled global RoPE, (1 + w) norms, sandwich norms, GELU,
        # queries scaled by query_pre_attn_scalar, soft-capped logits
        "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
        # latent attention (a latent of 32, RoPE keys of 8, a q bottleneck of
        # 48), layer 0 dense, the next routed: 8 experts of 32, grouped, one
        # shared expert
        "deepseek_v2": (DeepseekV2Config, DeepseekV2ForCausalLM),
        # V3's router: sigmoid scores, a correction bias, renormalised weights
        "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM),
        # windows of 8 and global layers alternating, each head a sink, q/k/v/o
        # biases, 8 experts of 32 (2 a token) with biases and the clamped
        # SwiGLU, a router with a bias, YaRN RoPE
        "gpt_oss": (GptOssConfig, GptOssForCausalLM),
    }
    config_cls, model_cls = classes[kind]
    args = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
    )
    if kind == "qwen3_moe":
        args.update(head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    if kind == "mistral":
        args.update(sliding_window=8)
    if kind == "gemma3":
        args.update(num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                     "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                        "rope_theta": 1000000.0}},
                    final_logit_softcapping=5.0)
    if kind in ("deepseek_v2", "deepseek_v3"):
        args.update(num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16,
                    v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                    n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2)
        # V2: 3 experts a token, all from the best of 2 groups (top_k 2 from 2 groups never differs from no groups)
        args.update({"deepseek_v2": dict(topk_method="group_limited_greedy", routed_scaling_factor=1.5, n_group=2,
                                         topk_group=1, num_experts_per_tok=3),
                     "deepseek_v3": dict(norm_topk_prob=True, routed_scaling_factor=2.5)}[kind])
    if kind == "gpt_oss":
        args.update(intermediate_size=32, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
                    swiglu_limit=1.0,  # small enough that the clamps act on these weights
                    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                     "beta_fast": 32.0, "beta_slow": 1.0, "rope_theta": 150000.0, "truncate": False})
    if kind == "olmoe":
        args.update(intermediate_size=32, num_experts=8, num_experts_per_tok=2, clip_qkv=0.5, eos_token_id=None,
                    pad_token_id=None, bos_token_id=None)
    args.update(overrides)
    torch.manual_seed(0)
    model = model_cls(config_cls(**args))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith((".bias", "_bias", ".sinks")):
                p.normal_()
            elif ".experts." in name or name.endswith("mlp.gate.weight"):
                p.normal_(std=0.2)  # experts that move the logits, a router that tells them apart
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek V3: a bias that changes the choice
                b.normal_(std=0.1)
    return model.eval()


def save_with_tokenizer(model: torch.nn.Module, d) -> None:
    """The model as a Hugging Face directory an engine can load: weights, and
    a word-level tokenizer ("t0" .. "t{vocab-1}"; the last is EOS)."""
    import json

    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = model.config.vocab_size
    model.save_pretrained(d, safe_serialization=True)
    Tokenizer(WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0")).save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": f"t{vocab - 1}"}))


ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def random_adapter(base: torch.nn.Module, d, seed: int, targets=tuple(ALL_PROJECTIONS), r: int = 4,
                   alpha: float = 8, std: float = 0.2) -> torch.nn.Module:
    """A PEFT LoRA adapter on a copy of `base`, saved to d, with random A and
    B (PEFT starts B at zero: a no-op adapter would prove nothing). Returns
    the PEFT model (its forward is the reference)."""
    import copy

    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                                                           lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    model.save_pretrained(d)
    return model.eval()
