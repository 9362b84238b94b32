"""The admission ceiling counts a match's cold blocks, and a resumed
session's state is held for its turn until the turn is admitted
(kv/admission_hold.py), on the real scheduler and KV manager with the
stand-in model (standin_engine.py checks every slot a step reads)."""
import time

from standin_engine import reference_reply
from test_pressure import B, greedy, standin, unique  # noqa: F401 - standin is a fixture
from trajserve.config import SchedulerConfig
from trajserve.request import Request
from trajserve.engine.scheduler import Scheduler
from trajserve.kv.cache_manager import KVCacheManager
from trajserve.kv.scope import CacheScope


def run(sched, until=None):
    """Step until everything finishes (or until(first_step) is true); the step each request first ran."""
    first, step = {}, 0
    while sched.has_unfinished() and not (until and until(first)):
        out = sched.schedule()
        for c in out.chunks:
            first.setdefault(c.request.request_id, step)
        sampled = {c.request.request_id: reference_reply(c.request.all_token_ids, 1)[0]
                   for c in out.chunks if c.sample}
        sched.update(out, sampled, time.monotonic())
        step += 1
    return first


def test_a_match_of_cold_blocks_counts_against_the_ceiling():
    """A prompt whose 12-block prefix is cached but held by nobody: admitting
    it makes those 12 blocks active, so next to a running 12-block request it
    is over a 20-block ceiling and waits (counted as free, it was admitted)."""
    kv = KVCacheManager(40, B, 0.0, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_prefill_chunk=256, admission_ceiling=0.5), kv)
    shared = unique(1, 49)
    sched.add(Request("warm", shared, greedy(1), 10**6))
    run(sched)
    assert kv.radix.num_cached_blocks >= 12 and kv.num_active_blocks == 0  # cached, cold
    sched.add(Request("big", unique(2, 44), greedy(12), 10**6))
    sched.add(Request("again", shared + unique(3, 4), greedy(1), 10**6))
    first = run(sched)
    assert sched.num_ceiling_waits > 0
    assert first["again"] > first["big"] + 10  # it waited for big's decode to end
    kv.clear_cache()
    assert kv.pool.num_free == kv.num_blocks


def kept_and_resumed(mgr, n):
    """A session of an n-token prompt, paused with its state kept, resumed: its turn not yet sent."""
    a = mgr.open(unique(1, n))
    a.generate(greedy(4))
    a.pause(decision="keep")
    a.resume(unique(9, 4))
    return a


def test_a_resumed_state_is_held_until_its_turn_is_admitted(standin):
    eng, mgr = standin
    a = kept_and_resumed(mgr, 60)
    assert len(eng.kv.holds) == 1
    held = eng.kv.num_active_blocks
    assert held >= 15  # the kept path is still active (pinned), not cold cache
    # Another request is admitted and runs meanwhile: the hold is a's turn's, not released for it.
    eng.add_request(unique(5, 60), greedy(2))
    while eng.has_unfinished_requests():
        eng.step()
    assert len(eng.kv.holds) == 1
    assert eng.kv.cached_prefix(a.history[:64], a.scope).num_tokens >= 60
    out = a.generate(greedy(4))
    assert out.num_cached_tokens >= 60
    assert not eng.kv.holds  # admitted: the request holds the path itself now
    assert out.outputs[0].token_ids == reference_reply(out.prompt_token_ids, 4)


def test_a_resume_then_close_lets_the_hold_go(standin):
    eng, mgr = standin
    a = kept_and_resumed(mgr, 40)
    assert len(eng.kv.holds) == 1
    a.close()
    assert not eng.kv.holds and eng.kv.num_active_blocks == 0


def test_under_the_ceiling_other_turns_holds_yield_but_the_heads():
    kv = KVCacheManager(40, B, 0.0, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_prefill_chunk=256), kv)
    paths = [unique(10 * k + 1, 33) for k in range(2)]
    for k, p in enumerate(paths):
        sched.add(Request(f"r{k}", p, greedy(1), 10**6))
    run(sched)
    owners = [object(), object()]
    nodes = [kv.pin(p[:32], CacheScope()) for p in paths]
    for o, n in zip(owners, nodes):
        kv.holds.hold(o, n)
    assert kv.num_active_blocks == 16
    assert kv.holds.yield_except(nodes[0]) == 1 and len(kv.holds) == 1 and kv.num_active_blocks == 8
    kv.radix.lock(nodes[0])  # a request's match locks the head's path: its hold is released
    assert kv.holds.release_admitted() == 1 and not kv.holds
    kv.radix.unlock(nodes[0])
    assert kv.num_active_blocks == 0
