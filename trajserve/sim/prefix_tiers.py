"""The prefix cache's lower tiers (kv/lower_tiers.py) in the simulator.

The real LowerTiers, over one-byte stand-in blocks with capacities in
blocks, is attached to the simulated KV manager, so LRU eviction spills to
host then disk and a match loads back exactly as in the engine. What the
cost model needs is the traffic: after each schedule(), the blocks that
were spilled (device -> host) and loaded back (host -> device, or disk ->
host -> device) during it. The engine copies on its own thread before the
forward, so these transfers lengthen that step (CostModelRunner.execute's
`transfers`); host -> disk demotions are background writes and cost no
step time.
"""
from __future__ import annotations

from trajserve.kv.cache_manager import KVCacheManager
from trajserve.kv.lower_tiers import LowerTiers


class SimPrefixTiers:
    def __init__(self, kv: KVCacheManager, host_blocks: int, disk_blocks: int) -> None:
        self.kv = kv
        self.lower = LowerTiers.stand_in(host_blocks, disk_blocks)
        kv.attach_lower_tiers(self.lower)
        self._last = (0, 0, 0)

    def transfers(self) -> list[tuple[int, str]]:
        """(blocks, link) moved since the last call, for the step about to run."""
        st = self.lower.stats
        now = (self.kv.prefix_stats().spilled_blocks, st.loaded_host_blocks, st.loaded_disk_blocks)
        spilled, from_host, from_disk = (a - b for a, b in zip(now, self._last))
        self._last = now
        out = []
        if spilled + from_host:
            out.append((spilled + from_host, "host"))
        if from_disk:
            out.append((from_disk, "nvme"))  # streams through host staging; NVMe is the slower link
        return out

    def summary(self) -> dict:
        return {**self.lower.metrics(), "spilled_blocks": self.kv.prefix_stats().spilled_blocks,
                "promoted_blocks": self.kv.num_promoted_blocks}

    def close(self) -> None:
        self.lower.close()
