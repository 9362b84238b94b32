"""`trajserve plan QUESTION` against inference-optimization's worked numbers,
at the precision the spec prints: speculative decoding (speculation.py;
8.5.2-8.5.4, exercise 8-7), weight offload (weight_offload.py; 8.4.3,
exercise 8-5), a round's reads (batch_reads.py; 8.2.1), one request's time
(batch_config.request_time; 8.1.1); and the CLI on the same inputs."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from hypothesis import given, strategies as st

from trajserve.plan import get_model
from trajserve.plan.batch_config import request_time
from trajserve.plan.batch_reads import bytes_per_token, kv_batch, round_bytes, step_time, weight_intensity
from trajserve.plan.goodput import goodput, requests_in_system, setup_break_even_s, task_speedup, task_time
from trajserve.plan.kv_format import m_token
from trajserve.plan.model_shapes import decode_read_params, total_params
from trajserve.plan.speculation import (draft_lengths, expected_output, marginal_output, plan_speculation,
                                        query_budget, round_time, setup_break_even_tokens, time_per_token)
from trajserve.plan.weight_offload import compressed_move, fits_deadline, plan_offload, step_with_offload

MiB, GiB = 2**20, 2**30


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


def test_request_time_from_its_parts_8_1_1():
    # Queue 0.1 s, prefill 0.096 s to the first token, 255 intervals of 26.5 ms: 6.95 s, inside 7 s;
    # another request's 0.096 s prefill inserted into one interval (26.5 -> ~123 ms): 7.05 s, past it.
    assert round(0.1 + 0.096, 3) == 0.196
    assert round(request_time(0.1, 0.096, 256, 0.0265), 2) == 6.95
    assert round(0.0265 + 0.096, 4) * 1e3 == pytest.approx(122.5) and round(122.5) == 122
    assert round(request_time(0.1, 0.096, 256, 0.0265, stall_seconds=0.096), 2) == 7.05
    with pytest.raises(ValueError):
        request_time(0, 0.1, 0, 0.02)
    with pytest.raises(ValueError, match="must be >= 0"):
        request_time(0, 0.1, 5, -0.003)


def test_batch_reads_and_b_kv_8_2_1():
    cfg = get_model("qwen3-8b").config
    d_w, k = 2 * decode_read_params(cfg), m_token(cfg)  # BF16 matrix weights, 144 KiB of KV a token
    assert round(d_w / GiB, 1) == 14.1 and 2048 * k / GiB == 0.28125
    assert weight_intensity(1, 2) == 1 and weight_intensity(16, 2) == 16  # I_weight = 2b / s_w
    assert round(d_w / 16 / GiB, 2) == 0.88 and round(d_w / 64 / GiB, 2) == 0.22
    assert round(bytes_per_token(d_w, 1, 2048, k) / GiB, 2) == 14.38
    assert round(bytes_per_token(d_w, 64, 2048, k) / GiB, 2) == 0.50
    assert round(bytes_per_token(d_w, 1, 2048, k) / bytes_per_token(d_w, 64, 2048, k)) == 29
    assert 64 * 2048 * k > d_w  # at 64, a token's KV read passes its share of the weights
    assert kv_batch(d_w, 2048, k) == 51 and kv_batch(d_w, 8192, k) == 13
    with pytest.raises(ValueError, match="context must be >= 1"):
        kv_batch(d_w, 0, k)
    # 64 requests of 2K after one decode step, with all of the model's weights: ~35.7 GB resident
    assert round((2 * total_params(cfg) + 64 * 2049 * k) / 1e9, 1) == 35.7
    assert round_bytes(d_w, 64, 2048, k) == d_w + 64 * 2048 * k
    # T_step: the larger of compute and reading (the compute term wins only with a large F / P)
    assert step_time(16, 1e9, 1e15, d_w, 2048, k, 1.792e12) == round_bytes(d_w, 16, 2048, k) / 1.792e12
    assert step_time(16, 1e12, 1e15, d_w, 2048, k, 1.792e12) == 16 * 1e12 / 1e15


def test_weight_offload_8_4_3_and_exercise_8_5():
    ffn = 288 * MiB  # one layer's three BF16 FFN matrices, Qwen3-8B; 9 of 36 layers offloaded
    one, two = (plan_offload(ffn, 9, b, 1152 * MiB, 64e9, 255, budget_s=1.0) for b in (1, 2))
    assert one.offloaded_bytes == 2592 * MiB and round(one.offloaded_bytes / 1e9, 2) == 2.72
    assert one.net_saved_bytes == 2304 * MiB and two.net_saved_bytes == 2016 * MiB
    assert one.extra_states == 2 and two.extra_states == 1  # 8K input states of 1152 MiB
    assert plan_offload(ffn, 9, 1, 1188 * MiB, 64e9, 255).extra_states == 1  # whole requests of 1188 MiB
    assert round(one.copy_s_per_round * 1e3, 1) == 42.5 and round(4 / 0.0425) == 94
    assert round(one.copy_s_total, 1) == 10.8 and not fits_deadline(one.copy_s_per_round, 26.26e-3)
    c2c = plan_offload(ffn, 9, 2, 1188 * MiB, 450e9, 255)
    assert round(c2c.copy_s_per_round * 1e3, 1) == 6.0 and round(c2c.copy_s_total, 2) == 1.54
    assert fits_deadline(c2c.copy_s_per_round, 26.26e-3)
    assert round(one.link_for_budget / 1e9) == 693  # exercise 8-5: every copy of 255 rounds in 1 s
    c = compressed_move(96 * MiB, 0.25, 64e9)
    assert round(c.direct_s * 1e3, 2) == 1.57 and round(c.compressed_link_s * 1e3, 2) == 0.39
    assert round(c.saved_link_s * 1e3, 2) == 1.18 and round(c.min_decompress_bytes_per_s / 1e9, 1) == 85.3
    with pytest.raises(ValueError, match="buffers"):
        plan_offload(ffn, 9, 10, 1152 * MiB, 64e9, 255)
    with pytest.raises(ValueError, match="ratio"):
        compressed_move(96 * MiB, 1.0, 64e9)
    assert step_with_offload(0.02626, one.copy_s_per_round, 2) == one.copy_s_per_round  # overlapped
    assert step_with_offload(0.02626, one.copy_s_per_round, 1) == 0.02626 + one.copy_s_per_round  # in turn
    with pytest.raises(ValueError, match="at least one prefetch buffer"):
        step_with_offload(0.02626, 0.04, 0)


def test_cli_offload_reads_and_request():
    r = _trajserve("plan", "offload", "--layer-size", "288MiB", "--layers", "9", "--buffers", "1", "--state-size",
                   "1152MiB", "--link", "64", "--compress", "0.25", "--compress-size", "96MiB", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["net_saved_bytes"] == 2304 * MiB and round(out["copy_s_per_round"] * 1e3, 1) == 42.5
    assert round(out["compressed"]["min_decompress_bytes_per_s"] / 1e9, 1) == 85.3
    r = _trajserve("plan", "reads", "--model", "qwen3-8b", "--context", "8192", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["b_kv"] == 13
    r = _trajserve("plan", "request", "--queue-s", "0.1", "--prefill-s", "0.096", "--output-tokens", "256",
                   "--interval-ms", "26.5", "--deadline-s", "7", "--json")
    assert r.returncode == 0 and round(json.loads(r.stdout)["total_s"], 2) == 6.95
    r = _trajserve("plan", "offload", "--layer-size", "lots", "--layers", "9", "--state-size", "1GiB", "--link", "64")
    assert r.returncode == 2 and "--layer-size" in r.stderr


def test_requests_in_the_system_and_goodput_8_6_1_and_8_6_2():
    assert requests_in_system(4, 0.5) == 2 and requests_in_system(4, 2) == 8  # n = lambda T
    # 336 answers, 294 correct, 155 correct within 3 s: 139 correct answers came too late.
    g = goodput(336, 294, 155, 84.0)
    assert g.correct_but_late == 139 and g.goodput_per_s == 155 / 84 and g.completion_per_s == 4.0
    assert round((1.02 - 0.60) / 1.02 * 100) == 41  # continuous batching's goodput from 4/s to 16/s
    # D: 4.56 s of the card for 16 good results, at most 600 W -> 0.285 GPU-s and ~171 J a result;
    # 16/s vs 4/s continuous: 1083.7 vs 652.0 J a good result, ~66 % more.
    d = goodput(16, 16, 16, 4.56, gpu_s=4.56, energy_j=600 * 4.56)
    assert round(d.gpu_s_per_good, 3) == 0.285 and round(d.joules_per_good) == 171
    assert round((1083.7 / 652.0 - 1) * 100) == 66
    b = goodput(16, 16, 0, 9.01, gpu_s=9.01)  # B: 9.01 s, nothing on time: all of it wasted
    assert b.goodput_per_s == 0 and b.gpu_s_per_good == math.inf
    with pytest.raises(ValueError, match="good"):
        goodput(10, 5, 6, 1.0)


def test_whole_task_speedup_8_6_3_and_exercise_8_8():
    assert task_speedup(0.5, 4) == 1.6 and 100 / task_speedup(0.5, 4) == 62.5
    assert round(task_speedup(0.2, 4), 2) == 1.18 and round(100 / task_speedup(0.2, 4), 6) == 85
    stages = {"prefill": 20.0, "decode": 50.0, "tools": 30.0}  # exercise 8-8's 100 s task
    assert [task_time(stages, {k: 2}) for k in stages] == [90, 75, 85]
    assert task_time(stages, {"decode": 4}, setup_s=8) == 70.5
    assert round(100 / 70.5, 2) == 1.42 and setup_break_even_s(stages, {"decode": 4}) == 37.5
    assert task_time(stages, {"decode": 4}) == 100 / task_speedup(0.5, 4)  # one stage: Amdahl's law
    with pytest.raises(ValueError, match="stages the task does not have"):
        task_time(stages, {"sampling": 2})
    for bad in ({"decode": 0.0}, {"decode": -2.0}):  # a zero speed-up is a named error, not a division by zero
        with pytest.raises(ValueError, match="speed-ups > 0"):
            task_time(stages, bad)


def test_cli_goodput_and_task():
    r = _trajserve("plan", "goodput", "--arrival-rate", "4", "--stay-s", "2", "--completed", "336", "--correct", "294",
                   "--good", "155", "--window-s", "84", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["requests_in_system"] == 8 and out["goodput"]["correct_but_late"] == 139
    r = _trajserve("plan", "task", "--stages", "prefill=20,decode=50,tools=30", "--speedup", "decode=4", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["amdahl"] == 1.6 and json.loads(r.stdout)["after_s"] == 62.5
    r = _trajserve("plan", "goodput", "--completed", "3")
    assert r.returncode == 2 and "--window-s" in r.stderr
    r = _trajserve("plan", "task", "--stages", "decode=50", "--speedup", "decode=0")
    assert r.returncode == 2 and "speed-ups > 0" in r.stderr and "Traceback" not in r.stderr
    r = _trajserve("plan", "reads", "--model", "qwen3-8b", "--context", "0")
    assert r.returncode == 2 and "context must be >= 1" in r.stderr


@pytest.mark.parametrize("buffers", [1, 2])
def test_simulate_and_plan_agree_on_a_weight_offload_round(capsys, buffers):
    """The issue's check: simulate (the real scheduler on the cost model, a
    profile with a host link) and plan give the same decode round with 2592
    MiB of weights offloaded over PCIe Gen5 x16, within 5 %: the round
    without the offload from the simulator, the copy from both, combined by
    the one formula (weight_offload.step_with_offload)."""
    from trajserve.cli import main

    def tpot(*extra: str) -> float:
        assert main(["simulate", "--workload", "chat", "--num-requests", "1", "--input-len", "2048", "--output-len",
                     "64", "--gpu", "rtx-pro-6000", "--model", "qwen3-8b", "--tp", "1", "--mbu", "0.33",
                     "--overhead-ms", "0", "--json", "--no-progress", *extra]) == 0
        return json.loads(capsys.readouterr().out)["summary"]["tpot_ms"]["mean"] / 1e3

    plain = tpot()
    assert round(plain * 1e3) == 26  # the spec's 26.26 ms batch-1 round at 2K (8.6.3: 33 % of 1792 GB/s)
    offloaded = tpot("--weight-offload", "2592MiB", "--offload-buffers", str(buffers))
    p = plan_offload(288 * MiB, 9, buffers, 1152 * MiB, 64e9, 63, round_s=plain)
    assert abs(offloaded / p.step_s - 1) < 0.05
    if buffers == 2:
        assert round(offloaded * 1e3, 1) == 42.5  # the copy hides the round: >= 42.5 ms (8.4.3)
    else:
        assert offloaded == pytest.approx(plain + p.copy_s_per_round)


def test_lora_adapter_bytes_and_their_kv_8_2_1():
    """8.2.1: rank 16, bf16, Qwen3-8B's Q and V projections: one adapter is
    14.6 MiB, 100 are 1.43 GiB against 14.1 GiB of matrix weights; 100
    unshared 8K contexts hold 112.5 GiB of KV."""
    from trajserve.plan.adapters import adapter_params, module_shape, plan_adapters
    from trajserve.plan.catalog import get_model
    from trajserve.plan.kv_format import m_token

    cfg = get_model("qwen3-8b").config
    assert module_shape(cfg, "q") == (4096, 4096) and module_shape(cfg, "v_proj") == (4096, 1024)
    p = plan_adapters(cfg, 16, ["q", "v"], 100, 2, 2, m_token(cfg, "bf16"), 100, 8192)
    assert p.adapter_params == 36 * 16 * ((4096 + 4096) + (4096 + 1024))
    assert round(p.adapter_bytes / 2**20, 1) == 14.6
    assert round(p.adapters_bytes / 2**30, 2) == 1.43
    assert round(p.matrix_weight_bytes / 2**30, 1) == 14.1
    assert round(p.contexts_kv_bytes / 2**30, 1) == 112.5
    assert p.pool_tokens_lost == int(p.adapters_bytes // m_token(cfg, "bf16"))
    # Every projection: q, k, v, o, gate, up, down at rank 8.
    every = adapter_params(cfg, 8, ["q", "k", "v", "o", "gate", "up", "down"])
    assert every == 36 * 8 * (8192 + 5120 + 5120 + 8192 + 3 * (4096 + 12288))
    with pytest.raises(ValueError, match="unknown LoRA target module 'x'"):
        adapter_params(cfg, 16, ["x"])
    with pytest.raises(ValueError, match="rank must be >= 1"):
        adapter_params(cfg, 0, ["q"])


def test_cli_plan_lora():
    r = _trajserve("plan", "lora", "--model", "qwen3-8b", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["targets"] == ["q_proj", "v_proj"] and d["adapters"] == 100
    r = _trajserve("plan", "lora", "--model", "qwen3-8b")
    assert "14.6 MiB" in r.stdout and "1.43 GiB" in r.stdout and "112.5 GiB" in r.stdout
    r = _trajserve("plan", "lora", "--model", "qwen3-8b", "--targets", "q,x")
    assert r.returncode == 2 and "unknown LoRA target module" in r.stderr and "Traceback" not in r.stderr
