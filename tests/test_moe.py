"""Mixture-of-experts models (model/moe.py) through the engine, on tiny
random Qwen3-MoE and OLMoE written by transformers (8 experts, 2 chosen a token):
greedy tokens as transformers generates them over 64 tokens, alone and in a
mixed batch with a warm prefix cache, on the C kernels and on torch, float
and q8_0 experts; a decode step at batch 1 runs only the chosen experts;
LoRA is refused by name."""
from __future__ import annotations

import pytest
import torch

from tiny_models import save_with_tokenizer, tiny_hf_model
from trajserve.config import CacheConfig, EngineConfig, SchedulerConfig
from trajserve.engine.engine import LLMEngine
from trajserve.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)


ROUTED = {"qwen3_moe": (0, 2), "olmoe": (0, 1, 2)}


@pytest.fixture(scope="module", params=list(ROUTED))
def model_dir(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    # Qwen3-MoE: layer 1 dense, 0 and 2 routed; OLMoE: every layer routed, q/k/v clamped.
    extra = {"mlp_only_layers": [1]} if request.param == "qwen3_moe" else {}
    hf = tiny_hf_model(request.param, num_hidden_layers=3, **extra)
    save_with_tokenizer(hf, d)
    return d, hf


def _engine(d, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(d), dtype="float32", cache=CacheConfig(num_blocks=96, block_size=4,
                                                                                    enable_prefix_caching=True), **kw))


def _prompts() -> list[list[int]]:
    torch.manual_seed(5)
    shared = torch.randint(0, 299, (24,)).tolist()  # a shared head: the second and third hit the cache
    return [torch.randint(0, 299, (17,)).tolist(), shared + [7, 8, 9], shared + [11, 12]]


def _run(eng: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    rids = [eng.add_request(p, GREEDY) for p in prompts]
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    return [list(done[r]) for r in rids]


def _hf_greedy(hf, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False, min_new_tokens=64)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kw", [{}, {"cpu_kernels": False}], ids=["c-kernels", "torch"])
def test_greedy_tokens_match_transformers_alone_and_batched(model_dir, kw):
    d, hf = model_dir
    prompts = _prompts()
    ref = [_hf_greedy(hf, p) for p in prompts]
    eng = _engine(d, **kw)
    try:
        assert eng.model_config.moe.layers == ROUTED[eng.model_config.architecture]
        assert [_run(eng, [p])[0] for p in prompts] == ref  # alone (the later two hit the cached head)
        eng.kv.clear_cache()
        assert _run(eng, prompts) == ref  # together: prefill and decode rows mixed in one batch
    finally:
        eng.close()


def test_a_decode_step_at_batch_1_runs_only_the_chosen_experts(model_dir):
    d, _ = model_dir
    eng = _engine(d, scheduler=SchedulerConfig(speculative="off"))  # one row a step: no drafts beside it
    try:
        model = eng.model
        routed = [L.moe for L in model.layers if L.moe is not None]
        eng.add_request(_prompts()[0], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        eng.step()  # the prefill: 17 rows choose among all 8
        eng.step()  # one decode row
        assert [len(m.last_experts) for m in routed] == [2] * len(routed)  # top_k of 8: the others' unread
        spec = eng.model_config.moe
        per_step = sum(model.weight_formats().values())
        experts = sum(p.nbytes for m in routed for p in m.products())
        dense = sum(p.nbytes for p in model.products()) - experts
        assert per_step == pytest.approx(dense + experts * spec.top_k / spec.num_experts, rel=1e-3)
    finally:
        eng.close()


def test_q8_0_experts_run_as_stored(model_dir):
    """The experts' products in q8_0 on the C kernels: prompt logprobs near
    transformers' float ones (8-bit weights), within a fifth of how far the
    same model without its experts' outputs is."""
    import copy
    d, hf = model_dir
    eng = _engine(d, quantization="q8_0")
    try:
        assert "q8_0" in eng.model.weight_formats()
        routed = next(L.moe for L in eng.model.layers if L.moe is not None)
        assert type(routed.experts[0][1]).__name__ == "QLinear"  # the down product as stored
        ids = _prompts()[0]
        eng.add_request(ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
        out = None
        while eng.has_unfinished_requests():
            out = next((o for o in eng.step() if o.finished), out)
        ours = torch.tensor([out.prompt_logprobs[i][0] for i in range(1, len(ids))])
        skipped = copy.deepcopy(hf)
        with torch.inference_mode():
            for name, p in skipped.named_parameters():
                if ".experts." in name:
                    p.zero_()
            scored = [m(torch.tensor([ids])).logits[0].float().log_softmax(-1) for m in (hf, skipped)]
        want, without = (lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])] for lp in scored)
        assert (ours - want).abs().max() < 0.2 * (without - want).abs().max()
    finally:
        eng.close()


def test_lora_on_a_moe_model_is_refused_by_name(model_dir):
    d, _ = model_dir
    with pytest.raises(ValueError, match="mixture-of-experts"):
        _engine(d, enable_lora=True)


def test_a_decode_row_alone_gets_the_bits_it_gets_in_a_batch(model_dir):
    """The one-row path (no gathers) sums the same experts in the same order."""
    d, _ = model_dir
    eng = _engine(d)
    try:
        moe = next(L.moe for L in eng.model.layers if L.moe is not None)
        torch.manual_seed(9)
        h = torch.randn(5, eng.model_config.hidden_size)
        together = moe(h)
        assert all(torch.equal(moe(h[i:i + 1])[0], together[i]) for i in range(5))
    finally:
        eng.close()
