"""Figures: U_KV over (virtual) time with the queue behind it, and prefix hit
rate against KV pool size (a --cache-blocks sweep)."""
from __future__ import annotations

import numpy as np

from trajserve.sim.simulator import SimResult

MAX_POINTS = 20_000  # a long trace has 10^5 steps; a figure needs far fewer


def plot_u_kv(res: SimResult, path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt

    tl = res.timeline
    t = np.asarray(tl.t)
    if t.size == 0:
        raise ValueError("nothing to plot: the simulation ran no step")
    stride = max(1, t.size // MAX_POINTS)
    # Max over each stride window: a thinned line must still show the peaks.
    def thin(a: np.ndarray) -> np.ndarray:
        n = a.size // stride * stride
        head = a[:n].reshape(-1, stride).max(axis=1) if n else a[:0]
        return np.concatenate([head, a[n:].max(keepdims=True)]) if a.size > n else head

    ts = t[::stride][: thin(t).size]
    u, cached = thin(np.asarray(tl.u_kv)), thin(np.asarray(tl.cached))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 5.5), sharex=True, height_ratios=(2, 1))
    top.step(ts, u, where="post", lw=0.8, label="U_KV (eq. 8): allocated / total blocks")
    top.fill_between(ts, 0, cached, step="post", alpha=0.3, color="tab:green",
                     label="held only by the prefix cache (evictable)")
    top.set(ylim=(0, 1.02), ylabel="share of the KV pool",
            title=title or f"KV pool of {res.num_blocks:,} blocks x {res.block_size} tokens")
    top.legend(loc="lower right", fontsize=8)
    bottom.step(ts, thin(np.asarray(tl.running, dtype=float)), where="post", lw=0.8, label="running")
    bottom.step(ts, thin(np.asarray(tl.waiting, dtype=float)), where="post", lw=0.8, label="waiting")
    bottom.set(xlabel="simulated time (s)", ylabel="sequences")
    bottom.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_hit_rate_sweep(rows: list[dict], path: str, title: str = "") -> None:
    """H_prefix (eq. 2) and output throughput against the pool size, one point per simulation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "error" not in r]  # sizes where no call could run
    if not rows:
        raise ValueError("nothing to plot: no size of the sweep ran a call")
    tokens = [r["tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(tokens, [r["hit_rate"] * 100 for r in rows], "o-", label="prefix hit rate H_prefix (eq. 2)")
    ax.set(xscale="log", xlabel="KV pool (tokens)", ylabel="hit rate (%)", ylim=(0, 100),
           title=title or "prefix hit rate vs KV pool size")
    for r in rows:
        ax.annotate(f"{r['hit_rate'] * 100:.1f}%", (r["tokens"], r["hit_rate"] * 100), textcoords="offset points",
                    xytext=(0, 6), ha="center", fontsize=8)
    right = ax.twinx()
    right.plot(tokens, [r["output_tokens_per_s"] for r in rows], "s--", color="tab:gray", lw=0.8,
               label="output tokens/s")
    right.set_ylabel("output tokens/s", color="tab:gray")
    lines = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
