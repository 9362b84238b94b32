"""Is a finished request's prefix worth keeping in cache? (inference-optimization 8.3.4)

    V_h = p_h (T_r - T_f) - T_m

p_h: probability the prefix is used again; T_r: time to recompute it; T_f:
time to fetch it back from where it was kept; T_m: time spent maintaining
it (the spec takes one write-back, i.e. T_m = T_f). Keeping pays off when
p_h > T_m / (T_r - T_f).
"""
from __future__ import annotations


def retention_value(hit_prob: float, t_recompute: float, t_fetch: float, t_maintain: float) -> float:
    if not 0.0 <= hit_prob <= 1.0:
        raise ValueError(f"hit probability must be in [0, 1], got {hit_prob}")
    return hit_prob * (t_recompute - t_fetch) - t_maintain


def threshold_hit_prob(t_recompute: float, t_fetch: float, t_maintain: float) -> float:
    """The p_h above which V_h > 0; > 1 means keeping never pays."""
    saving = t_recompute - t_fetch
    return float("inf") if saving <= 0 else t_maintain / saving


def value_per_byte(value: float, nbytes: float) -> float:
    """V_h per byte of cache: the key to rank prefixes of different sizes."""
    return value / nbytes
