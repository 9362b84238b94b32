"""Draft sources, the step-cost fit and the draft length rule."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trajserve.request import Request
from trajserve.plan.speculation import expected_output
from trajserve.sampling import SamplingParams
from trajserve.speculative.context_index import ContextIndex, continuation
from trajserve.speculative.proposer import DraftProposer, SpecConfig
from trajserve.speculative.step_cost import StepCost
from trajserve.speculative.suffix_store import SuffixStore


def brute_lookup(tokens: list[int], k: int, sizes) -> tuple[list[int], int]:
    """The definition: the longest n whose last-n-gram occurs earlier with a
    token after it; of those occurrences the latest; what follows it,
    continued with the period of the match where it reaches the end."""
    L = len(tokens)
    for n in sizes:
        if L < n:
            continue
        tail = tokens[L - n:]
        for end in range(L - 1, n - 1, -1):  # position after the occurrence, < L
            if tokens[end - n:end] == tail:
                ext = list(tokens)
                while len(ext) < L + k:
                    ext.append(ext[len(ext) - (L - end)])
                return ext[end:end + k], n
    return [], 0


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=60), st.integers(1, 8), st.integers(1, 60))
def test_context_index_matches_the_definition_as_the_sequence_grows(tokens, k, split):
    """Grown incrementally (as a decode appends tokens), the index answers
    what a scan of the whole sequence answers."""
    idx = ContextIndex(2, 4)
    idx.lookup(tokens[:split], k)  # built on a prefix first
    assert idx.lookup(tokens, k) == brute_lookup(tokens, k, (4, 3, 2))


def test_context_index_proposes_the_copy_that_follows():
    doc = [10, 11, 12, 13, 14, 15, 16, 17]
    seq = [1, 2] + doc + [3, 4] + doc[:3]
    assert ContextIndex(2, 4).lookup(seq, 4) == ([13, 14, 15, 16], 3)
    assert ContextIndex(2, 4).lookup([1, 2, 3], 4) == ([], 0)
    # A repeating pattern continues past the end: period 3.
    assert ContextIndex(2, 4).lookup([5, 6, 7] * 3, 7) == ([5, 6, 7, 5, 6, 7, 5], 4)
    assert continuation([1, 2, 1, 2], 3, 4) == [2, 2, 2, 2]


def test_suffix_store_never_crosses_salts_and_forgets_the_oldest():
    s = SuffixStore(2, 3, max_tokens=12)
    s.add([1, 2, 3, 4, 5, 6], "a")
    assert s.lookup([9, 1, 2], "a", 3) == ([3, 4, 5], 2)
    assert s.lookup([9, 1, 2], "b", 3) == ([], 0)
    assert s.lookup([9, 1, 2], None, 3) == ([], 0)
    s.add([7, 8, 9, 10, 11, 12, 13], "a")  # 13 tokens > 12: the first sequence leaves
    assert s.lookup([9, 1, 2], "a", 3) == ([], 0)
    assert s.lookup([0, 8, 9], "a", 2) == ([10, 11], 2)
    assert all(v[0] is s.seqs[0][1] for v in s.table.values())  # nothing of the dropped one is left


def test_step_cost_is_measured_per_row_count_and_guessed_past_it():
    c = StepCost()
    assert not c.measured and c.time(4) == 0.0
    for t in (0.010, 0.012, 0.012, 0.012):
        c.record(8, t)
    assert 0.010 < c.time(8) < 0.012  # a moving average, newest weighted most
    c.record(8, 0.012)
    c.record(16, 0.030)
    c.record(2, 0.006)
    t8 = c.time(8)
    assert c.time(12) == pytest.approx((t8 + 0.030) / 2)  # between measured counts: interpolated
    assert c.time(5) == pytest.approx(0.006 + (t8 - 0.006) / 2)
    assert c.added(8, 4) == pytest.approx(c.time(12) - t8)
    # Past the largest: a row is guessed at 1/16 of the per-sequence time.
    assert c.added(16, 1) == pytest.approx(0.030 / 16 / 16)
    assert c.time(1) == pytest.approx(0.006 * (1 - 1 / 32))


def _req(tokens: list[int]) -> Request:
    return Request("r", tokens, SamplingParams(max_tokens=100), 10_000)


def test_draft_length_follows_the_marginal_rule_and_backs_off_with_the_batch():
    """8.5.4: the m-th draft token is added while dT / dN < T / N, with dN =
    a^m and dT the measured cost of one more row at the step's row count."""
    p = DraftProposer(SpecConfig("ngram", 8))
    p.record_step(1, 0.005)
    p.record_step(9, 0.005 + 8 * 0.0004)   # batch 1: 0.4 ms a row on a 5 ms step
    p.record_step(32, 0.032)
    p.record_step(48, 0.032 + 16 * 0.0009)  # batch 32: 0.9 ms a row on a 32 ms step
    p.begin_step(num_decodes=1, num_prefill_tokens=0)  # T / N = 5.0 ms
    assert p._length(0.9, 8) == 8  # 0.9^8 * 5.0 = 2.15 > 0.4
    assert p._length(0.3, 8) == 2  # 0.3^2 * 5.0 = 0.45 > 0.4 > 0.3^3 * 5.0
    p.begin_step(num_decodes=32, num_prefill_tokens=0)  # T / N = 1.0 ms
    assert p._length(0.95, 8) == 2  # 0.95^2 = 0.90 > 0.9 > 0.95^3
    assert p._length(0.85, 8) == 0  # speculation is off for this sequence at this batch
    # Rows planned for earlier sequences of the step are paid before this one's.
    p.begin_step(num_decodes=1, num_prefill_tokens=0)
    p._rows = 9  # rows 9 -> 32 cost 1.04 ms each: 0.3 * 5 > 1.04 > 0.3^2 * 5
    assert p._length(0.3, 8) == 1
def test_a_sequence_whose_drafts_fail_stops_drafting_then_probes_again():
    p = DraftProposer(SpecConfig("ngram", 8))
    p.record_step(1, 0.005)
    p.record_step(9, 0.021)  # a row costs 2 ms of a 5 ms step: a draft token needs a > 0.4
    req = _req([5, 6, 7] * 20)
    p.begin_step(1, 0)
    assert len(p.propose(req, 8)) == 1  # the prior a = 0.6: 0.6 * 5 > 2 > 0.36 * 5
    for _ in range(10):
        p.observe(req, 1, 0)
    assert p.propose(req, 8) == []
    steps = 0
    while not p.propose(req, 8):  # its counts drift back toward the prior while it does not draft
        steps += 1
    assert 30 < steps < 100
    for _ in range(10):
        p.observe(req, 1, 1)
    assert len(p.propose(req, 8)) >= 3


def test_proposer_counts_and_expected_output_agree_with_the_planner():
    p = DraftProposer(SpecConfig("ngram", 4, adaptive=False))
    req = _req([1, 2, 3, 4, 1, 2])
    assert p.propose(req, 4) == [3, 4, 1, 2]
    p.observe(req, 4, 3)
    p.observe(req, 4, 1)
    m = p.metrics()
    assert (m["draft_tokens"], m["accepted_tokens"], m["acceptance_rate"], m["mean_accepted_length"]) == \
        (8, 4, 0.5, 3.0)
    assert expected_output(1.0, 4) == 5.0  # a fully accepted draft of 4 outputs 5 tokens


def test_options_refuse_bad_values():
    from trajserve.config import EngineConfig, SchedulerConfig

    with pytest.raises(ValueError, match="speculative .*--speculative.* one of auto, off, ngram, suffix"):
        EngineConfig(scheduler=SchedulerConfig(speculative="eagle")).validate()
    with pytest.raises(ValueError, match="num_speculative_tokens .*--num-speculative-tokens"):
        EngineConfig(scheduler=SchedulerConfig(speculative="ngram", num_speculative_tokens=0)).validate()


def test_suffix_method_drafts_from_finished_sequences_of_the_same_salt_only():
    """A retried branch rewrites what a finished sibling wrote: the suffix
    source drafts it, the sequence's own context (no copy there) cannot."""
    written = [40, 41, 42, 43, 44, 45, 46, 47]
    for method, salt, want in (("suffix", "t1", written[2:6]), ("suffix", "t2", []), ("ngram", "t1", [])):
        p = DraftProposer(SpecConfig(method, 4, adaptive=False))
        first = Request("a", [1, 2, 3], SamplingParams(max_tokens=100), 10_000, cache_salt="t1")
        first.all_token_ids += written
        p.release(first)  # finished: its tokens feed the store (suffix only)
        retry = Request("b", [9, 8, 7] + written[:2], SamplingParams(max_tokens=100), 10_000, cache_salt=salt)
        assert p.propose(retry, 4) == want, (method, salt)
