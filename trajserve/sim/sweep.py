"""Prefix hit rate (eq. 2, kv-cache-management) against KV pool size: the
same workload, rebuilt from its seed, simulated once per pool size."""
from __future__ import annotations

from collections.abc import Callable

from trajserve.sim.build import SimSetup
from trajserve.sim.metrics import summarize
from trajserve.sim.tokens import TokenSource
from trajserve.sim.workload import Session


def cache_size_sweep(setup: SimSetup, make_sessions: Callable[[TokenSource], list[Session]], sizes: list[int],
                     *, max_concurrency: int | None = None, progress: bool = False) -> list[dict]:
    rows = []
    for n in sorted(sizes):
        sim, tokens = setup.simulator(n, max_concurrency=max_concurrency, progress=progress,
                                      desc=f"{n:,} blocks")
        res = sim.run(make_sessions(tokens))
        try:
            s = summarize(res)
        except ValueError as e:  # a pool too small for any call: a row that says so, not a lost sweep
            rows.append({"num_blocks": n, "tokens": n * setup.block_size, "error": str(e),
                         "rejected": len(res.rejected), "wall_s": res.wall_s})
            continue
        rows.append({"num_blocks": n, "tokens": n * setup.block_size, "hit_rate": res.hit_rate,
                     "evicted_blocks": res.evicted_blocks, "preemptions": res.preemptions,
                     "rejected": len(res.rejected), "ttft_ms_p50": s["ttft_ms"]["p50"],
                     "ttft_ms_p99": s["ttft_ms"]["p99"],
                     "output_tokens_per_s": s["throughput"]["output_tokens_per_s"],
                     "duration_s": s["duration_s"], "wall_s": res.wall_s,
                     "promoted_blocks": (res.prefix_tiers or {}).get("promoted_blocks", 0)})
    return rows
