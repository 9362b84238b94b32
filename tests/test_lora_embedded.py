"""Multi-LoRA on the embedded SmolLM2 with small random adapters made here
(none can be downloaded): with float weights, an adapter's prompt logprobs
and greedy tokens are PEFT's on transformers' model of the same GGUF; on the
default path (the GGUF's quantized blocks, AMX tiles for prefill chunks
where the CPU has them) requests of two adapters and of none batched
together get what each gets alone, bit for bit."""
from __future__ import annotations

import pytest
import torch

from engine_util import run_requests
from tiny_models import random_adapter
from trajserve.config import CacheConfig, EngineConfig
from trajserve.engine.engine import LLMEngine
from trajserve.sampling import SamplingParams

PROMPTS = ["Write a haiku about a river.", "List three prime numbers and say why they are prime.",
           "What does a compiler do? Answer in one paragraph for a child who likes trains and boats."]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, hf_gguf_model):
    d = tmp_path_factory.mktemp("lora_embedded")
    a = random_adapter(hf_gguf_model, d / "a", 1, r=8, alpha=16, std=0.05)
    random_adapter(hf_gguf_model, d / "b", 2, targets=("q_proj", "v_proj"), r=4, std=0.1)
    return d, a


def _ids(eng: LLMEngine, text: str) -> list[int]:
    return eng.tokenizer.encode_chat([{"role": "user", "content": text}])


def test_float_weights_with_an_adapter_match_peft(adapters, hf_gguf_model):
    d, peft = adapters
    eng = LLMEngine(EngineConfig(dtype="float32", quantization="none", lora_modules=(("a", str(d / "a")),),
                                 cache=CacheConfig(num_blocks=256, kv_cache_dtype="float32")))
    ids = _ids(eng, PROMPTS[1])
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, prompt_logprobs=0)
    out, base = run_requests(eng, [(ids, sp, "a"), (ids, sp, None)])
    with torch.inference_mode():
        logp = peft(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        want = peft.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
    ours = torch.tensor([out.prompt_logprobs[i][0] for i in range(1, len(ids))])
    ref = logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    torch.testing.assert_close(ours, ref, atol=2e-3, rtol=0)
    assert out.outputs[0].token_ids == want[0, len(ids):].tolist()
    assert out.outputs[0].token_ids != base.outputs[0].token_ids  # the adapter matters
    eng.close()


def test_quantized_default_path_mixed_batches_equal_each_alone(adapters):
    d, _ = adapters
    eng = LLMEngine(EngineConfig(dtype="float32", lora_modules=(("a", str(d / "a")), ("b", str(d / "b"))),
                                 cache=CacheConfig(num_blocks=512)))
    assert "q4" in " ".join(eng.model.weight_formats())  # the GGUF's blocks, as stored
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1)
    jobs = [(_ids(eng, p), name) for p in PROMPTS for name in ("a", None, "b")]
    mixed = run_requests(eng, [(p, sp, name) for p, name in jobs])
    for (p, name), got in zip(jobs, mixed):
        alone = run_requests(eng, [(p, sp, name)])[0].outputs[0]
        assert (got.outputs[0].token_ids, got.outputs[0].logprobs) == (alone.token_ids, alone.logprobs), name
    by = {name: [o.outputs[0].token_ids for (_, n), o in zip(jobs, mixed) if n == name] for name in ("a", None, "b")}
    assert by["a"] != by[None] and by["b"] != by[None]
    eng.close()
