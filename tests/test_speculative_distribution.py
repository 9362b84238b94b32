"""Speculation keeps the target's distribution (8.5.1): on a tiny random
model, 10,000 samples of three tokens (top-k 3, temperature 1), the last
two verified against drafts, follow the model's exact distribution of
those tokens by a chi-square test -- and a deliberately wrong acceptance
rule (accept d with probability p(d), on a rejection draw from p instead of
the residual) fails the same test.
"""
from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from tiny_models import tiny_hf_model
from trajserve.config import CacheConfig, EngineConfig, SchedulerConfig
from trajserve.engine.engine import LLMEngine
from trajserve.model.sampler import filter_logits
from trajserve.sampling import SamplingParams
from trajserve.speculative.proposer import DraftProposer, SpecConfig

N = 10_000
PROMPT = [5, 17, 42, 99, 7, 230, 64, 3, 150, 11]
# Four tokens, so the step after the first verifies a draft of two (a draft
# never reaches past max_tokens); the first three are counted.
SP = dict(max_tokens=4, temperature=1.0, top_k=3)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny model as a Hugging Face directory with a word-level tokenizer."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    d: Path = tmp_path_factory.mktemp("tiny")
    hf = tiny_hf_model("llama")
    hf.save_pretrained(d, safe_serialization=True)
    Tokenizer(WordLevel({f"t{i}": i for i in range(300)}, unk_token="t0")).save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t299"}))
    return d, hf


def exact(hf, prefix: list[int]) -> torch.Tensor:
    """The sampler's distribution of the next token (top-k 3, temperature 1)."""
    with torch.inference_mode():
        logits = hf(torch.tensor([prefix])).logits[0, -1].float()
    return filter_logits(logits, SamplingParams(**SP)).softmax(-1)


class TableDrafts(DraftProposer):
    """Drafts the likeliest tokens after the ones sampled, up to the third."""

    def __init__(self, best: dict) -> None:
        super().__init__(SpecConfig("ngram", 2, adaptive=False))
        self.best = best

    def propose(self, req, limit):
        key, draft = tuple(req.all_token_ids[len(PROMPT):]), []
        while key in self.best and len(draft) < limit:
            draft.append(self.best[key])
            key += (draft[-1],)
        return draft


def wrong_verify(sampler, logits, first, ids, by_id, drafts, tokens, logprobs):
    """The classic mistake: d accepted with probability p(d), and on a
    rejection the token is drawn from p itself (d included), not from the
    residual; d then comes out with probability p(d) + (1 - p(d)) p(d)."""
    g = torch.Generator().manual_seed(len(ids) * 7919 + first[0])
    accepted = {}
    for i, rid in enumerate(ids[:len(first)]):
        draft = drafts.get(rid)
        if not draft:
            continue
        sp = by_id[rid].sampling_params
        got = []
        for j, d in enumerate(draft + [None]):
            p = filter_logits(logits[first[i] + j].cpu(), sp).softmax(-1)
            if d is not None and float(torch.rand((), generator=g)) < float(p[d]):
                got.append(d)
                continue
            tokens[i] = int(torch.multinomial(p, 1, generator=g))
            break
        accepted[rid] = got
    return accepted, {rid: [None] * len(a) for rid, a in accepted.items()}


def sample_triples(model_dir: Path, proposer) -> Counter:
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", max_model_len=64,
                                    cache=CacheConfig(num_blocks=1200, block_size=4),
                                    scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=4096,
                                                              max_prefill_chunk=4096)), proposer)
    counts: Counter = Counter()
    for start in range(0, N, 1000):
        ids = [engine.add_request(PROMPT, SamplingParams(seed=s, **SP)) for s in range(start, start + 1000)]
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids[:3]
        counts.update(tuple(done[i]) for i in ids)
    return counts


def chi_square_p(counts: Counter, probs: dict) -> float:
    """p-value of Pearson's chi-square of counts against probs (cells with
    an expected count under 5 pooled into one)."""
    stat, df, rest_obs, rest_exp = 0.0, -1, 0, 0.0
    for cell, p in probs.items():
        e = p * N
        if e < 5:
            rest_obs += counts.get(cell, 0)
            rest_exp += e
            continue
        stat += (counts.get(cell, 0) - e) ** 2 / e
        df += 1
    if rest_exp > 0:
        stat += (rest_obs - rest_exp) ** 2 / rest_exp
        df += 1
    assert sum(counts.values()) == N and set(counts) <= set(probs)
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.fixture(scope="module")
def target(tiny):
    """Every three-token output with its exact probability, and the drafts."""
    _, hf = tiny
    probs, best = {}, {}
    p1 = exact(hf, PROMPT)
    for t1 in p1.nonzero().flatten().tolist():
        p2 = exact(hf, PROMPT + [t1])
        best[(t1,)] = int(p2.argmax())
        for t2 in p2.nonzero().flatten().tolist():
            p3 = exact(hf, PROMPT + [t1, t2])
            best[(t1, t2)] = int(p3.argmax())
            for t3 in p3.nonzero().flatten().tolist():
                probs[(t1, t2, t3)] = float(p1[t1] * p2[t2] * p3[t3])
    assert len(probs) == 27 and math.isclose(sum(probs.values()), 1.0, rel_tol=1e-5)
    return probs, best


def test_speculation_keeps_the_distribution_and_a_wrong_rule_does_not(tiny, target, monkeypatch):
    model_dir, _ = tiny
    probs, best = target
    prop = TableDrafts(best)
    counts = sample_triples(model_dir, prop)
    # The drafts were verified, and both accepted and rejected often.
    assert prop.num_draft_tokens >= N and 0.2 < prop.num_accepted_tokens / prop.num_draft_tokens < 0.9
    assert chi_square_p(counts, probs) > 1e-3

    import trajserve.engine.model_runner as mx
    monkeypatch.setattr(mx, "verify_drafts", wrong_verify)
    wrong = sample_triples(model_dir, TableDrafts(best))
    assert chi_square_p(wrong, probs) < 1e-6
