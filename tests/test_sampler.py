"""Unit tests of trajserve/model/sampler.py: no model, hand-made logits."""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from trajserve.model.sampler import RowContext, Sampler, filter_logits
from trajserve.sampling import SamplingParams


def sp(**kw) -> SamplingParams:
    return SamplingParams(**kw)


def kept(logits: torch.Tensor) -> set[int]:
    return set(torch.isfinite(logits).nonzero().flatten().tolist())


@pytest.fixture
def random_logits() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 500, generator=g) * 3


# A distribution with no ties; positions shuffled so a sort/scatter mix-up shows.
PROBS = {7: 0.4, 2: 0.3, 9: 0.15, 0: 0.1, 4: 0.05}
V = 10


def hand_logits() -> torch.Tensor:
    logits = torch.full((V,), -1e4)  # other tokens: probability ~0 but finite
    for t, p in PROBS.items():
        logits[t] = math.log(p)
    return logits


# ------------------------------------------------------------------ greedy / top-k
def test_greedy_is_argmax(random_logits):
    tokens, lps = Sampler().sample(random_logits, [f"r{i}" for i in range(8)], [sp(temperature=0)] * 8)
    assert tokens == random_logits.argmax(-1).tolist()
    assert lps == [None] * 8


def test_top_k_1_is_argmax_even_when_hot(random_logits):
    s = Sampler()
    params = [sp(temperature=2.0, top_k=1, seed=i) for i in range(8)]
    for _ in range(5):
        tokens, _ = s.sample(random_logits, [f"r{i}" for i in range(8)], params)
        assert tokens == random_logits.argmax(-1).tolist()


def test_top_k_keeps_the_k_largest(random_logits):
    row = random_logits[0]
    f = filter_logits(row, sp(temperature=1.0, top_k=5))
    assert kept(f) == set(torch.topk(row, 5).indices.tolist())
    assert torch.equal(f[torch.isfinite(f)], row[torch.isfinite(f)])



def test_top_k_minus_1_is_off_as_in_vllm(random_logits):
    row = random_logits[0]
    assert torch.equal(filter_logits(row, sp(temperature=1.0, top_k=-1)), filter_logits(row, sp(temperature=1.0)))
    with pytest.raises(ValueError, match="top_k must be an integer >= -1"):
        sp(top_k=-2)


def test_seed_and_n_limits_name_the_field(random_logits):
    """A seed over 64 bits failed in torch's manual_seed inside a step (the
    engine loop stopped for everyone); a huge n built its lists on the
    engine thread. Both are refused when the request is made."""
    for kw, words in (({"seed": 2**64}, "seed must be an integer in [-9223372036854775808, 9223372036854775807]"),
                      ({"seed": -2**63 - 1}, "seed must be an integer in"),
                      ({"n": 129}, "n must be an integer in [1, 128]"), ({"n": 0}, "n must be an integer in")):
        with pytest.raises(ValueError, match=words.replace("[", r"\[")):
            sp(**kw)
    t, _ = Sampler().sample(random_logits[:2], ["a", "b"], [sp(temperature=1.0, seed=2**63 - 1),
                                                           sp(temperature=1.0, seed=-2**63)])
    assert len(t) == 2  # the extremes seed torch's generator


# ------------------------------------------------------------------ top-p
@pytest.mark.parametrize("top_p, want", [
    (0.01, {7}),               # always keep one, even when it alone exceeds p
    (0.3, {7}),                # 0.4 >= 0.3
    (0.5, {7, 2}),             # 0.4 < 0.5 <= 0.7
    (0.72, {7, 2, 9}),         # 0.7 < 0.72 <= 0.85
    (0.9, {7, 2, 9, 0}),       # 0.85 < 0.9 <= 0.95
    (0.96, {7, 2, 9, 0, 4}),   # 0.95 < 0.96 <= 1.0 (the -1e4 tokens add ~0)
])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, want):
    f = filter_logits(hand_logits(), sp(temperature=1.0, top_p=top_p))
    assert kept(f) == want
    # What is kept is renormalized, in the original proportions.
    probs = f.softmax(-1)
    mass = sum(PROBS[t] for t in want)
    for t in want:
        assert probs[t].item() == pytest.approx(PROBS[t] / mass, rel=1e-5)


def test_top_p_1_keeps_everything():
    logits = hand_logits()
    assert torch.equal(filter_logits(logits, sp(temperature=1.0, top_p=1.0)), logits)


def test_top_k_then_top_p():
    # top_k=3 leaves {7: .4, 2: .3, 9: .15} -> renormalized .47, .35, .18; top_p=0.8 keeps 7 and 2.
    f = filter_logits(hand_logits(), sp(temperature=1.0, top_k=3, top_p=0.8))
    assert kept(f) == {7, 2}


def test_sampled_tokens_stay_inside_the_nucleus():
    logits = hand_logits().expand(2000, V)
    tokens, _ = Sampler().sample(logits, ["nucleus"] * 2000, [sp(temperature=1.0, top_p=0.5, seed=3)] * 2000)
    assert set(tokens) == {7, 2}


# ------------------------------------------------------------------ temperature
def test_temperature_scales_logits(random_logits):
    row = random_logits[0]
    for t in (0.25, 0.5, 2.0):
        f = filter_logits(row, sp(temperature=t))
        torch.testing.assert_close(f, row / t)
    p1 = row.softmax(-1)
    sharp = filter_logits(row, sp(temperature=0.5)).softmax(-1)
    flat = filter_logits(row, sp(temperature=2.0)).softmax(-1)
    assert sharp.max() > p1.max() > flat.max()

    def entropy(p):
        return -(p * p.clamp_min(1e-30).log()).sum().item()

    assert entropy(sharp) < entropy(p1) < entropy(flat)
    # p_T is proportional to p^(1/T).
    torch.testing.assert_close(sharp, (p1 ** 2) / (p1 ** 2).sum())


# ------------------------------------------------------------------ seeds
def _draw(sampler: Sampler, logits: torch.Tensor, ids: list[str], params: list[SamplingParams], steps: int,
          row: int) -> list[int]:
    return [sampler.sample(logits, ids, params)[0][row] for _ in range(steps)]


def test_seeded_sampling_is_reproducible_and_batch_independent(random_logits):
    target = sp(temperature=1.0, seed=42)
    alone = _draw(Sampler(), random_logits[:1], ["t"], [target], 30, 0)
    assert len(set(alone)) > 2  # really sampling, not a constant
    assert _draw(Sampler(seed=99), random_logits[:1], ["t"], [target], 30, 0) == alone  # engine seed irrelevant
    assert _draw(Sampler(), random_logits[:1], ["other-id"], [target], 30, 0) == alone  # id irrelevant
    # In a batch, at row 3, next to greedy, seeded and unseeded rows.
    logits = random_logits.clone()
    logits[3] = random_logits[0]
    ids = [f"b{i}" for i in range(8)]
    ids[3] = "t"
    params = [sp(temperature=0), sp(temperature=1.0, seed=42), sp(temperature=0.8), target,
              sp(temperature=1.0, top_p=0.5), sp(temperature=1.0, top_k=3), sp(temperature=1.0, seed=7),
              sp(temperature=2.0)]
    assert _draw(Sampler(), logits, ids, params, 30, 3) == alone
    # Another seed, another stream.
    assert _draw(Sampler(), random_logits[:1], ["t"], [sp(temperature=1.0, seed=43)], 30, 0) != alone


def test_release_restarts_the_stream(random_logits):
    s = Sampler()
    p = [sp(temperature=1.0, seed=5)]
    first = _draw(s, random_logits[:1], ["r"], p, 10, 0)
    s.release("r")
    assert _draw(s, random_logits[:1], ["r"], p, 10, 0) == first


def test_unseeded_streams_follow_engine_seed_and_request_id(random_logits):
    p = [sp(temperature=1.0)]
    a = _draw(Sampler(seed=0), random_logits[:1], ["req-0"], p, 30, 0)
    assert _draw(Sampler(seed=0), random_logits[:1], ["req-0"], p, 30, 0) == a
    assert _draw(Sampler(seed=1), random_logits[:1], ["req-0"], p, 30, 0) != a
    assert _draw(Sampler(seed=0), random_logits[:1], ["req-1"], p, 30, 0) != a


_CHILD = """
import torch
from trajserve.model.sampler import Sampler
from trajserve.sampling import SamplingParams
logits = torch.randn(1, 500, generator=torch.Generator().manual_seed(0)) * 3
s = Sampler(seed=0)
print([s.sample(logits, ["req-0"], [SamplingParams(temperature=1.0)])[0][0] for _ in range(20)])
"""


def test_unseeded_streams_are_the_same_in_every_process():
    """The engine seed reproduces a run: nothing may depend on PYTHONHASHSEED."""
    runs = []
    for hash_seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed)
        r = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        runs.append(r.stdout.strip())
    assert runs[0] == runs[1]


# ------------------------------------------------------------------ distribution
def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    mask = expected > 0
    return (((counts - expected) ** 2)[mask] / expected[mask]).sum().item()


@pytest.mark.parametrize("params, expected", [
    (dict(temperature=1.0), None),
    (dict(temperature=0.7), None),
    (dict(temperature=1.0, top_k=3), {7: 0.4, 2: 0.3, 9: 0.15}),
    (dict(temperature=1.0, top_p=0.9), {7: 0.4, 2: 0.3, 9: 0.15, 0: 0.1}),
])
def test_empirical_frequencies_match_probabilities(params, expected):
    n = 20_000
    logits = hand_logits()
    if expected is None:
        probs = (logits / params["temperature"]).softmax(-1)
    else:
        probs = torch.zeros(V)
        for t, p in expected.items():
            probs[t] = p
        probs /= probs.sum()
    tokens, _ = Sampler().sample(logits.expand(n, V), ["freq"] * n, [sp(seed=2024, **params)] * n)
    counts = torch.bincount(torch.tensor(tokens), minlength=V).double()
    # Tokens outside the support are never drawn.
    assert counts[probs.double() < 1e-9].sum() == 0
    # 4 degrees of freedom at most; P(chi2_4 > 18.5) = 0.001.
    stat = _chi_square(counts, probs.double())
    assert stat < 18.5, (stat, counts.tolist(), probs.tolist())
    # And each frequency within 5 standard errors.
    for t in range(V):
        p = probs[t].item()
        se = math.sqrt(max(p * (1 - p), 1e-12) / n)
        assert abs(counts[t].item() / n - p) <= 5 * se + 1e-9


# ------------------------------------------------------------------ logprobs
def test_logprobs_are_log_softmax_of_raw_logits(random_logits):
    params = [sp(temperature=0, logprobs=4), sp(temperature=0.8, seed=1, logprobs=2), sp(temperature=0, logprobs=0),
              sp(temperature=0)]
    tokens, lps = Sampler().sample(random_logits[:4], ["a", "b", "c", "d"], params)
    ref = random_logits[:4].log_softmax(-1)
    for i, k in enumerate([4, 2, 0]):
        lp, alts = lps[i]
        assert lp == pytest.approx(ref[i, tokens[i]].item(), abs=1e-5)
        top = torch.topk(ref[i], k) if k else None
        assert alts == ({} if not k else pytest.approx(dict(zip(top.indices.tolist(), top.values.tolist())),
                                                        abs=1e-5))
    assert lps[0][0] == pytest.approx(max(lps[0][1].values()))  # greedy picks the top alternative
    assert lps[3] is None


# --------------------------------------------------- bias and penalties
def test_adjust_logits_by_hand():
    from trajserve.model.sampler import adjust_logits

    row = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0])
    ctx = [0, 1, 3, 3, 3, 5]  # prompt [0, 1], output [3, 3, 3, 5]
    out = adjust_logits(row, sp(logit_bias={2: 5.0, 4: -100.0}), ctx, 2)
    assert out.tolist() == [2.0, -1.0, 5.5, 3.0, -102.0, 1.0] and row[2] == 0.5  # the input is not changed
    out = adjust_logits(row, sp(repetition_penalty=2.0), ctx, 2)
    assert out.tolist() == [1.0, -2.0, 0.5, 1.5, -2.0, 0.5]  # prompt and output tokens; sign-aware
    out = adjust_logits(row, sp(frequency_penalty=0.5, presence_penalty=0.25), ctx, 2)
    assert out.tolist() == [2.0, -1.0, 0.5, 3.0 - 1.5 - 0.25, -2.0, 1.0 - 0.5 - 0.25]  # output tokens only
    assert torch.equal(adjust_logits(row, sp(frequency_penalty=2.0), [0, 1], 2), row)  # no output yet


def test_bias_and_penalties_steer_only_their_own_row(random_logits):
    ids = [f"r{i}" for i in range(8)]
    plain = [sp(temperature=0)] * 8
    base, base_lps = Sampler().sample(random_logits, ids, [sp(temperature=0, logprobs=2)] * 8)
    params = list(plain)
    params[3] = sp(temperature=0, logit_bias={17: 100.0}, logprobs=2)
    params[5] = sp(temperature=0, presence_penalty=2.0, frequency_penalty=2.0)
    contexts = [None] * 8
    contexts[5] = RowContext([1, 2, base[5], base[5]], 2)  # its greedy token came out twice already
    tokens, lps = Sampler().sample(random_logits, ids, params, contexts)
    assert tokens[3] == 17
    assert tokens[5] != base[5]
    assert [t for i, t in enumerate(tokens) if i not in (3, 5)] == [t for i, t in enumerate(base) if i not in (3, 5)]
    # logprobs are the model's, before the bias (vLLM's default)
    assert lps[3][1] == base_lps[3][1]
    # a seeded random row draws from the adjusted distribution
    t, _ = Sampler().sample(random_logits[:1], ["s"], [sp(temperature=1.0, seed=1, logit_bias={17: 100.0})])
    assert t == [17]


def test_out_of_range_bias_and_penalties_name_the_field():
    for kw, words in (({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
                      ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2]"),
                      ({"repetition_penalty": 0}, "repetition_penalty must be in (0, 10]"),
                      ({"logit_bias": {5: 101}}, "logit_bias values must be in [-100, 100]"),
                      ({"logit_bias": {-1: 1}}, "logit_bias keys must be token ids")):
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("(", r"\(")):
            sp(**kw)


def test_a_row_with_every_token_masked_does_not_stop_the_batch(random_logits):
    """All -inf (a constraint with nothing left) gives nan probabilities;
    multinomial would raise for the whole batch. That row keeps its argmax,
    the others sample as ever."""
    rows = random_logits[:2].clone()
    rows[0] = float("-inf")
    params = [sp(temperature=1.0, seed=3), sp(temperature=1.0, seed=4)]
    t, _ = Sampler().sample(rows, ["a", "b"], params)
    alone, _ = Sampler().sample(random_logits[1:2], ["b"], params[1:])
    assert t[1] == alone[0]
