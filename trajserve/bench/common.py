"""Shared helpers for benchmarks: engine construction, machine facts, stats."""
from __future__ import annotations

import os
import platform
import statistics
import sys

import torch


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version()}


def command_line() -> str:
    return "trajserve " + " ".join(sys.argv[1:])


def spread(xs: list[float]) -> dict:
    """Median and the 10th/90th percentiles (noise on a shared machine)."""
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=10) if len(xs) >= 2 else [xs[0]] * 9
    return {"median": statistics.median(xs), "p10": q[0], "p90": q[-1]}


def read_bandwidth(device: torch.device, nbytes: int = 512 * 2**20, repeats: int = 7) -> float:
    """Memory read bandwidth in bytes/s: best of several full reductions of a
    buffer far larger than the caches."""
    import time

    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum().item()
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def identical_prefix(a, b, limit: int) -> int:
    """Tokens two greedy continuations share before the first difference (limit if none)."""
    return next((i for i, (u, v) in enumerate(zip(a, b)) if u != v), limit)
