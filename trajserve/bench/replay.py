"""Replay recorded requests through the real scheduler and KV cache manager
with no model: each step "samples" the token the request produced when it
ran. Prefix-cache hits, evictions and preemptions depend only on token ids
and block ids, so the hit rate a replay reports is the one the engine gets
for the same requests in the same order, at any pool size, in milliseconds.

Lower tiers of the prefix cache (kv/lower_tiers.py) replay too: their
capacity is a number of blocks, so the replay's tiers hold one-byte
stand-in blocks under caps of that many blocks, and evict, demote and
load back exactly as the engine's do.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from trajserve.config import SchedulerConfig
from trajserve.request import Request
from trajserve.engine.scheduler import Scheduler
from trajserve.kv.cache_manager import KVCacheManager
from trajserve.kv.lower_tiers import LowerTiers
from trajserve.sampling import SamplingParams


@dataclass(slots=True)
class ReplayResult:
    num_blocks: int
    hit_rate: float  # H_prefix, eq. 2
    cached_tokens: list[int]  # per request, at admission
    evicted_blocks: int
    preemptions: int


def replay(requests: Sequence[tuple[list[int], list[int]]], num_blocks: int, block_size: int,
           sched_config: SchedulerConfig, watermark: float = 0.01, host_blocks: int = 0,
           disk_blocks: int = 0) -> ReplayResult:
    """requests: (prompt ids, output ids) in arrival order; each runs alone
    to completion before the next arrives, as in `bench agent`. host_blocks /
    disk_blocks: the prefix cache's lower tiers, in blocks (0: none)."""
    kv = KVCacheManager(num_blocks, block_size, watermark, enable_prefix_caching=True)
    lower = None
    if host_blocks or disk_blocks:
        lower = LowerTiers.stand_in(host_blocks, disk_blocks)
        kv.attach_lower_tiers(lower)
    sched = Scheduler(sched_config, kv)
    cached = []
    for i, (prompt, outputs) in enumerate(requests):
        if not outputs:
            raise ValueError(f"request {i} has no output tokens to replay")
        req = Request(f"r{i}", list(prompt), SamplingParams(max_tokens=len(outputs), ignore_eos=True),
                      max_total_tokens=10**9)
        sched.add(req)
        while sched.has_unfinished():
            out = sched.schedule()
            if out.is_empty:
                raise ValueError(f"a pool of {num_blocks} blocks cannot hold request {i} "
                                 f"({len(prompt) + len(outputs)} tokens)")
            sampled = {c.request.request_id: outputs[c.request.num_output_tokens]
                       for c in out.chunks if c.sample}
            sched.update(out, sampled, 0.0)
        cached.append(req.num_cached_tokens)
    if lower is not None:
        lower.close()
    return ReplayResult(num_blocks, sched.prefix_hit_rate, cached, kv.prefix_stats().evicted_blocks,
                        sched.num_preemptions)
