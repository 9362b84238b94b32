"""SamplingParams.prompt_logprobs (vLLM's): each prompt token's logprob given
the tokens before it, against transformers, and unchanged by chunking,
batching, the prefix cache and a preemption in the middle of the prefill."""
import dataclasses

import pytest
import torch

from engine_util import run_requests
from trajserve.engine.scheduler import SchedulerOutput
from trajserve.sampling import SamplingParams

TEXT = ("The capital of France is Paris. The capital of Germany is Berlin. "
        "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n") * 2


def scored(k=3, **kw):
    return SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=k, **kw)


@pytest.fixture
def small_chunks(engine_f32, monkeypatch):
    """Prefill in chunks of 23 tokens: several steps, none block-aligned."""
    sched = engine_f32.scheduler
    monkeypatch.setattr(sched, "config", dataclasses.replace(sched.config, max_prefill_chunk=23))
    return engine_f32


def close(a, b, tol=1e-4):
    """Two prompt-logprob lists agree entry by entry (same top-k tokens)."""
    assert len(a) == len(b) and a[0] is None and b[0] is None
    for i, (x, y) in enumerate(zip(a[1:], b[1:]), 1):
        assert abs(x[0] - y[0]) < tol, f"position {i}: {x[0]} vs {y[0]}"
        assert x[1].keys() == y[1].keys(), f"position {i}: top-k {list(x[1])} vs {list(y[1])}"


def test_prompt_logprobs_match_transformers(engine_float_weights, hf_gguf_model):
    eng = engine_float_weights
    ids = eng.tokenizer.encode(TEXT)
    out = run_requests(eng, [(ids, scored(k=2))])[0]
    with torch.inference_mode():
        ref = hf_gguf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    lps = out.prompt_logprobs
    assert len(lps) == len(ids) and lps[0] is None
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    got = torch.tensor([e[0] for e in lps[1:]])
    assert (got - want).abs().max().item() < 1e-3
    top = ref[:-1].topk(2).indices.tolist()
    # The top-2 can swap where two logprobs tie within the numerics.
    same = sum(list(e[1]) == t for e, t in zip(lps[1:], top))
    assert same >= len(top) - 2
    for i, (lp, alts, rank) in enumerate(lps[1:]):  # rank: 1 + how many tokens are likelier
        assert rank >= 1 and (rank <= 2) == (ids[i + 1] in alts), i
        assert (rank == 1) == (lp >= max(alts.values())), i
    assert sum(r == 1 for _, _, r in lps[1:]) == sum(ids[i + 1] == t[0] for i, t in enumerate(top))
    # The completion is what it is without prompt logprobs.
    plain = run_requests(eng, [(ids, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))])[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert plain.prompt_logprobs is None


def test_generated_tokens_score_the_same_as_prompt_tokens(engine_f32):
    """A sampled token's logprob equals its prompt logprob once it is part of
    the next prompt (the same row of the same model, reached two ways)."""
    eng = engine_f32
    ids = eng.tokenizer.encode(TEXT)
    first = run_requests(eng, [(ids, scored(logprobs=0))])[0].outputs[0]
    again = run_requests(eng, [(ids + first.token_ids, scored())])[0]
    for j, (lp, _) in enumerate(first.logprobs):
        assert abs(again.prompt_logprobs[len(ids) + j][0] - lp) < 1e-4


def test_chunking_batching_and_the_cache_leave_them_alone(engine_f32, small_chunks):
    eng = engine_f32
    ids = eng.tokenizer.encode(TEXT)
    eng.kv.clear_cache()
    alone = run_requests(eng, [(ids, scored())])[0]  # chunks of 23
    assert alone.num_cached_tokens == 0
    # The prompt is in the cache now: a plain request hits it; one asking
    # for prompt logprobs computes it whole and scores every token the same,
    # in a batch beside two others whose outputs do not change.
    other = eng.tokenizer.encode("List three colors:")
    plain = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    again, cached, side = run_requests(eng, [(ids, scored()), (ids, plain), (other, plain)])
    assert again.num_cached_tokens == 0
    assert cached.num_cached_tokens > 0
    close(again.prompt_logprobs, alone.prompt_logprobs)
    assert again.outputs[0].token_ids == alone.outputs[0].token_ids == cached.outputs[0].token_ids[:3]
    assert side.outputs[0].token_ids == run_requests(eng, [(other, plain)])[0].outputs[0].token_ids


def test_preempted_in_the_middle_of_the_prefill(small_chunks):
    """Preempted after two chunks, the request recomputes from the start
    (its own blocks are cached, but hold no logits) and ends as it would have."""
    eng = small_chunks
    ids = eng.tokenizer.encode(TEXT)
    want = run_requests(eng, [(ids, scored())])[0]
    rid = eng.add_request(ids, scored())
    eng.step(), eng.step()
    req = eng.groups[rid].seqs[0]
    assert 0 < req.num_computed_tokens < len(ids) and req.prompt_logprobs[1] is not None
    eng.scheduler._preempt(req, SchedulerOutput())
    out = None
    while eng.has_unfinished_requests():
        out = next((o for o in eng.step() if o.finished), out)
    assert req.num_preemptions == 1 and out.num_cached_tokens == 0
    close(out.prompt_logprobs, want.prompt_logprobs)
    assert out.outputs[0].token_ids == want.outputs[0].token_ids


def test_n_choices_one_prompt_score(engine_f32):
    eng = engine_f32
    ids = eng.tokenizer.encode(TEXT)
    one = run_requests(eng, [(ids, scored(k=0))])[0]
    two = run_requests(eng, [(ids, scored(k=0, n=2))])[0]
    assert len(two.outputs) == 2
    close(two.prompt_logprobs, one.prompt_logprobs)
    assert all(e[1] == {} for e in one.prompt_logprobs[1:])


def test_a_one_token_prompt_and_the_limit(engine_f32):
    out = run_requests(engine_f32, [([1], scored())])[0]
    assert out.prompt_logprobs == [None]
    with pytest.raises(ValueError, match=r"prompt_logprobs must be in \[0, 20\], got 21"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs must be an integer"):
        SamplingParams(prompt_logprobs=1.5)
