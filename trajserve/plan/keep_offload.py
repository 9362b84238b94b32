"""Keep, offload or recompute a paused trajectory's KV (kv-cache-management
section 6, box 0.6).

Offloading pays a round trip over the host link; recomputing pays a prefill;
keeping pays accelerator memory for the whole wait. The break-even wait
compares keeping against offloading:

    T*_wait ~ (2 M_KV / B_pcie) * mu_HBM / (mu_HBM - mu_DRAM) + dT_stall

With memory the scarce tier (mu_HBM >> mu_DRAM) T* approaches the round trip.
"""
from __future__ import annotations


def transfer_time(nbytes: float, bandwidth: float) -> float:
    if bandwidth <= 0:
        raise ValueError("link bandwidth unknown for this device; calibrate it first")
    return nbytes / bandwidth


def round_trip_time(nbytes: float, bandwidth: float) -> float:
    """Out and back: 2 M_KV / B_link."""
    return 2 * transfer_time(nbytes, bandwidth)


def break_even_wait(nbytes: float, bandwidth: float, dram_cost_ratio: float = 0.0, stall: float = 0.0) -> float:
    """T*_wait; dram_cost_ratio = mu_DRAM / mu_HBM in [0, 1)."""
    if not 0.0 <= dram_cost_ratio < 1.0:
        raise ValueError(f"dram cost ratio mu_DRAM/mu_HBM must be in [0, 1), got {dram_cost_ratio}")
    return round_trip_time(nbytes, bandwidth) / (1.0 - dram_cost_ratio) + stall


def held_memory_time(nbytes: float, wait: float) -> float:
    """Byte-seconds of accelerator memory a kept trajectory occupies while it waits."""
    return nbytes * wait
