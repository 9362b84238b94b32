"""How a preemption frees its blocks: swap them to host or drop and recompute.

Spec: kv-cache-management "服务遥测动态" (at the preemption wall the engine
either swaps a trajectory's pages to host DRAM or drops them and later
re-runs the prefill) priced by the same break-even analysis as a tool pause
("保留、驱逐、重计算或卸载", section 6):

    T_swap    = 2 M_KV / B_host        out now and back at re-admission
    T_recomp  = S / R_prefill          (the measured prefill rate)

for the S tokens (M_KV bytes) of the victim's blocks. A preemption swaps
when T_swap < T_recomp and a host tier can take the blocks; else it
recomputes. The victim is the running request cheapest to bring back,
min(T_swap, T_recomp) (the newest on a tie): with the same per-block prices
for every request that is the one with the fewest blocks, so an
allocation is met with the least work to undo (vLLM preempts the newest;
agents' long histories make the newest not always the cheapest).

Pure arithmetic on block counts: the scheduler uses it in the engine and in
the simulator alike.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from trajserve.kv.cost_rates import CostRates


@dataclass(slots=True)
class PreemptionPricer:
    rates: CostRates             # shared with the keep policy: measured, kept up to date
    block_bytes: int             # M_KV of one block (eq. 1 x block size)
    block_size: int
    can_swap: Callable[[int], bool]  # a host tier can take this many blocks

    def swap_s(self, num_blocks: int) -> float:
        return 2 * self.rates.host_reload_s(num_blocks * self.block_bytes)

    def recompute_s(self, num_blocks: int) -> float:
        return self.rates.recompute_s(num_blocks * self.block_size)

    def choose(self, num_blocks: int) -> tuple[bool, float]:
        """(swap?, seconds to bring the request back)."""
        recomp = self.recompute_s(num_blocks)
        if num_blocks and self.can_swap(num_blocks):
            swap = self.swap_s(num_blocks)
            if swap < recomp:
                return True, swap
        return False, recomp
