"""Our Llama-family forward vs transformers on tiny random Llama (with Llama 3,
linear and YaRN RoPE scaling), Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm), MoE,
sliding-window (Mistral, Qwen2), Gemma 3 (windows shorter than the prompt), DeepSeek V2 / V3
(latent attention, grouped routing, shared experts) and gpt-oss (sinks, biased experts) checkpoints:
chunked prefill through the paged cache plus a decode step, every row; with
the C kernels (cpu_kernels.c) and with the torch forward."""
from pathlib import Path

import pytest
import torch

from tiny_models import tiny_hf_model
from trajserve.engine.model_runner import ModelRunner, allocate_kv_pool
from trajserve.request import Request
from trajserve.engine.scheduler import ScheduledChunk, SchedulerOutput
from trajserve.kv.cache_manager import KVCacheManager
from trajserve.model.cpu_kernels import load as load_kernels
from trajserve.model.llama import LlamaModel
from trajserve.model.loader import load_weights
from trajserve.sampling import SamplingParams

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}


@pytest.mark.parametrize("kind, overrides", [
    ("llama", {}),
    ("llama", {"rope_scaling": LLAMA3_SCALING, "rope_theta": 500000.0}),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}),
    ("qwen2", {"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
                                "beta_fast": 16, "beta_slow": 2}}),
    ("qwen2", {}),
    ("qwen3", {"head_dim": 32}),
    ("qwen3_moe", {}),
    ("qwen3_moe", {"norm_topk_prob": False, "mlp_only_layers": [0], "num_experts_per_tok": 3}),
    ("olmoe", {}),
    ("olmoe", {"clip_qkv": None, "norm_topk_prob": True}),
    ("mistral", {}),
    ("mistral", {"sliding_window": 70}),  # the window's first key mid-way through a 64-key kernel block
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1, "num_hidden_layers": 3}),
    ("gemma3", {}),
    ("gemma3", {"final_logit_softcapping": None, "tie_word_embeddings": False}),
    ("deepseek_v2", {}),
    ("deepseek_v2", {"q_lora_rank": None, "topk_method": "greedy", "first_k_dense_replace": 0}),
    ("deepseek_v2", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                      "mscale": 0.707, "mscale_all_dim": 0.707}}),
    ("deepseek_v3", {}),
    ("gpt_oss", {}),
])
@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["c-kernels", "torch"])
def test_tiny_model_logits_match_transformers(tmp_path: Path, kind: str, overrides: dict, cpu_kernels: bool):
    hf = tiny_hf_model(kind, **overrides)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    cfg, weights = load_weights(tmp_path, torch.float32, "cpu")
    assert (cfg.rope_scaling is not None) == ("rope_scaling" in overrides or kind in ("gemma3", "gpt_oss"))
    assert (cfg.window is not None) == (kind in ("mistral", "gemma3", "gpt_oss") or "use_sliding_window" in overrides)
    model = LlamaModel(cfg, weights, 256, torch.float32, "cpu", use_cpu_kernels=cpu_kernels)
    assert (model.kernels is not None) == (cpu_kernels and load_kernels() is not None)
    torch.manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (90,)).tolist()  # > original_max_position_embeddings
    logits = chunked_logits(model, ids)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


def chunked_logits(model: LlamaModel, ids: list[int], block: int = 4) -> torch.Tensor:
    """Every row's logits of `ids` through a paged pool of `block`-token
    blocks: a first chunk of 7, a chunk over that cached prefix, then the
    last token as a decode."""
    cfg = model.config
    kv = KVCacheManager(64, block, 0.0)
    pools, heads, row = cfg.kv_pool_shape
    runner = ModelRunner(model, allocate_kv_pool(cfg.num_layers, 64, block, heads, row, torch.float32, "cpu",
                                                 tensors=pools), block)
    req = Request("a", ids, SamplingParams(), 10**6)
    assert kv.allocate_slots("a", len(ids))
    table = kv.table("a").block_ids
    rows = []
    for start, end in ((0, 7), (7, len(ids) - 1), (len(ids) - 1, len(ids))):
        batch = runner.prepare(SchedulerOutput([ScheduledChunk(req, start, end - start, table)]))
        batch.sample_rows = torch.arange(end - start)
        batch.sample_meta = None  # every row through the whole last layer
        rows.append(runner.run(batch))
    return torch.cat(rows)
