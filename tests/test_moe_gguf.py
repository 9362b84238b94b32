"""Mixture-of-experts GGUF files as llama.cpp writes them (qwen3moe, olmoe:
the router as ffn_gate_inp, each projection's experts stacked in one
[experts, out, in] tensor, expert_count / expert_used_count /
expert_feed_forward_length, OLMoE's clamp_kqv): the loader splits the
experts into matrices, float ones score as transformers does, and
quantized experts run as stored with the file's own rows."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from test_loader import _TO_GGUF, hf_params
from tiny_models import tiny_hf_model
from trajserve.model.loader import load_model_config, load_weights
from trajserve.model.quant import QuantizedWeight

ARCH = {"qwen3_moe": "qwen3moe", "olmoe": "olmoe"}
STACKED = {"gate_proj": "ffn_gate_exps.weight", "up_proj": "ffn_up_exps.weight", "down_proj": "ffn_down_exps.weight"}


def write_moe_gguf(path, model, kind: str, qtype=gguf.GGMLQuantizationType.F32) -> None:
    """The tiny model as llama.cpp's converter lays it out (names written
    here, independently of the loader's tables)."""
    c = model.config
    arch = ARCH[kind]
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (("block_count", c.num_hidden_layers), ("context_length", c.max_position_embeddings),
                       ("embedding_length", c.hidden_size), ("feed_forward_length", c.intermediate_size),
                       ("attention.head_count", c.num_attention_heads),
                       ("attention.head_count_kv", c.num_key_value_heads),
                       ("attention.layer_norm_rms_epsilon", c.rms_norm_eps),
                       ("expert_count", c.num_experts), ("expert_used_count", c.num_experts_per_tok)):
        getattr(w, "add_float32" if isinstance(value, float) else "add_uint32")(f"{arch}.{key}", value)
    w.add_uint32(f"{arch}.attention.key_length", getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    w.add_float32(f"{arch}.rope.freq_base", float(getattr(c, "rope_theta", None) or 10000.0))
    if kind == "qwen3_moe":
        w.add_uint32(f"{arch}.expert_feed_forward_length", c.moe_intermediate_size)
    if getattr(c, "clip_qkv", None):
        w.add_float32(f"{arch}.attention.clamp_kqv", c.clip_qkv)
    params = {k: v.detach().float().numpy() for k, v in hf_params(model).items()}
    for i in range(c.num_hidden_layers):
        # transformers 5 holds a layer's experts fused: gate|up [E, 2I, H], down [E, H, I].
        gate_up = params.pop(f"model.layers.{i}.mlp.experts.gate_up_proj")
        inter = gate_up.shape[1] // 2
        experts = {"gate_proj": gate_up[:, :inter], "up_proj": gate_up[:, inter:],
                   "down_proj": params.pop(f"model.layers.{i}.mlp.experts.down_proj")}
        for proj, name in STACKED.items():
            stacked = np.ascontiguousarray(experts[proj])
            if qtype == gguf.GGMLQuantizationType.F32:
                w.add_tensor(f"blk.{i}.{name}", stacked)
            else:
                w.add_tensor(f"blk.{i}.{name}", gguf.quants.quantize(stacked, qtype), raw_dtype=qtype)
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", params.pop(f"model.layers.{i}.mlp.gate.weight"))
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    for name, a in params.items():
        if name in top:
            w.add_tensor(top[name], a)
        else:
            _, _, layer, rest = name.split(".", 3)
            w.add_tensor(f"blk.{layer}.{_TO_GGUF[rest]}", a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("kind", list(ARCH))
def test_a_float_moe_gguf_scores_as_transformers(tmp_path, kind):
    from trajserve.engine.model_runner import ModelRunner, allocate_kv_pool
    from trajserve.engine.scheduler import ScheduledChunk, SchedulerOutput
    from trajserve.kv.cache_manager import KVCacheManager
    from trajserve.model.llama import LlamaModel
    from trajserve.request import Request
    from trajserve.sampling import SamplingParams

    hf = tiny_hf_model(kind)
    path = tmp_path / "m.gguf"
    write_moe_gguf(path, hf, kind)
    cfg = load_model_config(str(path))
    assert cfg.architecture == kind and cfg.moe.num_experts == 8 and cfg.moe.top_k == 2
    assert cfg.moe.norm_topk_prob == (kind == "qwen3_moe") and cfg.qk_norm_whole == (kind == "olmoe")
    assert (cfg.clip_qkv is not None) == (kind == "olmoe")
    cfg, weights = load_weights(str(path), torch.float32, "cpu")
    for kernels in (True, False):
        model = LlamaModel(cfg, weights, 256, torch.float32, "cpu", use_cpu_kernels=kernels)
        kv = KVCacheManager(64, 4, 0.0)
        runner = ModelRunner(model, allocate_kv_pool(cfg.num_layers, 64, 4, cfg.num_kv_heads, cfg.head_dim,
                                                     torch.float32, "cpu"), 4)
        torch.manual_seed(2)
        ids = torch.randint(0, cfg.vocab_size, (40,)).tolist()
        req = Request("a", ids, SamplingParams(), 10**6)
        assert kv.allocate_slots("a", len(ids))
        batch = runner.prepare(SchedulerOutput([ScheduledChunk(req, 0, len(ids), kv.table("a").block_ids)]))
        batch.sample_rows, batch.sample_meta = torch.arange(len(ids)), None
        with torch.inference_mode():
            ref = hf(torch.tensor([ids])).logits[0].float()
        torch.testing.assert_close(runner.run(batch), ref, atol=1e-4, rtol=1e-4)


def test_q8_0_experts_keep_the_files_rows(tmp_path):
    hf = tiny_hf_model("qwen3_moe")
    path = tmp_path / "q.gguf"
    write_moe_gguf(path, hf, "qwen3_moe", gguf.GGMLQuantizationType.Q8_0)
    _, weights = load_weights(str(path), torch.float32, "cpu", quantization="auto")
    for e in (0, 5):
        got = weights[f"model.layers.1.mlp.experts.{e}.down_proj.weight"]
        assert isinstance(got, QuantizedWeight) and got.fmt == "q8_0"  # as stored, not requantized
        want = hf.state_dict()["model.layers.1.mlp.experts.down_proj"][e].float().numpy()
        round_trip = gguf.quants.dequantize(gguf.quants.quantize(want, gguf.GGMLQuantizationType.Q8_0),
                                            gguf.GGMLQuantizationType.Q8_0).reshape(want.shape)
        assert torch.equal(got.dequantize(), torch.from_numpy(round_trip))  # this expert's rows, bit for bit
