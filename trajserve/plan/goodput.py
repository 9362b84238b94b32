"""Serving under load: requests in the system, goodput, cost per good
result, and a whole agent task's speed-up (inference-optimization 8.6).

    n = lambda T                         Little's law: mean requests in the system (8.6.1)
    R_good = sum_i Q_i D_i / T_obs       correct (Q_i) and on time (D_i) per second (8.6.2)
    per good result: T_GPU / N_g, E_obs / N_g
    S_task = 1 / ((1 - f) + f / s)       one stage of share f sped up s times (8.6.3, Amdahl)

and, for a task of stages (prefill, decode, tools, ...) each sped up by its
own factor, with a one-off setup added (exercise 8-8):
T' = sum_k T_k / s_k + setup. Arithmetic only.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass


def requests_in_system(arrival_rate: float, mean_stay_s: float) -> float:
    """n = lambda T (Little's law)."""
    if arrival_rate < 0 or mean_stay_s < 0:
        raise ValueError("arrival rate and stay must be >= 0")
    return arrival_rate * mean_stay_s


@dataclass(frozen=True, slots=True)
class Goodput:
    window_s: float
    completed: int
    correct: int
    good: int  # correct and on time
    completion_per_s: float
    goodput_per_s: float  # R_good
    correct_but_late: int
    gpu_s_per_good: float | None
    joules_per_good: float | None

    def to_dict(self) -> dict:
        return asdict(self)


def goodput(completed: int, correct: int, good: int, window_s: float, gpu_s: float | None = None,
            energy_j: float | None = None) -> Goodput:
    """R_good over a window from counts: good <= correct <= completed."""
    if not 0 <= good <= correct <= completed:
        raise ValueError(f"need 0 <= good ({good}) <= correct ({correct}) <= completed ({completed})")
    if not window_s > 0:
        raise ValueError(f"observation window must be > 0 s, got {window_s}")
    per = (lambda x: x / good if x is not None and good else (math.inf if x else None))
    return Goodput(window_s, completed, correct, good, completed / window_s, good / window_s, correct - good,
                   per(gpu_s), per(energy_j))


def task_speedup(share: float, speedup: float) -> float:
    """S_task = 1 / ((1 - f) + f / s)."""
    if not 0 <= share <= 1 or not speedup > 0:
        raise ValueError(f"share f must be in [0, 1] and speed-up s > 0, got f={share}, s={speedup}")
    return 1 / ((1 - share) + share / speedup)


def task_time(stages_s: dict[str, float], speedups: dict[str, float], setup_s: float = 0.0) -> float:
    """T' = sum_k T_k / s_k + setup (a stage without a speed-up keeps its time)."""
    unknown = set(speedups) - set(stages_s)
    if unknown:
        raise ValueError(f"speed-ups for stages the task does not have: {', '.join(sorted(unknown))}")
    bad = [f"{k}={v}" for k, v in speedups.items() if not v > 0 or not math.isfinite(v)]
    bad += [f"{k}={v}" for k, v in stages_s.items() if not v >= 0 or not math.isfinite(v)]
    if bad or setup_s < 0:
        raise ValueError(f"stage times and the setup must be >= 0 and speed-ups > 0, got {', '.join(bad) or setup_s}")
    return sum(t / speedups.get(k, 1.0) for k, t in stages_s.items()) + setup_s


def setup_break_even_s(stages_s: dict[str, float], speedups: dict[str, float]) -> float:
    """The setup at which the sped-up task takes as long as the original."""
    return sum(stages_s.values()) - task_time(stages_s, speedups)
