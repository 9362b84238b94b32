"""U_KV over (virtual) time, and the queue behind it."""
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
