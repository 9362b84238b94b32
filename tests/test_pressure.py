"""Memory pressure on the real control plane with the stand-in model
(standin_engine.py checks every slot a step reads): the admission ceiling
holds new requests back, paused state kept by the policy gives way to
running work, a forced keep that blocks everything is dropped, and
offloaded state is prefetched ahead of a known return."""
import time

import pytest

from standin_engine import StandInEngine, reference_reply
from trajserve.config import SchedulerConfig
from trajserve.engine.scheduler import Scheduler
from trajserve.kv.cache_manager import KVCacheManager
from trajserve.kv.cost_rates import CostRates
from trajserve.request import Request, RequestStatus
from trajserve.sampling import SamplingParams
from trajserve.sessions.keep_policy import Decision, KeepPolicy
from trajserve.sessions.config import SessionConfig
from trajserve.sessions.manager import SessionManager

B = 4


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def unique(start, n):
    return [(start + 7 * i) % 500 for i in range(n)]


def test_admission_ceiling_holds_new_requests_until_room():
    kv = KVCacheManager(40, B, 0.0, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_prefill_chunk=256, admission_ceiling=0.5), kv)
    assert sched.ceiling_blocks == 20
    big = Request("big", unique(1, 48), greedy(8), 10**6)       # 12 blocks, 14 at the end
    small = Request("small", unique(2, 40), greedy(4), 10**6)   # 10 more would pass 20
    alone = Request("alone", unique(3, 100), greedy(2), 10**6)  # 25 blocks: over the ceiling on its own
    for r in (big, small, alone):
        sched.add(r)
    first_step = {}
    step = 0
    while sched.has_unfinished():
        out = sched.schedule()
        assert not out.is_empty
        for c in out.chunks:
            first_step.setdefault(c.request.request_id, step)
        sampled = {c.request.request_id: reference_reply(c.request.all_token_ids, 1)[0]
                   for c in out.chunks if c.sample}
        for r in sched.update(out, sampled, time.monotonic()):
            first_step[r.request_id + ".done"] = step
        step += 1
    # small waited for big to finish; alone ran when nothing else did.
    assert first_step["small"] > first_step["big.done"]
    assert first_step["alone"] > first_step["small.done"]
    assert sched.num_ceiling_waits > 0
    for r in (big, small, alone):
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == reference_reply(r.prompt_token_ids, r.sampling_params.max_tokens)
    kv.clear_cache()
    assert kv.pool.num_free == kv.num_blocks


def test_ceiling_out_of_range_is_a_clear_error():
    kv = KVCacheManager(8, B)
    with pytest.raises(ValueError, match="admission ceiling"):
        Scheduler(SchedulerConfig(admission_ceiling=1.5), kv)


def slow_rates():
    # Recompute is slow and the host link is quick enough to pay but slow
    # enough that T*_wait is seconds: a 0.5 s wait is kept, with HOST as fallback.
    return CostRates(prefill_tokens_per_s=1.0, host_bytes_per_s=1000.0, disk_bytes_per_s=1000.0)


@pytest.fixture()
def standin(tmp_path):
    eng = StandInEngine(num_blocks=40, block_size=B)
    mgr = SessionManager(eng, SessionConfig(disk_dir=str(tmp_path)), policy=KeepPolicy(slow_rates()))
    yield eng, mgr
    mgr.shutdown()
    assert eng.kv.reclaimer is None and not eng.kv.tables and not eng.kv.holds
    eng.kv.clear_cache()
    assert eng.kv.pool.num_free == eng.kv.num_blocks
    eng.kv.pool.check()


def test_policy_kept_state_gives_way_to_a_running_turn(standin):
    eng, mgr = standin
    a = mgr.open(unique(1, 60))
    a.generate(greedy(4))
    d = a.pause(expected_wait_s=0.5, tool="pytest")
    assert d.decision is Decision.KEEP and d.fallback is Decision.HOST
    assert eng.kv.num_active_blocks == 15  # a's 63 computed tokens (the last sampled one is not), pinned
    b = mgr.open(unique(2, 100))  # 26 blocks; 25 are free
    out = b.generate(greedy(4))
    assert out.outputs[0].token_ids == reference_reply(unique(2, 100), 4)
    assert mgr.stats.pressure_demotions == 1 and a.tier is Decision.HOST and a.pin is None
    assert eng.kv.num_reclaimed_blocks == 15
    b.close()
    history = list(a.history)
    a.resume([11, 12, 13])
    out = a.generate(greedy(5))
    assert out.num_cached_tokens == 60  # reloaded from host: every computed full block hit
    assert out.outputs[0].token_ids == reference_reply(history + [11, 12, 13], 5)
    assert mgr.stats.resume_stalls == 1 and mgr.stats.prefetch_hits == 0
    a.close()


def test_forced_keep_is_dropped_only_when_nothing_can_run(standin):
    eng, mgr = standin
    a = mgr.open(unique(1, 60))
    a.generate(greedy(4))
    a.pause(decision="keep")
    b = mgr.open(unique(2, 100))
    out = b.generate(greedy(4))  # cannot be admitted next to a's pinned 16 blocks
    assert out.outputs[0].token_ids == reference_reply(unique(2, 100), 4)
    assert mgr.stats.pressure_demotions == 0 and mgr.stats.stall_drops == 1
    assert a.tier is Decision.DROP
    b.close()
    history = list(a.history)
    a.resume([5])
    out = a.generate(greedy(3))
    assert out.outputs[0].token_ids == reference_reply(history + [5], 3)
    a.close()


def test_offloaded_state_is_prefetched_before_a_known_return(standin):
    eng, mgr = standin
    a = mgr.open(unique(1, 60))
    a.generate(greedy(4))
    mgr.policy.rates.host_bytes_per_s = 1e9  # a reload takes ~nothing: prefetch at 0.8 x the wait
    a.pause(expected_wait_s=0.2, tool="lint", decision="host")
    assert a.prefetch_at is not None and a.tier is Decision.HOST
    mgr.flush()  # the save lands on the copy engine
    assert eng.kv.cached_prefix(a.history, a.scope).num_tokens == 0
    time.sleep(0.2)
    mgr.tick()  # starts the prefetch in the background
    assert a.copy is not None and not a.prefetched
    mgr.flush()
    assert a.prefetched and eng.kv.cached_prefix(a.history, a.scope).num_tokens == 60
    history = list(a.history)
    a.resume([7, 8])
    assert mgr.stats.prefetch_hits == 1 and mgr.stats.resume_stalls == 0
    out = a.generate(greedy(3))
    assert out.num_cached_tokens == 60
    assert out.outputs[0].token_ids == reference_reply(history + [7, 8], 3)
    # No hint and no history for the tool: no return time, so no prefetch; the resume loads.
    a.pause(tool="never-seen", decision="host")
    assert a.prefetch_at is None
    mgr.flush()  # the save has landed (a resume before that would find the state still on the device)
    a.resume([9])
    assert mgr.stats.resume_stalls == 1
    a.close()


def test_a_second_manager_on_one_engine_is_refused(standin):
    eng, _ = standin
    with pytest.raises(ValueError, match="already has a session manager"):
        SessionManager(eng)
