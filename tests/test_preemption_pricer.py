"""Preemption by the break-even rule (kv/preemption.py): the victim is the
request cheapest to bring back, and its blocks are swapped to the host tier
when T_swap = 2 M_KV / B_host beats T_recomp = S / R_prefill, else dropped
for recompute. The stand-in model (standin_engine.py) checks every slot a
step reads, so a swapped block that came back wrong fails at once."""
import time

import pytest

from standin_engine import StandInEngine, reference_reply
from test_pressure import B, greedy, unique
from trajserve.config import SchedulerConfig
from trajserve.engine.scheduler import Scheduler
from trajserve.kv.cache_manager import KVCacheManager
from trajserve.kv.cost_rates import CostRates
from trajserve.kv.lower_tiers import LowerTiers
from trajserve.kv.preemption import PreemptionPricer
from trajserve.request import Request


def test_break_even_prices():
    rates = CostRates(prefill_tokens_per_s=1000.0, host_bytes_per_s=1e6, disk_bytes_per_s=1e6)
    p = PreemptionPricer(rates, block_bytes=10_000, block_size=16, can_swap=lambda n: n <= 100)
    # 10 blocks: swap = 2 x 100 KB / (1 MB/s) = 0.2 s; recompute = 160 tokens / (1000 tok/s) = 0.16 s: recompute.
    assert p.swap_s(10) == pytest.approx(0.2) and p.recompute_s(10) == pytest.approx(0.16)
    assert p.choose(10) == (False, pytest.approx(0.16))
    rates.host_bytes_per_s = 1e7  # a faster link: swap 0.02 s wins
    assert p.choose(10) == (True, pytest.approx(0.02))
    assert p.choose(101)[0] is False  # the host tier cannot take it
    assert p.choose(0) == (False, 0.0)


@pytest.mark.parametrize("pricer", [False, True])
def test_victim_is_the_newest_or_the_cheapest_to_bring_back(pricer):
    """A (oldest) needs a block for its next decode and the pool is full: the
    victim is C (the newest, 6 computed blocks) by default, B (1 computed
    block, cheapest to recompute) with the break-even pricer. Arrival order
    (fcfs) decides who asks for the block first, as the scenario needs."""
    kv = KVCacheManager(12, B, 0.0, enable_prefix_caching=True)
    rates = CostRates(prefill_tokens_per_s=1000.0, host_bytes_per_s=1e9, disk_bytes_per_s=1e9)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_prefill_chunk=256, admission_ceiling=1.0,
                                      scheduling="fcfs"), kv,
                      PreemptionPricer(rates, 1000, B, can_swap=lambda n: False) if pricer else None)
    reqs = {name: Request(name, unique(i * 50, n), greedy(6), 10**6)
            for i, (name, n) in enumerate((("A", 16), ("B", 5), ("C", 24)))}
    for r in reqs.values():
        sched.add(r)
    while sched.has_unfinished():
        out = sched.schedule()
        sampled = {c.request.request_id: reference_reply(c.request.all_token_ids, 1)[0]
                   for c in out.chunks if c.sample}
        if out.preempted:
            assert [r.request_id for r in out.preempted] == (["B"] if pricer else ["C"])
            break
        sched.update(out, sampled, time.monotonic())
    else:
        pytest.fail("the pool never ran short")


def standin_with_host(host_bytes_per_s: float):
    eng = StandInEngine(30, B)
    eng.scheduler.ceiling_blocks = eng.kv.num_blocks  # admit everything: force preemptions
    block_bytes = eng.runner.pool[0].numel() * eng.runner.pool.element_size()
    lower = LowerTiers(eng.runner.read_blocks, eng.runner.write_blocks, host_bytes=1000 * block_bytes)
    eng.kv.attach_lower_tiers(lower)
    rates = CostRates(prefill_tokens_per_s=1000.0, host_bytes_per_s=host_bytes_per_s, disk_bytes_per_s=1e9)
    eng.scheduler.pricer = PreemptionPricer(rates, block_bytes, B, lambda n: n * block_bytes <= lower.host.byte_cap)
    return eng, lower


@pytest.mark.parametrize("fast_link", [True, False])
def test_preempted_requests_swap_or_recompute_and_finish_with_the_same_unique(fast_link):
    """Three requests that outgrow a 30-block pool together. A fast host link:
    preemptions swap (their blocks go to the host tier and come back on
    re-admission). A link slower than recomputing: they recompute. The
    tokens are the reference in both cases."""
    eng, lower = standin_with_host(1e9 if fast_link else 1.0)
    prompts = [unique(i * 40, 24) for i in range(3)]
    ids = [eng.add_request(p, greedy(30)) for p in prompts]
    outs = {}
    for _ in range(10_000):
        for o in eng.step():
            outs[o.request_id] = o
        if not eng.has_unfinished_requests():
            break
    assert sorted(outs) == sorted(ids)
    for rid, p in zip(ids, prompts):
        assert outs[rid].outputs[0].token_ids == reference_reply(p, 30)
    sched = eng.scheduler
    assert sched.num_preemptions > 0
    if fast_link:
        assert sched.num_swap_preemptions > 0 and eng.kv.num_promoted_blocks > 0
        assert lower.stats.loaded_host_blocks > 0
    else:
        assert sched.num_swap_preemptions == 0
    eng.kv.clear_cache()
    assert eng.kv.pool.num_free == eng.kv.num_blocks
    eng.kv.pool.check()
