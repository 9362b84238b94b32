"""Speculation in the simulator: the
engine's proposer and scheduler on the cost model with a drawn acceptance,
and `simulate` agreeing with `plan spec` on the time per output token."""
from __future__ import annotations

import json

import pytest

from trajserve.cli import build_parser, main
from trajserve.plan.speculation import plan_speculation
from trajserve.sim.from_args import setup_from_args

ARGS = ["simulate", "--workload", "chat", "--num-requests", "1", "--input-len", "2048", "--output-len", "1024",
        "--gpu", "rtx-pro-6000", "--model", "qwen3-8b", "--tp", "1", "--mbu", "0.33", "--overhead-ms", "0",
        "--json", "--no-progress"]


def _summary(capsys, *extra: str) -> dict:
    assert main(ARGS + list(extra)) == 0
    return json.loads(capsys.readouterr().out)["summary"]


@pytest.mark.parametrize("accept, m", [(0.8, 4), (0.6, 2), (0.95, 6)])
def test_simulate_and_plan_agree_on_time_per_token(capsys, accept, m):
    """8.5.2: t_spec = T_m / E[N_m]. The simulator drafts m tokens a step,
    draws each one's acceptance, and prices the 1 + m row verify step with
    its cost model; plan spec takes T_m from the same cost model (the
    verify step at the request's mean context) and E[N_m] from the formula."""
    s = _summary(capsys, "--spec-accept", str(accept), "--spec-draft", str(m))
    spec = s["speculation"]
    assert spec["max_draft"] == m and not spec["adaptive"] and spec["draft_tokens"] > 0
    cost = setup_from_args(build_parser().parse_args(ARGS)).cost
    verify_ms = 1e3 * cost.step_for([(1 + m, 2048 + 512)]).total_s  # mean context over the output
    p = plan_speculation(accept, [m], verify_ms)
    assert abs(s["tpot_ms"]["mean"] / p.lengths[0].ms_per_token - 1) < 0.05
    # The draws follow a: accepted tokens per round within 5 % of E[N_m] - 1.
    assert spec["mean_accepted_length"] == pytest.approx(p.lengths[0].expected_output, rel=0.05)


def test_speculation_in_the_simulator_is_what_decoding_pays(capsys):
    plain = _summary(capsys)
    assert plain["speculation"] is None
    fixed = _summary(capsys, "--spec-accept", "0.8", "--spec-draft", "4")
    auto = _summary(capsys, "--spec-accept", "0.8", "--spec-draft", "auto")
    # Same output tokens; at batch 1 a memory-bound verify step costs about
    # a plain one, so the time per token falls by about E[N] (3.36 at m = 4).
    assert fixed["output_tokens"] == plain["output_tokens"] == 1024
    assert 3.0 < plain["tpot_ms"]["mean"] / fixed["tpot_ms"]["mean"] < 3.7
    # The marginal rule drafts longer where rows are this cheap, and pays.
    assert auto["speculation"]["mean_accepted_length"] > fixed["speculation"]["mean_accepted_length"]
    assert auto["tpot_ms"]["mean"] < fixed["tpot_ms"]["mean"]


def test_bad_speculation_flags_exit_2(capsys):
    assert main(ARGS + ["--spec-accept", "1.5"]) == 2
    assert "--spec-accept must be in [0, 1]" in capsys.readouterr().err
    assert main(ARGS + ["--spec-accept", "0.5", "--spec-draft", "many"]) == 2
    assert "--spec-draft must be" in capsys.readouterr().err
