"""Concurrency against context length, and one trajectory's KV against the
memory wall (after kv-cache-management fig. 2, right panel)."""
from __future__ import annotations

import dataclasses

from trajserve.plan.planner import PlanRequest, plan


def plot(req: PlanRequest, path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib; install it with: pip install matplotlib") from None
    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt

    floor = max(req.shared_prefix, 1024)
    sweep = sorted({2**e for e in range(10, 22) if 2**e >= floor} | set(req.contexts))
    p = plan(dataclasses.replace(req, contexts=tuple(sweep)))
    xs = [r.context for r in p.rows]

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    def curve(values, style, label):
        # A log axis has no zero: draw the contexts that fit at least one trajectory.
        pts = [(x, v) for x, v in zip(xs, values) if v > 0]
        if pts:
            left.plot(*zip(*pts), style, label=label)

    curve([r.max_unshared for r in p.rows], "o-", "no sharing (eq. 6)")
    if p.rows[0].max_shared is not None:
        curve([r.max_shared for r in p.rows], "s-", "shared prefix (eq. 7)")
    fits = [r.context for r in p.rows if r.max_unshared > 0]
    if len(fits) < len(xs):  # the wall falls between the last context that fits and the next one
        start = (fits[-1] * xs[len(fits)]) ** 0.5 if fits else xs[0]
        left.axvspan(start, xs[-1], color="red", alpha=0.1, label="no unshared trajectory fits")
    for c in req.contexts:
        left.axvline(c, color="grey", lw=0.5, ls=":")
    left.set(xscale="log", yscale="log", xlabel="context tokens per trajectory",
             ylabel="max concurrent trajectories",
             title=f"{p.model}, {p.num_gpus} x {p.device.split(' (')[0]}")
    left.legend()

    total = p.memory_per_device * p.num_gpus
    for b in (1, 4):
        right.plot(xs, [b * r.kv_bytes / 1e9 for r in p.rows], label=f"KV of B={b}")
    right.axhline(p.memory_per_device / 1e9, color="red", ls="--", label="one device's memory")
    right.axhline(p.kv_pool_total / 1e9, color="orange", ls="--", label="KV pool, all devices")
    right.axhline(total / 1e9, color="black", ls=":", label="memory, all devices")
    right.set(xscale="log", yscale="log", xlabel="context tokens per trajectory", ylabel="GB",
              title=f"memory wall, m_token = {p.m_token / 1024:,.0f} KiB ({p.kv_dtype})")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
