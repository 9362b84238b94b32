"""Gemma 3 GGUF files as llama.cpp's converter writes them (architecture
gemma3: norms stored with Gemma's + 1, ffn_norm the norm before the MLP,
post_attention_norm / post_ffw_norm on the outputs, the sliding window and
its per-layer pattern, a linearly scaled global RoPE, soft-capped logits):
logits as transformers computes them, over a chunked prefill and a decode."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from test_loader import hf_params
from test_reference_hf_tiny import chunked_logits
from tiny_models import tiny_hf_model
from trajserve.model.llama import LlamaModel
from trajserve.model.loader import load_weights

# HF name (after model.layers.i.) -> llama.cpp's, written here independently of the loader's table.
LAYER = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
         "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
         "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
         "self_attn.k_norm.weight": "attn_k_norm.weight",
         "post_attention_layernorm.weight": "post_attention_norm.weight",
         "pre_feedforward_layernorm.weight": "ffn_norm.weight",
         "post_feedforward_layernorm.weight": "post_ffw_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
         "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}


def write_gemma3_gguf(path, model, pattern: list[bool] | None) -> None:
    c = model.config
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    full = c.rope_parameters["full_attention"]
    w.add_rope_freq_base(full["rope_theta"])
    if full["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    if c.final_logit_softcapping:
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    w.add_sliding_window(c.sliding_window)
    if pattern is not None:
        w.add_array("gemma3.attention.sliding_window_pattern", pattern)
    for name, t in hf_params(model).items():
        a = t.detach().float().numpy()
        if name.endswith("norm.weight"):
            a = a + 1.0  # the converter's norm_shift
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            out = f"blk.{layer}.{LAYER[rest]}"
        else:
            out = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}[name]
        w.add_tensor(out, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("layer_types, pattern", [
    (["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"], [True, True, False, True]),
    (["sliding_attention"] * 4, None),  # no pattern in the file: llama.cpp's 6 (every 6th layer global)
])
@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["c-kernels", "torch"])
def test_a_gemma3_gguf_scores_as_transformers(tmp_path, layer_types, pattern, cpu_kernels):
    # llama.cpp derives the query scale from the head size (its file does not
    # carry query_pre_attn_scalar): a model whose scalar is its head_dim.
    hf = tiny_hf_model("gemma3", tie=True, query_pre_attn_scalar=16, layer_types=layer_types)
    path = tmp_path / "gemma3.gguf"
    write_gemma3_gguf(path, hf, pattern)
    cfg, weights = load_weights(path, torch.float32, "cpu")
    assert cfg.architecture == "gemma3" and cfg.window.size == 8
    assert cfg.window.layers == tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0} and cfg.final_logit_softcap == 5.0
    model = LlamaModel(cfg, weights, 256, torch.float32, "cpu", use_cpu_kernels=cpu_kernels)
    torch.manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (90,)).tolist()
    logits = chunked_logits(model, ids)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
