"""Speculative decoding's arithmetic (trajserve/plan/speculation.py) against
inference-optimization 8.5.2-8.5.4 and exercise 8-7, at the precision the
spec prints; `trajserve plan spec` on the same inputs."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from hypothesis import given, strategies as st

from trajserve.plan.speculation import (draft_lengths, expected_output, marginal_output, plan_speculation,
                                        query_budget, round_time, setup_break_even_tokens, time_per_token)


def test_time_per_token_is_total_time_over_total_tokens_8_5_2():
    # Two 1.5 ms rounds giving 1 and 5 tokens: 0.5 ms a token, not the 0.9 of averaging 1.5 and 0.3.
    assert time_per_token([(1.5, 1), (1.5, 5)]) == pytest.approx(0.5)
    assert (1.5 / 1 + 1.5 / 5) / 2 == pytest.approx(0.9)
    with pytest.raises(ValueError):
        time_per_token([(1.5, 0)])


def test_two_symbol_drafts_aaaa_and_bbbb_8_5_2():
    # Four drafted tokens; a = 1/4 (AAAA) and 3/4 (BBBB): E[N] = 1 + a + a^2 + a^3 + a^4.
    assert round(expected_output(0.25, 4), 2) == 1.33
    assert round(expected_output(0.75, 4), 2) == 3.05
    # 26.26 ms verify (= a plain decode step, same bytes read) + 0.1 ms lookup = 26.36 ms a round.
    t = round_time(26.26, 4, query_ms=0.1)
    assert t == pytest.approx(26.36)
    assert round(t / expected_output(0.25, 4), 1) == 19.8
    assert round(t / expected_output(0.75, 4), 2) == 8.64
    # Lookup budget where a round still beats E[N] plain steps: ~8.7 and ~53.9 ms (fig. 8-32).
    assert round(query_budget(26.26, 26.26, expected_output(0.25, 4)), 1) == 8.7
    assert round(query_budget(26.26, 26.26, expected_output(0.75, 4)), 1) == 53.9
    # A 2 s index: paid back after ~114 tokens (26.26 - 8.64 ~= 17.6 ms saved a token);
    # 256 tokens take 6.72 s plain and ~4.2 s with the index built first.
    spec = t / expected_output(0.75, 4)
    assert round(26.26 - spec, 1) == 17.6
    assert math.ceil(setup_break_even_tokens(2000, 26.26, spec)) == 114
    assert round(256 * 26.26 / 1000, 2) == 6.72
    assert round((2000 + 256 * spec) / 1000, 2) == 4.21  # the spec prints 4.22 (docs/plan.md)
    assert setup_break_even_tokens(2000, 8.0, 9.0) == math.inf


def test_serial_and_parallel_draft_networks_8_5_3():
    # DFlash's 2.10 GB of weights at batch 1's effective bandwidth (15.44 GB in 26.26 ms = 588 GB/s).
    bandwidth = 15.44e9 / 26.26e-3
    assert round(bandwidth / 1e9) == 588
    forward = 2.10e9 / bandwidth * 1e3
    assert round(forward, 2) == 3.57 and round(4 * 3.57, 2) == 14.28  # four passes of the rounded 3.57 (14.29 unrounded)
    serial, parallel = round_time(26.26, 4, draft_ms=3.57), round_time(26.26, 1, draft_ms=3.57)
    assert round(time_per_token([(serial, 3)]), 1) == 13.5
    assert round(time_per_token([(parallel, 3)]), 1) == 9.9
    assert round(time_per_token([(parallel, 2)]), 1) == 14.9  # fewer accepted: slower than serial
    assert round(serial - parallel, 1) == 10.7


def test_exercise_8_7_draft_length_by_the_marginal_rule():
    a = 0.75
    rows = draft_lengths(a, [1, 2, 4, 8], lambda m: round_time(26.3, m, draft_ms=3.6))
    assert [round(r.expected_output, 2) for r in rows] == [1.75, 2.31, 3.05, 3.70]
    assert [round(r.round_ms, 1) for r in rows] == [29.9, 33.5, 40.7, 55.1]
    assert [round(r.ms_per_token, 1) for r in rows] == [17.1, 14.5, 13.3, 14.9]
    assert [r.pays for r in rows] == [None, True, True, False]  # 4 -> 8: 14.4 ms for 0.65 tokens
    assert min(rows, key=lambda r: r.ms_per_token).m == 4
    # Drafts in groups of 4 positions: 5 costs a whole second group for a^5 = 0.237 more tokens.
    grouped = draft_lengths(a, [4, 5], lambda m: round_time(26.3, m, draft_ms=3.6, draft_group=4))
    four, five = grouped
    assert round(four.round_ms, 1) == 40.7 and round(five.round_ms, 1) == 55.1
    assert round(five.added_output, 3) == round(marginal_output(a, 5), 3) == 0.237
    assert round(five.added_ms_per_token, 1) == 60.7 and five.added_ms_per_token > four.ms_per_token
    assert five.pays is False and five.ms_per_token > four.ms_per_token


@given(st.lists(st.floats(0, 1), min_size=1, max_size=10), st.integers(0, 12))
def test_expected_output_is_one_plus_the_survival_sums(profile, m):
    # E[N_m] = 1 + sum_j prod_{i<=j} a_i (8.5.4), a profile's last value repeating; each step adds dN.
    a = (profile + [profile[-1]] * m)[:m]
    assert expected_output(profile, m) == pytest.approx(1 + sum(math.prod(a[:j]) for j in range(1, m + 1)))
    if m:
        assert expected_output(profile, m) - expected_output(profile, m - 1) == pytest.approx(
            marginal_output(profile, m))
    assert 1 <= expected_output(profile, m) <= m + 1


def test_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match="acceptance probabilities must be in"):
        expected_output(1.5, 3)
    with pytest.raises(ValueError, match="verify_ms"):
        plan_speculation(0.5, [4], -1.0)
    with pytest.raises(ValueError, match="draft group"):
        round_time(26.3, 4, draft_group=0)


def _trajserve(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", "import sys; from trajserve.cli import main; sys.exit(main())"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=120, env=dict(os.environ))


def test_cli_plan_spec_json_and_table():
    r = _trajserve("plan", "spec", "--accept", "0.75", "--draft-len", "4", "--verify-ms", "26.26",
                   "--query-ms", "0.1", "--setup-ms", "2000", "--output-tokens", "256", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    (row,) = out["lengths"]
    assert round(row["expected_output"], 2) == 3.05 and round(row["ms_per_token"], 2) == 8.64
    assert round(out["query_budget_ms"], 1) == 53.9 and math.ceil(out["setup_break_even_tokens"]) == 114
    assert round(out["plain_request_s"], 2) == 6.72 and round(out["spec_request_s"], 2) == 4.21
    r = _trajserve("plan", "spec", "--accept", "0.75", "--draft-len", "1,2,4,8", "--verify-ms", "26.3",
                   "--draft-ms", "3.6")
    assert r.returncode == 0 and "best draft length 4" in r.stdout


def test_cli_plan_questions_and_bad_input_exit_2():
    r = _trajserve("plan", "spec", "--accept", "1.5", "--verify-ms", "26")
    assert r.returncode == 2 and "acceptance probabilities must be in [0, 1]" in r.stderr
    r = _trajserve("plan", "spec", "--accept", "x", "--verify-ms", "26")
    assert r.returncode == 2 and "--accept" in r.stderr
    r = _trajserve("plan", "--gpu", "h100")  # the capacity plan still needs its model
    assert r.returncode == 2 and "plan needs --model" in r.stderr
