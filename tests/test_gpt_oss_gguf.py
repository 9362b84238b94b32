"""gpt-oss GGUF files as llama.cpp's converter writes them (architecture
gpt-oss: biased Q/K/V/O, attention sinks, post_attention_norm before the
experts, a biased router, each expert projection's rows and biases stacked
over experts with gate and up split, a window in every other layer, YaRN,
experts in MXFP4 as the release ships them): logits as transformers
computes them, over a chunked prefill and a decode."""
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
from trajserve.model.loader import load_model_config, load_weights

F32, MXFP4 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.MXFP4
# HF name (after model.layers.i.) -> llama.cpp's, written here independently of the loader's tables.
LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
         "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
         "mlp.router.bias": "ffn_gate_inp.bias",
         **{f"self_attn.{x}_proj.{kind}": f"attn_{n}.{kind}" for x, n in (("q", "q"), ("k", "k"), ("v", "v"),
                                                                          ("o", "output"))
            for kind in ("weight", "bias")}}
# llama.cpp truncates YaRN's ramp to whole dimensions whatever the config said (transformers' truncate=True).
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
        "beta_slow": 1.0, "rope_theta": 150000.0, "truncate": True}


def tiny_gpt_oss(**overrides) -> torch.nn.Module:
    """The tiny gpt-oss with the clamp llama.cpp fixes (7: files do not
    carry it) and experts strong enough that it acts."""
    hf = tiny_hf_model("gpt_oss", rope_parameters=YARN, swiglu_limit=7.0, **overrides)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("gate_up_proj"):
                p.mul_(20)
    return hf


def write_gpt_oss_gguf(path, model, experts_type=F32, pattern: list[bool] | None = None,
                       swa_theta: float | None = None) -> None:
    c = model.config
    a = "gpt-oss"
    w = gguf.GGUFWriter(str(path), a)
    gguf_header(w, c)
    w.add_expert_count(c.num_local_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_sliding_window(c.sliding_window)
    if pattern is not None:
        w.add_array(f"{a}.attention.sliding_window_pattern", pattern)
    w.add_expert_feed_forward_length(c.intermediate_size)
    rope = c.rope_parameters
    w.add_rope_freq_base(rope["rope_theta"])
    if swa_theta is not None:
        w.add_rope_freq_base_swa(swa_theta)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    params = {k: v.detach().float().numpy() for k, v in hf_params(model).items()}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts."
        gate_up, gate_up_b = params.pop(p + "gate_up_proj"), params.pop(p + "gate_up_proj_bias")  # [E, H, 2I], columns gate, up, gate, ...
        stacked = {"gate": gate_up[:, :, 0::2].transpose(0, 2, 1), "up": gate_up[:, :, 1::2].transpose(0, 2, 1),
                   "down": params.pop(p + "down_proj").transpose(0, 2, 1)}  # [E, out, in]
        for proj, arr in stacked.items():
            arr = np.ascontiguousarray(arr)
            if experts_type == F32:
                w.add_tensor(f"blk.{i}.ffn_{proj}_exps.weight", arr)
            else:
                w.add_tensor(f"blk.{i}.ffn_{proj}_exps.weight", gguf.quants.quantize(arr, experts_type),
                             raw_dtype=experts_type)
        for proj, b in (("gate", gate_up_b[:, 0::2]), ("up", gate_up_b[:, 1::2]),
                        ("down", params.pop(p + "down_proj_bias"))):
            w.add_tensor(f"blk.{i}.ffn_{proj}_exps.bias", np.ascontiguousarray(b))
    for name, arr in params.items():
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            w.add_tensor(f"blk.{layer}.{LAYER[rest]}", arr)
        else:
            w.add_tensor({"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                          "lm_head.weight": "output.weight"}[name], arr)
    add_test_vocabulary(w, c.vocab_size)
    finish_gguf(w)


def _logits(path, quantization="none", requantized=None) -> tuple:
    cfg, weights = load_weights(path, torch.float32, "cpu", quantization=quantization, requantized=requantized)
    model = LlamaModel(cfg, weights, 256, torch.float32, "cpu")
    torch.manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (60,)).tolist()
    return cfg, ids, chunked_logits(model, ids)


@pytest.mark.parametrize("pattern", [None, [True, False, True, True]])  # None: llama.cpp's every other layer
def test_a_gpt_oss_gguf_scores_as_transformers(tmp_path, pattern):
    types = ["sliding_attention" if s else "full_attention" for s in (pattern or [True, False] * 2)]
    hf = tiny_gpt_oss(num_hidden_layers=4, layer_types=types)
    path = tmp_path / "oss.gguf"
    write_gpt_oss_gguf(path, hf, pattern=pattern)
    cfg, ids, logits = _logits(path)
    assert cfg.architecture == "gpt_oss" and cfg.attn_sinks and cfg.mlp_bias and cfg.attention_bias
    assert cfg.window.size == 8 and cfg.window.rope_theta is None
    assert cfg.window.layers == tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    assert cfg.moe.scoring == "topk_softmax" and (cfg.moe.num_experts, cfg.moe.top_k) == (8, 2)
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.hidden_act == "swiglu_clamp"
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    hf.config.swiglu_limit = 1e9
    for layer in hf.model.layers:
        layer.mlp.experts.limit = 1e9
    with torch.inference_mode():  # the clamp acts on these weights: without it transformers scores otherwise
        assert not torch.allclose(hf(torch.tensor([ids])).logits[0].float(), ref, atol=1e-2)


def test_mxfp4_experts_read_as_their_values_and_run_as_stored(tmp_path):
    """The release's MXFP4 experts: dequantized, exactly the file's values
    (transformers over the weights rounded to MXFP4 first); under auto the
    C kernels multiply them as stored, nothing requantized."""
    hf = tiny_gpt_oss(num_hidden_layers=2)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("gate_up_proj", "down_proj")):  # rounded along the input dim, as the file's rows
                a = p.detach().transpose(1, 2).contiguous().numpy()
                r = gguf.quants.dequantize(gguf.quants.quantize(a, MXFP4), MXFP4).reshape(a.shape)
                p.copy_(torch.from_numpy(r).transpose(1, 2))
    path = tmp_path / "oss.gguf"
    write_gpt_oss_gguf(path, hf, experts_type=MXFP4)
    _, ids, logits = _logits(path)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    counts: dict[str, int] = {}
    _, _, quantized = _logits(path, "auto", counts)
    assert counts == {}
    _, weights = load_weights(path, torch.float32, "cpu", quantization="auto")
    assert weights["model.layers.1.mlp.experts.7.up_proj.weight"].fmt == "mxfp4"
    # The C kernels round the activations to 8 bits: near in all (6 % here;
    # with gate and up swapped, 80 %).
    assert (quantized - ref).norm() < 0.15 * ref.norm()


def test_the_engine_serves_a_gpt_oss_gguf_as_transformers_generates(tmp_path):
    """A gpt-oss GGUF through the engine: greedy_runs.assert_served_as_transformers_generates."""
    hf = tiny_gpt_oss(num_hidden_layers=4)
    path = tmp_path / "oss.gguf"
    write_gpt_oss_gguf(path, hf)
    assert_served_as_transformers_generates(path, hf)


def test_a_window_base_other_than_the_global_one_is_refused_by_name(tmp_path):
    """gpt-oss's window layers share the global RoPE's YaRN scaling: a file
    that names the global base for them reads as usual, another base is
    refused (the engine has no scaled RoPE of a second base)."""
    hf = tiny_gpt_oss(num_hidden_layers=2)
    same, other = tmp_path / "same.gguf", tmp_path / "other.gguf"
    write_gpt_oss_gguf(same, hf, swa_theta=YARN["rope_theta"])
    write_gpt_oss_gguf(other, hf, swa_theta=10000.0)
    assert load_model_config(str(same)).window.rope_theta is None
    with pytest.raises(ValueError, match="unsupported rope.freq_base_swa 10000.0 beside rope.freq_base 150000.0"):
        load_model_config(str(other))
