"""Fit the cost model's effective rates to measured step times.

Each measured step has the work terms of sim/cost_model.py (tp = 1):

    F_mm  = 2 N_mm sum c_i + 2 N_head n_sampled     matmul FLOPs
    F_att = 4 L d_q sum N_pair,i                    attention FLOPs (8.2.3)
    D_w   = weight bytes read once per step
    D_kv  = m_token sum (h_i + c_i)                 KV bytes (eq. 1)

and the model is

    t = t_fixed + n_seq t_seq + max(a F_mm + a_att F_att, b_w D_w + b_kv D_kv)

with a = 1 / P_eff, a_att = 1 / P_att,eff, b_w = 1 / beta_eff,
b_kv = 1 / beta_KV,eff, all >= 0. Given which side of the max each step is
on, t is linear in the six unknowns, so the fit alternates: assign each step
to the compute or the memory side with the current rates, solve a
non-negative least squares on relative error (a 50 ms decode step weighs as
much as a 2 s prefill), repeat until the assignment repeats. The error is
relative to the fit's prediction, not to the measured time: weighing each
step by 1 / t favours the steps that ran fast, so on a noisy machine the fit
would sit below the mean step time and a simulator on it would run fast
(its queues shorter than measured). So the fit is solved again with weights
1 / predicted until the prediction settles (iteratively reweighted least
squares: the normal equations are then sum x (t - p) / p^2 = 0, unbiased
when the noise is proportional to the step). D_w is the same
in every step, so b_w is told apart from t_fixed only by the compute-bound
steps; a floor b >= 1 / (raw read bandwidth) keeps noise from trading the
memory term for fixed time.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PARAMS = ("t_fixed", "t_seq", "a_mm", "a_att", "b_w", "b_kv")


@dataclass(slots=True)
class StepFit:
    t_fixed: float
    t_seq: float
    a_mm: float      # s per matmul FLOP
    a_att: float     # s per attention FLOP
    b_w: float       # s per weight byte
    b_kv: float      # s per KV byte
    iterations: int = 0
    predicted: np.ndarray = field(default_factory=lambda: np.zeros(0))
    rel_error: np.ndarray = field(default_factory=lambda: np.zeros(0))
    compute_bound: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))

    def sides(self, f_mm, f_att, d_w, d_kv) -> tuple[np.ndarray, np.ndarray]:
        return self.a_mm * f_mm + self.a_att * f_att, self.b_w * d_w + self.b_kv * d_kv

    def predict(self, n_seq, f_mm, f_att, d_w, d_kv) -> np.ndarray:
        comp, mem = self.sides(f_mm, f_att, d_w, d_kv)
        return self.t_fixed + self.t_seq * np.asarray(n_seq) + np.maximum(comp, mem)


def _nnls(A: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with x >= 0 by dropping the most negative coefficient
    and solving again (six columns: no solver library needed)."""
    active = list(range(A.shape[1]))
    x = np.zeros(A.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(A[:, active], y, rcond=None)
        if (sol >= 0).all():
            x[active] = sol
            return x
        active.pop(int(np.argmin(sol)))
    return x


def _fit_sides(t, n_seq, f_mm, f_att, d_w, d_kv, compute, b_min, w, max_iter) -> StepFit:
    """The alternating fit at fixed row weights w (each row's error times w),
    from the first assignment `compute` (True: the step is compute-bound)."""
    best: tuple[float, StepFit] | None = None
    seen: set[bytes] = set()
    for it in range(1, max_iter + 1):
        mem = ~compute
        cols = np.stack([np.ones_like(t), n_seq, f_mm * compute, f_att * compute, d_w * mem, d_kv * mem], axis=1)
        scale = np.abs(cols).max(axis=0)
        scale[scale == 0] = 1.0
        # b = b_min + b', b' >= 0: the floor's share moves to the left side.
        y = t - b_min * (d_w + d_kv) * mem
        x = _nnls(cols * w[:, None] / scale, y * w) / scale
        x[4:] += b_min
        fit = StepFit(*x, iterations=it)
        pred = fit.predict(n_seq, f_mm, f_att, d_w, d_kv)
        err = float(np.sum(((pred - t) * w) ** 2))
        if best is None or err < best[0]:
            best = (err, fit)
        comp_side, mem_side = fit.sides(f_mm, f_att, d_w, d_kv)
        new = comp_side >= mem_side
        if new.tobytes() in seen:  # converged, or cycling: keep the best fit seen
            break
        seen.add(new.tobytes())
        compute = new
    return best[1]


def fit_steps(t, n_seq, f_mm, f_att, d_w, d_kv, memory_bound_first, b_min: float = 0.0,
              weights=None, max_iter: int = 50, reweight: int = 10) -> StepFit:
    """weights: per step (default 1), e.g. 1 / steps in its configuration so
    a chunk size that takes 64 steps does not outvote a decode batch that
    takes 8. reweight: how many times at most the errors are made relative
    to the last fit's prediction (the module's docstring)."""
    t, n_seq, f_mm, f_att, d_w, d_kv = (np.asarray(x, dtype=float) for x in (t, n_seq, f_mm, f_att, d_w, d_kv))
    if t.size < len(PARAMS) or (t <= 0).any():
        raise ValueError(f"need at least {len(PARAMS)} positive step times to fit, got {t.size}")
    base = np.sqrt(np.ones_like(t) if weights is None else np.asarray(weights, dtype=float))
    compute = ~np.asarray(memory_bound_first, dtype=bool)
    ref = t  # what each step's error is relative to: its time, then the fit's prediction of it
    for _ in range(1 + reweight):
        fit = _fit_sides(t, n_seq, f_mm, f_att, d_w, d_kv, compute, b_min, base / ref, max_iter)
        pred = fit.predict(n_seq, f_mm, f_att, d_w, d_kv)
        # A prediction of (nearly) nothing would weigh its step without bound.
        pred = np.maximum(pred, 1e-3 * t)
        if np.abs(pred / ref - 1).max() < 1e-4:
            break
        ref = pred
        comp_side, mem_side = fit.sides(f_mm, f_att, d_w, d_kv)
        compute = comp_side >= mem_side
    fit.predicted = fit.predict(n_seq, f_mm, f_att, d_w, d_kv)
    fit.rel_error = (fit.predicted - t) / t
    comp_side, mem_side = fit.sides(f_mm, f_att, d_w, d_kv)
    fit.compute_bound = comp_side >= mem_side
    return fit
