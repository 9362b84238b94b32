"""Tiny random Hugging Face models for loader and reference tests."""
from __future__ import annotations

import torch


def tiny_hf_model(kind: str, tie: bool = False, **overrides) -> torch.nn.Module:
    """A 2-layer random model; norms and biases randomized too, so a norm
    loaded into the wrong slot (or left at its init of ones) shows."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
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
    args.update(overrides)
    torch.manual_seed(0)
    model = model_cls(config_cls(**args))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.normal_()
    return model.eval()
