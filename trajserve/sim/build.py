"""Assemble one simulation: hardware + model -> cost model, KV pool size,
and a fresh Scheduler / KVCacheManager / CostModelRunner per run."""
from __future__ import annotations

from dataclasses import dataclass

from trajserve.config import SchedulerConfig
from trajserve.engine.scheduler import Scheduler
from trajserve.kv.cache_manager import KVCacheManager
from trajserve.kv.preemption import PreemptionPricer
from trajserve.plan.catalog import DeviceSpec, ModelSpec
from trajserve.plan.planner import PlanRequest, plan
from trajserve.sim.cost_model import CostModel
from trajserve.sim.executor import CostModelRunner
from trajserve.sim.hardware import Hardware, ModelCost
from trajserve.sim.pauses import PauseController, rates_from_cost
from trajserve.sim.prefix_tiers import SimPrefixTiers
from trajserve.sim.simulator import Simulator
from trajserve.sim.speculation import SimDrafts
from trajserve.sim.tokens import TokenSource


@dataclass(slots=True)
class SimSetup:
    hw: Hardware
    model: ModelCost
    num_blocks: int
    block_size: int
    scheduler: SchedulerConfig
    watermark: float = 0.01
    prefix_caching: bool = True
    pool_source: str = ""
    # Tool pauses: "policy" (the engine's KeepPolicy), a forced keep / host /
    # disk / drop, or "cache" (no pause announced: state stays in the prefix
    # cache unpinned, LRU like any cached block).
    keep_policy: str = "cache"
    wait_hint: str = "exact"
    host_kv_bytes: float = 0.0
    disk_kv_bytes: float = 0.0
    # The prefix cache's lower tiers (hierarchical cache), in blocks; 0: none.
    prefix_host_blocks: int = 0
    prefix_disk_blocks: int = 0
    # Weights kept in host memory and copied in every step (8.4.3), whole replica.
    weight_offload_bytes: float = 0.0
    offload_buffers: int = 2
    # Speculative decoding (sim/speculation.py): acceptance a per draft token
    # (None: off), draft length m, or the engine's length rule (adaptive).
    spec_accept: float | None = None
    spec_draft: int = 4
    spec_adaptive: bool = False
    seed: int = 0

    @property
    def cost(self) -> CostModel:
        return CostModel(self.hw, self.model, self.weight_offload_bytes, self.offload_buffers)

    def simulator(self, num_blocks: int | None = None, *, max_concurrency: int | None = None,
                  progress: bool = False, desc: str = "simulate") -> tuple[Simulator, TokenSource]:
        """A fresh control plane (empty pool and cache) on this hardware."""
        n = num_blocks if num_blocks is not None else self.num_blocks
        kv = KVCacheManager(n, self.block_size, self.watermark, enable_prefix_caching=self.prefix_caching,
                            model_id=self.model.name)
        tokens = TokenSource(self.block_size)
        cost = self.cost
        runner = CostModelRunner(cost, self.block_size)
        tiers = pricer = None
        if (self.prefix_host_blocks or self.prefix_disk_blocks) and self.prefix_caching:
            tiers = SimPrefixTiers(kv, self.prefix_host_blocks, self.prefix_disk_blocks)
            # Preemption swaps or recomputes by the break-even rule, as in the engine.
            host_cap = self.prefix_host_blocks
            pricer = PreemptionPricer(rates_from_cost(cost, self.scheduler.max_prefill_chunk),
                                      int(cost.model.m_token * self.block_size), self.block_size,
                                      lambda n: n <= host_cap)
        drafts = None if self.spec_accept is None else SimDrafts(self.spec_accept, self.spec_draft,
                                                                 self.spec_adaptive, self.seed)
        sched = Scheduler(self.scheduler, kv, pricer, drafts)
        pauses = None
        if self.keep_policy != "cache" and self.prefix_caching:
            pauses = PauseController(sched, cost, mode=self.keep_policy, wait_hint=self.wait_hint,
                                     host_bytes=self.host_kv_bytes, disk_bytes=self.disk_kv_bytes)
        return Simulator(sched, runner, tokens, max_concurrency=max_concurrency, progress=progress,
                         desc=desc, pauses=pauses, prefix_tiers=tiers, drafts=drafts), tokens


def pool_blocks_from_memory(spec: ModelSpec, device: DeviceSpec, tp: int, block_size: int, kv_dtype: str,
                            weight_dtype: str | None, reserve_bytes: float,
                            memory_bytes: float | None = None) -> tuple[int, str]:
    """KV blocks of one TP replica: eqs. 3-5 (kv-cache-management) through
    trajserve.plan, no headroom (the engine keeps its own watermark)."""
    p = plan(PlanRequest(model=spec, device=device, contexts=(block_size,), tp=tp, kv_dtype=kv_dtype,
                         weight_dtype=weight_dtype, block_size=block_size, reserve_bytes=reserve_bytes,
                         memory_bytes=memory_bytes, headroom=0.0))
    blocks = p.token_capacity // block_size
    why = (f"eqs. 3-5: {p.memory_per_device / 1e9:.1f} GB - weights {p.weights_per_device / 1e9:.1f} GB - "
           f"reserve {p.reserve_per_device / 1e9:.1f} GB = {p.kv_pool_per_device / 1e9:.1f} GB KV per device, "
           f"{p.block_bytes_device / 1024:.0f} KiB per block")
    return blocks, why
