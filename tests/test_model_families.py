"""Model families beyond dense Llama through the engine, on tiny random
checkpoints written by transformers: DeepSeek V2 (latent attention with a q
bottleneck, grouped softmax routing, a shared expert), DeepSeek V3 (sigmoid
routing with its correction bias), gpt-oss (windows of 8 alternating with
global layers, attention sinks, biased experts with the clamped SwiGLU),
Qwen3-MoE and OLMoE (top-k routed experts).
Greedy tokens over 64 as transformers generates them, alone and batched
with a warm prefix cache, on the C kernels and on torch; the same tokens
whatever the chunk size, block size, preemption, host-tier reload,
speculation (drafts verified), forks (n = 2) or pause to each tier."""
from __future__ import annotations

import pytest
import torch

from engine_util import gone_when_dropped
from tiny_models import save_with_tokenizer, tiny_hf_model
from greedy_runs import PAUSED_OBSERVATION, engine, hf_greedy, paused_turns, prompts, run, run_staggered
from trajserve.config import SchedulerConfig
from trajserve.sampling import SamplingParams

# What each family's engine says it runs: architecture, start-up words.
FAMILIES = {"deepseek_v2": ("deepseek2", "latent attention: 32 + 8 RoPE values"),
            "deepseek_v3": ("deepseek2", "latent attention: 32 + 8 RoPE values"),
            "gpt_oss": ("gpt_oss", "1 of them sliding windows of 8 tokens"),
            "qwen3_moe": ("qwen3_moe", "(qwen3_moe, 3 layers"),
            "olmoe": ("olmoe", "(olmoe, 3 layers")}


@pytest.fixture(scope="module", params=list(FAMILIES))
def model_dir(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    hf = tiny_hf_model(request.param, num_hidden_layers=3 if request.param != "gpt_oss" else 2)
    save_with_tokenizer(hf, d)
    return d, hf, request.param


@pytest.fixture(scope="module")
def reference(model_dir):
    return hf_greedy(model_dir[1], prompts())


@pytest.mark.parametrize("kw", [{}, {"cpu_kernels": False}], ids=["c-kernels", "torch"])
def test_greedy_tokens_match_transformers_alone_and_batched(model_dir, reference, kw):
    d, _, family = model_dir
    eng = engine(d, **kw)
    try:
        arch, words = FAMILIES[family]
        assert eng.model_config.architecture == arch and words in eng.startup_summary
        cached: list[int] = []
        assert [run(eng, [p], cached)[0] for p in prompts()] == reference  # alone: the third hits the head
        assert cached[:2] == [0, 0] and cached[2] >= 24
        eng.kv.clear_cache()
        assert run(eng, prompts()) == reference  # together: prefill and decode rows mixed in one batch
    finally:
        eng.close()


@pytest.mark.parametrize("case", ["chunk-5", "block-16", "preempt", "host-tier", "speculative", "no-prefix-cache"])
def test_greedy_tokens_do_not_depend_on_how_the_engine_runs_them(model_dir, reference, case):
    d = model_dir[0]
    kw: dict = {}
    cache: dict = {}
    if case == "chunk-5":
        kw["scheduler"] = SchedulerConfig(max_num_batched_tokens=5)
    elif case == "block-16":
        cache = {"block_size": 16, "num_blocks": 24}
    elif case == "preempt":  # 3 x (up to 104 tokens) in 40 blocks of 4: someone is preempted and recomputed
        cache = {"num_blocks": 40, "free_window_blocks": False}  # (gpt-oss's window pool: test_window_models.py)
    elif case == "host-tier":  # evicted prefixes go to host memory and load back (a latent pool: one tensor a layer)
        cache = {"num_blocks": 40, "host_cache_bytes": 1 << 22, "free_window_blocks": False}
    elif case == "speculative":  # drafts verified on every family, asked for by name
        kw["scheduler"] = SchedulerConfig(speculative="ngram")
    else:
        cache = {"enable_prefix_caching": False}
    eng = engine(d, cache, **kw)
    try:
        # auto: every family runs on the C kernels, whose verified rows are a decode's bits, so drafts are on.
        assert eng.speculative == "ngram"
        batch = prompts()
        assert run(eng, batch) == reference
        assert run_staggered(eng, batch) == reference  # again, staggered over the cached heads
        if case == "preempt":
            assert eng.scheduler.num_preemptions > 0
        if case == "host-tier":
            assert eng.kv.stats().promoted_blocks > 0
        if case == "speculative":
            assert eng.scheduler.proposer.num_drafts > 0  # the tokens above went through verified drafts
    finally:
        eng.close()


def test_forked_choices_decode_to_transformers_tokens(model_dir, reference):
    """n = 2: each prompt's blocks are shared copy-on-write by its two
    choices, which then decode apart (latent rows, window parts, experts)."""
    eng = engine(model_dir[0])
    try:
        params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, n=2)
        rids = [eng.add_request(p, params) for p in prompts()]
        done = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o
        assert [[list(c.token_ids) for c in done[r].outputs] for r in rids] == [[w, w] for w in reference]
        assert eng.kv.num_active_blocks == 0  # every fork's blocks given back
    finally:
        eng.close()


def test_a_dropped_engine_frees_its_model_without_the_garbage_collector(model_dir):
    """No layer part (latent attention's norm, the experts' activation)
    holds its model: dropping the engine frees the model and pool at once."""
    assert gone_when_dropped(lambda: engine(model_dir[0]), lambda e: run(e, prompts()[:1])) == [True, True, True]


@pytest.mark.parametrize("decision", ["keep", "host", "disk", "drop"])
def test_a_session_paused_to_each_tier_resumes_to_the_same_tokens(model_dir, tmp_path, decision):
    want, got, residency, saved, cached, prompt_len = paused_turns(model_dir[0], decision, tmp_path / "kv")
    assert residency == {"keep": "kept", "drop": "dropped"}.get(decision, "offloaded")
    assert (saved > 0) == (decision in ("host", "disk"))  # the state went down to its tier
    assert got == want
    history = prompt_len - PAUSED_OBSERVATION  # resumed whole (gpt-oss: its windows' parts came back too)
    assert cached == (0 if decision == "drop" else (history - 1) // 4 * 4)


def test_gpt_oss_other_quantizations_and_lora_are_refused_by_name(tmp_path):
    import json

    from trajserve.model.hf_reader import _hf_config

    hf = tiny_hf_model("gpt_oss")
    save_with_tokenizer(hf, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text()) | {"quantization_config": {"quant_method": "bitsandbytes"}}
    with pytest.raises(ValueError, match="unsupported quantization_config 'bitsandbytes' for gpt_oss; supported: none, "
                                         "gpt_oss's mxfp4"):
        _hf_config(raw)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        engine(tmp_path, enable_lora=True)


def _prompt_logprobs(eng, prompt: list[int]) -> torch.Tensor:
    """The engine's log-probability of each prompt token after the first."""
    rid = eng.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    done = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished and o.request_id == rid:
                done = o
    return torch.tensor([lp[0] for lp in done.prompt_logprobs[1:]])


def test_gpt_oss_on_a_bf16_pool_counts_its_sinks(tmp_path):
    """A bf16 pool's kernels (AMX tiles where the CPU has them) add each
    head's sink: the prompt's log-probabilities are transformers' within
    bf16's rounding, and a model whose sinks were zeroed moves them further."""
    hf = tiny_hf_model("gpt_oss", num_hidden_layers=2, head_dim=32)  # a head AMX tiles take
    save_with_tokenizer(hf, tmp_path)
    prompt = prompts()[2]
    with torch.inference_mode():
        lsm = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    want = lsm[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    eng = engine(tmp_path, {"kv_cache_dtype": "bfloat16", "block_size": 16, "enable_prefix_caching": False})
    try:
        assert eng.kv_dtype == torch.bfloat16
        got = _prompt_logprobs(eng, prompt)
        for layer in eng.model.layers:
            layer.sinks.zero_()
        zeroed = _prompt_logprobs(eng, prompt)
    finally:
        eng.close()
    assert (got - want).abs().max() < 1e-3 < (zeroed - want).abs().max()
