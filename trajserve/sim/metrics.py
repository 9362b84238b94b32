"""Summary of a simulation: latency percentiles, throughput, goodput under
SLOs, H_prefix and U_KV.

    TTFT = first token - arrival; E2E = finish - arrival;
    TPOT = (finish - first token) / (outputs - 1); ITL = every gap between
    consecutive tokens of a sequence (a preemption shows up here).
    Goodput R_good = sum_i Q_i D_i / T_obs   (inference-optimization 8.6.2)
    with Q_i = 1 (a simulator produces no wrong answers) and D_i = 1 when the
    call meets every SLO given; T_obs = first arrival to last finish.
"""
from __future__ import annotations

import numpy as np

from trajserve.sim.simulator import SimResult

SLO_KEYS = ("ttft", "tpot", "e2e")
PCTS = (50, 90, 99)


def parse_slos(specs: list[str] | None) -> dict[str, float]:
    """['ttft:2000', 'tpot:100'] -> seconds per key."""
    out: dict[str, float] = {}
    for s in specs or []:
        key, _, ms = s.partition(":")
        try:
            value = float(ms)
        except ValueError:
            value = -1.0
        if key not in SLO_KEYS or value <= 0:
            raise ValueError(f"--slo takes ttft:MS, tpot:MS or e2e:MS with MS > 0, got {s!r}")
        out[key] = value / 1e3
    return out


def dist_ms(x: np.ndarray) -> dict:
    if x.size == 0:
        return {"mean": None, **{f"p{p}": None for p in PCTS}}
    ms = x * 1e3
    return {"mean": float(ms.mean()), **{f"p{p}": float(v) for p, v in zip(PCTS, np.percentile(ms, PCTS))}}


def summarize(res: SimResult, slos: dict[str, float] | None = None) -> dict:
    r = res.records
    n = len(r)
    if n == 0:
        raise ValueError("no call finished: nothing to summarize" +
                         (f" ({len(res.rejected)} rejected: prompt larger than the pool)" if res.rejected else ""))
    arrival, first, finish = r.col("arrival"), r.col("first_token"), r.col("finish")
    outs, prompts, cached = r.col("output_tokens"), r.col("prompt_tokens"), r.col("cached_tokens")
    own = r.col("branch") == 0  # a fork branch shares its parent's first token and admission
    ttft = first - arrival
    e2e = finish - arrival
    multi = outs > 1
    tpot = np.where(multi, (finish - first) / np.maximum(outs - 1, 1), np.nan)
    start = float(arrival.min())
    t_obs = max(float(finish.max()) - start, 1e-12)

    slos = slos or {}
    ok = np.ones(n, dtype=bool)
    for key, limit in slos.items():
        v = ttft if key == "ttft" else e2e if key == "e2e" else np.nan_to_num(tpot, nan=0.0)
        ok &= v <= limit

    tl = res.timeline
    t = np.asarray(tl.t)
    u = np.asarray(tl.u_kv)
    # Each sample holds until the next one (the pool after a step is the
    # pool the next step starts from, or the idle gap waits with).
    dt = np.append(np.diff(t), 0.0) if t.size else np.zeros(0)
    st = res.runner.stats
    return {
        "calls": int(own.sum()), "sequences": n, "rejected": len(res.rejected),
        "duration_s": t_obs, "steps": res.steps, "busy_s": st.busy_s,
        "compute_bound_steps": st.compute_bound_steps,
        "throughput": {"requests_per_s": float(own.sum()) / t_obs, "output_tokens_per_s": float(outs.sum()) / t_obs,
                       "prompt_tokens_per_s": float(prompts[own].sum()) / t_obs,
                       "computed_tokens_per_s": st.tokens / t_obs},  # every token a forward ran: prefill + decode
        "goodput": {"slo_ms": {k: v * 1e3 for k, v in slos.items()},
                    "requests_per_s": float(ok.sum()) / t_obs, "fraction": float(ok.mean())} if slos else None,
        "ttft_ms": dist_ms(ttft[own]), "tpot_ms": dist_ms(tpot[multi]), "itl_ms": dist_ms(r.col("itl")),
        "e2e_ms": dist_ms(e2e),
        "prefix_hit_rate": res.hit_rate,
        "prompt_tokens": int(prompts[own].sum()), "cached_tokens": int(cached[own].sum()),
        "output_tokens": int(outs.sum()),
        "preemptions": res.preemptions, "swap_preemptions": res.swap_preemptions,
        "evicted_blocks": res.evicted_blocks, "cow_copies": res.cow_copies,
        "num_blocks": res.num_blocks, "block_size": res.block_size,
        "u_kv": {"mean": float(np.average(u, weights=dt)) if dt.sum() > 0 else None,
                 "max": float(u.max()) if u.size else None},
        "pauses": res.pauses,
        "prefix_tiers": res.prefix_tiers,
        "speculation": res.speculation,
        "wall_s": res.wall_s,
    }


def per_turn(res: SimResult) -> list[dict]:
    r = res.records
    turns, own = r.col("turn"), r.col("branch") == 0
    ttft = r.col("first_token") - r.col("arrival")
    prompts, cached = r.col("prompt_tokens"), r.col("cached_tokens")
    rows = []
    for t in sorted(set(turns[own].tolist())):
        m = own & (turns == t)
        rows.append({"turn": int(t), "calls": int(m.sum()), "prompt_tokens_median": float(np.median(prompts[m])),
                     "hit_rate": float(cached[m].sum() / max(prompts[m].sum(), 1)),
                     "ttft_ms_p50": float(np.median(ttft[m]) * 1e3)})
    return rows
