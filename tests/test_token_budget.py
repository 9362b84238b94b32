"""The step's token budget from the allowed inter-token latency
(engine/token_budget.py, 8.2.4's two-step rule): what fits in the ITL
after the decodes, in tokens of the prefill in hand, fewer the longer the
context it extends; --max-num-batched-tokens auto needs --itl-target-ms."""
from __future__ import annotations

import pytest

from trajserve.config import AUTO_BUDGET_CEILING, SchedulerConfig
from trajserve.plan.flops import causal_pairs as pairs
from trajserve.engine.step_time import StepTimeModel
from trajserve.engine.token_budget import FALLBACK_BUDGET, MIN_PREFILL, budget_for_itl

TRUTH = (0.004, 2e-4, 1e-3, 2e-8)  # t_0, t_tok, t_seq, t_pair (seconds)


def _fitted() -> StepTimeModel:
    m = StepTimeModel()
    for tokens, seqs, n_pairs in [(1, 1, 500), (16, 16, 40_000), (512, 1, 131_328), (300, 8, 2_000_000),
                                  (64, 4, 90_000), (900, 3, 700_000)] * 4:
        m.observe(tokens, seqs, n_pairs, TRUTH[0] + TRUTH[1] * tokens + TRUTH[2] * seqs + TRUTH[3] * n_pairs)
    return m


def _step_s(c: int, rows: int, rows_ctx: int, h: int) -> float:
    t0, tok, seq, pair = TRUTH
    return t0 + tok * (c + rows) + seq * (rows + 1) + pair * (rows_ctx + pairs(c, h))


def test_the_budget_is_what_fits_in_the_itl():
    m = _fitted()
    for rows, rows_ctx, h in [(0, 0, 0), (4, 8_000, 0), (4, 8_000, 7_680), (12, 30_000, 2_000)]:
        b = budget_for_itl(m, 0.05, rows, rows_ctx, h)
        c = b - rows
        assert _step_s(c, rows, rows_ctx, h) <= 0.05 * (1 + 1e-6) < _step_s(c + 1, rows, rows_ctx, h)


def test_a_longer_context_or_more_decodes_leave_fewer_new_tokens():
    m = _fitted()
    # 8.2.3's pairs for a chunk of 512: after no context and after 7,680 cached tokens (exercise 8-2)
    assert pairs(512, 0) == 131_328 and pairs(512, 7_680) == 4_063_488
    short, long_ = budget_for_itl(m, 0.05, 0, 0, 0), budget_for_itl(m, 0.05, 0, 0, 7_680)
    assert short > long_ > MIN_PREFILL
    assert budget_for_itl(m, 0.05, 8, 16_000, 0) - 8 < short  # decodes take their share of the step first
    assert budget_for_itl(m, 0.2, 0, 0, 0) > short  # a looser ITL, a bigger chunk


def test_the_edges():
    m = _fitted()
    assert budget_for_itl(m, 0.001, 3, 100, 0) == 3 + MIN_PREFILL  # the decodes alone overrun: prefill still moves
    assert budget_for_itl(m, 100.0, 0, 0, 0) == AUTO_BUDGET_CEILING
    assert budget_for_itl(m, 100.0, 0, 0, 0, ceiling=600) == 600
    assert budget_for_itl(StepTimeModel(), 0.05, 0, 0, 0) == FALLBACK_BUDGET  # nothing fitted yet


def test_auto_needs_a_target_and_a_bad_target_is_named():
    with pytest.raises(ValueError, match="give itl_target_ms"):
        SchedulerConfig(max_num_batched_tokens="auto")
    assert SchedulerConfig(max_num_batched_tokens="auto", itl_target_ms=50).max_num_batched_tokens == 8192
    for bad in (0, -1, float("nan"), "fast"):
        with pytest.raises(ValueError, match="itl_target_ms"):
            SchedulerConfig(itl_target_ms=bad)


def test_the_engine_runs_each_step_at_the_rule_s_budget():
    from trajserve.config import CacheConfig, EngineConfig
    from trajserve.engine.engine import LLMEngine
    from trajserve.engine.token_budget import ITLBudget
    from trajserve.sampling import SamplingParams

    eng = LLMEngine(EngineConfig(dtype="float32", cache=CacheConfig(num_blocks=512), scheduler=SchedulerConfig(
        max_num_batched_tokens="auto", itl_target_ms=40, speculative="off")))
    try:
        rule = eng.scheduler.budget_rule
        assert isinstance(rule, ITLBudget)
        sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        for i in range(12):  # enough steps to fit the model, prefills and decodes
            eng.add_request(list(range(10 + i, 300 + i)), sp)
            if i % 4 == 3:
                while eng.has_unfinished_requests():
                    eng.step()
        assert eng.deadlines.steps.ready
        eng.add_request(list(range(20, 2020)), sp)  # a long prompt: chunked at the rule's budget
        budgets, tokens = [], []
        while eng.has_unfinished_requests():
            eng.step()
            budgets.append(rule.last)
            tokens.append(eng.last_step.num_tokens)
        assert all(t <= b for t, b in zip(tokens, budgets))
        assert MIN_PREFILL <= min(budgets) and max(budgets) <= AUTO_BUDGET_CEILING
    finally:
        eng.close()


def test_bench_budget_reports_each_setting():
    import contextlib
    import io
    import json

    from trajserve.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["bench", "budget", "--settings", "64,1024,auto", "--decoders", "2", "--prompt-tokens", "600",
                   "--warmup", "8", "--kv-cache-memory", "256MiB", "--json"])
    assert rc == 0
    rows = {r["setting"]: r for r in json.loads(out.getvalue())["rows"]}
    assert set(rows) == {"64", "1024", "auto"}
    assert rows["64"]["steps"] > rows["1024"]["steps"] >= 1  # a smaller budget: more steps to the first token
    assert all(r["max_itl_ms"] > 0 and r["ttft_ms"] >= r["max_itl_ms"] * 0.99 for r in rows.values())
