"""EngineCore (engine/core.py): one step -- schedule, execute, update -- that
the engine and the simulator both run, and n > 1 samples forked by the
scheduler's update, on the real scheduler and KV manager with an executor
that only picks tokens."""
from trajserve.config import SchedulerConfig
from trajserve.engine.core import EngineCore, ExecutorOutput
from trajserve.request import Request, RequestStatus
from trajserve.engine.scheduler import Scheduler
from trajserve.kv.cache_manager import KVCacheManager
from trajserve.sampling import SamplingParams

B = 4


class Rows:
    """An executor that samples row i of request r as a token derived from both
    (so a fork's children, sampled from the parent's row, get tokens of their own)."""

    def __init__(self, scheduler):
        self.scheduler, self.steps = scheduler, []

    def execute(self, sched):
        ids = [c.request.request_id for c in sched.chunks if c.sample]
        for c in list(sched.chunks):
            ids += [k.request_id for k in self.scheduler.samples_of(c)]
        self.steps.append([(c.request.request_id, c.start, c.num_tokens) for c in sched.chunks])
        return ExecutorOutput(ids, [1000 + len(rid) * 7 + i for i, rid in enumerate(ids)], end=float(len(self.steps)))


def core(num_blocks=64):
    kv = KVCacheManager(num_blocks, B, 0.0, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_prefill_chunk=8), kv)
    ex = Rows(sched)
    return EngineCore(sched, ex), sched, kv, ex


def req(rid, n_prompt=20, max_tokens=3):
    return Request(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True), 10**6)


def test_n_samples_fork_off_the_prefill_in_update_and_the_prompt_is_computed_once():
    c, sched, kv, ex = core()
    parent, kids = req("a#0"), [req("a#1"), req("a#2")]
    sched.add(parent, samples=kids)
    done, checked = [], False
    while sched.has_unfinished():
        rec = c.step()
        done += rec.finished
        if rec.end == 3.0:  # 20 prompt tokens in chunks of 8: the prefill ends in step 3
            assert all(k.status is RequestStatus.RUNNING and k.num_computed_tokens == 20 for k in kids)
            assert kv.table("a#1").block_ids[:5] == kv.table("a#0").block_ids[:5]  # shared, copy-on-write
            firsts = [parent.output_token_ids[0]] + [k.output_token_ids[0] for k in kids]
            assert len(set(firsts)) == 3  # each sampled its own first token from the parent's row
            assert rec.stats.num_seqs == 1  # one sequence was computed
            checked = True
    assert checked
    prefill = sum(n for step in ex.steps for rid, start, n in step if start < 20)
    assert prefill == 20  # the prompt once, not three times
    assert sorted(r.request_id for r in done) == ["a#0", "a#1", "a#2"]
    assert all(len(r.output_token_ids) == 3 for r in [parent, *kids])
    assert not sched.pending_samples


def test_a_request_finished_before_its_prefill_ends_drops_its_samples():
    c, sched, kv, _ = core()
    parent = req("b#0", n_prompt=40)
    sched.add(parent, samples=[req("b#1")])
    c.step()  # a first chunk of the prefill
    sched.finish(parent, RequestStatus.FINISHED_ABORTED)
    assert not sched.pending_samples and c.step() is None
    assert kv.pool.num_used == kv.radix.num_cached_blocks  # nothing but cold cache left


def test_the_engine_and_the_simulator_step_an_engine_core():
    from trajserve.engine import engine as engine_mod
    from trajserve.sim import simulator
    assert engine_mod.EngineCore is EngineCore and simulator.EngineCore is EngineCore
    src = open(simulator.__file__).read()
    assert "sched.schedule()" not in src and "sched.update(" not in src  # the core does both
