"""Calibration: the step-time fit recovers known rates, and (slow) the real
engine's quick calibration yields a profile the simulator runs on."""
from __future__ import annotations

import json

import numpy as np
import pytest

from trajserve.sim.fit import fit_steps

TRUE = dict(t_fixed=0.020, t_seq=0.002, a_mm=1 / 40e9, a_att=1 / 10e9, b_w=1 / 18e9, b_kv=1 / 3e9)


def synthetic_steps(rng: np.random.Generator, noise: float):
    """Prefill chunks (compute-bound) and decode batches (memory-bound) of a
    135M-parameter model, timed by the model itself plus multiplicative noise."""
    n_mm, d_w, m_tok, att = 2 * 1.06e8, 5.4e8, 46_080, 4 * 30 * 576
    rows = []
    for c in (32, 128, 512):
        for h in range(0, 2048, c):
            rows.append((1, n_mm * c, att * (c * h + c * (c + 1) / 2), d_w, m_tok * (c + h)))
    for b in (1, 4, 16, 32):
        for ctx in (128, 1024):
            rows.append((b, n_mm * b, att * b * (ctx + 1), d_w, m_tok * b * (ctx + 1)))
    n_seq, f_mm, f_att, dw, dkv = (np.array(col, dtype=float) for col in zip(*rows))
    t = (TRUE["t_fixed"] + TRUE["t_seq"] * n_seq
         + np.maximum(TRUE["a_mm"] * f_mm + TRUE["a_att"] * f_att, TRUE["b_w"] * dw + TRUE["b_kv"] * dkv))
    t *= 1 + noise * rng.standard_normal(t.size)
    decode = np.array([r[0] > 1 or r[1] == n_mm for r in rows])
    return t, n_seq, f_mm, f_att, dw, dkv, decode


def test_fit_recovers_the_rates_that_generated_the_steps():
    t, n_seq, f_mm, f_att, dw, dkv, decode = synthetic_steps(np.random.default_rng(0), 0.0)
    fit = fit_steps(t, n_seq, f_mm, f_att, dw, dkv, memory_bound_first=decode)
    for k, v in TRUE.items():
        assert getattr(fit, k) == pytest.approx(v, rel=1e-6), k
    assert np.abs(fit.rel_error).max() < 1e-9
    # Both regimes occur, so every rate is identified.
    assert fit.compute_bound.any() and (~fit.compute_bound).any()


def test_fit_with_noise_stays_close_and_respects_the_bandwidth_floor():
    t, n_seq, f_mm, f_att, dw, dkv, decode = synthetic_steps(np.random.default_rng(1), 0.05)
    fit = fit_steps(t, n_seq, f_mm, f_att, dw, dkv, memory_bound_first=decode, b_min=1 / 20e9)
    assert fit.a_mm == pytest.approx(TRUE["a_mm"], rel=0.15)
    assert fit.b_kv == pytest.approx(TRUE["b_kv"], rel=0.3)
    assert fit.b_w >= 1 / 20e9 and fit.b_kv >= 1 / 20e9
    assert np.median(np.abs(fit.rel_error)) < 0.06
    assert all(getattr(fit, k) >= 0 for k in TRUE)


def test_fit_keeps_the_mean_step_time_on_a_machine_that_stalls_now_and_then():
    """A shared machine slows some steps a lot (here 15 %, by 1 + Exp(0.8)).
    Errors relative to the measured time favour the fast steps, so the fit's
    steps would add up to less than the run took (a simulator on it runs
    fast); relative to the prediction, they add up to the run's time."""
    def sum_ratio(reweight: int) -> float:
        ratios = []
        for seed in range(8):
            rng = np.random.default_rng(seed)
            t, n_seq, f_mm, f_att, dw, dkv, decode = synthetic_steps(rng, 0.0)
            stall = np.where(rng.random(t.size) < 0.15, 1 + rng.exponential(0.8, t.size), 1.0)
            t = t * np.exp(0.05 * rng.standard_normal(t.size)) * stall
            fit = fit_steps(t, n_seq, f_mm, f_att, dw, dkv, memory_bound_first=decode, reweight=reweight)
            ratios.append(fit.predicted.sum() / t.sum())
        return float(np.mean(ratios))

    assert sum_ratio(0) < 0.97  # weighed by the measured time: the fit runs fast
    assert sum_ratio(10) == pytest.approx(1.0, abs=0.03)


def test_fit_needs_enough_points():
    with pytest.raises(ValueError, match="at least"):
        fit_steps([0.1, 0.2], [1, 1], [1, 2], [0, 0], [1, 1], [0, 0], [True, True])


@pytest.mark.slow
def test_quick_calibration_of_the_real_engine(tmp_path, capsys):
    """trajserve calibrate --quick on the embedded model (under a minute
    here), then simulate --profile with the profile it wrote."""
    import time

    from trajserve.cli import main

    out = tmp_path / "profile.json"
    t = time.perf_counter()
    assert main(["calibrate", "--quick", "--out", str(out), "--threads", "2"]) == 0
    took = time.perf_counter() - t
    print(f"\ncalibrate --quick took {took:.0f} s")
    p = json.loads(out.read_text())
    d = p["device"]
    assert p["kind"] == "trajserve-hardware-profile" and p["quick"]
    for k in ("peak_flops", "bandwidth", "kv_bandwidth", "host_link_bandwidth"):
        assert d[k] > 0, k
    assert d["fixed_overhead_s"] >= 0 and d["per_seq_overhead_s"] >= 0
    # No step streams weights faster than a plain reduction reads memory.
    assert d["bandwidth"] <= d["read_bandwidth"] * 1.0001
    assert p["fit"]["median_abs_rel_error"] < 0.35  # a shared 2-core machine is noisy
    assert took < 120
    capsys.readouterr()
    assert main(["simulate", "--profile", str(out), "--workload", "chat", "--num-requests", "20",
                 "--input-len", "300", "--output-len", "8", "--num-blocks", "400", "--json", "--no-progress"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["setup"]["model"] == p["model"]["name"]
    assert res["summary"]["calls"] == 20
