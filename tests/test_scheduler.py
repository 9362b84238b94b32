"""Scheduler tests with a stand-in model: the next token is a hash of the
whole token history, so any scheduling mistake (lost token, wrong order,
recompute from a wrong prefix) changes the output."""
import time
from collections import Counter

from hypothesis import given, settings, strategies as st

from trajserve.config import SchedulerConfig
from trajserve.request import Request, RequestStatus
from trajserve.engine.scheduler import Scheduler
from trajserve.kv.block_table import blocks_for
from trajserve.kv.cache_manager import KVCacheManager
from trajserve.sampling import SamplingParams

VOCAB = 1000


def next_token(history):
    return hash(tuple(history)) % VOCAB


def reference(prompt, max_tokens):
    toks = list(prompt)
    for _ in range(max_tokens):
        toks.append(next_token(toks))
    return toks[len(prompt):]


def make_requests(specs, max_total_tokens=10**9):
    return [Request(f"r{i}", [((i + 1) * 31 + j) % VOCAB for j in range(p)],
                    SamplingParams(max_tokens=m, temperature=0, ignore_eos=True), max_total_tokens)
            for i, (p, m) in enumerate(specs)]


def drive(sched: Scheduler, kv: KVCacheManager, check=None, max_steps=5000):
    steps = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return steps
        out = sched.schedule()
        assert not out.is_empty, "scheduler stalled with work left"
        for c in out.chunks:
            # The KV for every token this step computes has a slot.
            assert len(c.block_ids) * kv.block_size >= c.end
            assert c.start == c.request.num_computed_tokens
        if check:
            check(out)
        sampled = {c.request.request_id: next_token(c.request.all_token_ids)
                   for c in out.chunks if c.sample}
        steps.append(out)
        sched.update(out, sampled, time.monotonic())
        kv.pool.check()
    raise AssertionError("did not finish")


def test_budget_chunk_cap_and_decode_first():
    kv = KVCacheManager(1000, 16, 0.0)
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_prefill_chunk=24)
    sched = Scheduler(cfg, kv)
    reqs = make_requests([(100, 5), (3, 20), (50, 5), (200, 3)])
    for r in reqs:
        sched.add(r)

    def check(out):
        assert out.num_batched_tokens <= 64
        assert all(c.num_tokens <= 24 for c in out.chunks)
        kinds = [c.num_tokens == 1 and c.start > 0 for c in out.chunks]
        # decodes (1 token past the prompt) never come after a prefill chunk
        assert kinds == sorted(kinds, reverse=True)

    steps = drive(sched, kv, check)
    assert any(len({c.num_tokens for c in s.chunks}) > 1 for s in steps), "never mixed prefill and decode"
    for r in reqs:
        assert r.output_token_ids == reference(r.prompt_token_ids, r.sampling_params.max_tokens)
        assert r.status is RequestStatus.FINISHED_LENGTH
    assert kv.pool.num_free == kv.num_blocks


def test_preemption_recompute_gives_identical_output():
    # 6 requests that each need ~5 blocks at the end, a pool of 12: preemption is forced.
    kv = KVCacheManager(12, 8, 0.0)
    # Ceiling off: admit everything and let the pool run short (this tests preemption).
    sched = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=64, max_prefill_chunk=64,
                                      admission_ceiling=1.0), kv)
    reqs = make_requests([(20, 20)] * 6)
    for r in reqs:
        sched.add(r)
    drive(sched, kv)
    assert sched.num_preemptions > 0
    for r in reqs:
        assert r.output_token_ids == reference(r.prompt_token_ids, 20)
    assert kv.pool.num_free == 12


def test_fcfs_preempts_newest_first():
    kv = KVCacheManager(6, 4, 0.0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=100, max_prefill_chunk=100,
                                      admission_ceiling=1.0, scheduling="fcfs"), kv)
    # 38 tokens each would not fit the 24-token pool even alone: the engine
    # caps a request at the pool's capacity, so it finishes with "length".
    a, b, c = make_requests([(8, 30), (8, 30), (7, 30)], max_total_tokens=kv.token_capacity)
    for r in (a, b, c):
        sched.add(r)
    victims = []
    for _ in range(1000):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        victims += [v.request_id for v in out.preempted]
        sched.update(out, {x.request.request_id: next_token(x.request.all_token_ids)
                           for x in out.chunks if x.sample}, 0.0)
    assert not sched.has_unfinished()
    assert victims and victims[0] == "r2"
    assert all(r.status is RequestStatus.FINISHED_LENGTH and r.num_tokens == 24 for r in (a, b, c))


@settings(max_examples=60, deadline=None)
@given(
    specs=st.lists(st.tuples(st.integers(1, 90), st.integers(1, 30)), min_size=1, max_size=10),
    block_size=st.sampled_from([1, 4, 16]),
    budget=st.integers(1, 128),
    cap=st.integers(1, 128),
    max_seqs=st.integers(1, 8),
    spare_blocks=st.integers(0, 30),
)
def test_random_workloads_finish_exactly(specs, block_size, budget, cap, max_seqs, spare_blocks):
    # The pool always fits the largest single request, sometimes not much more.
    biggest = max(blocks_for(p + m, block_size) for p, m in specs)
    kv = KVCacheManager(biggest + spare_blocks, block_size, 0.0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                      max_prefill_chunk=cap), kv)
    reqs = make_requests(specs)
    for r in reqs:
        sched.add(r)

    def check(out):
        assert out.num_batched_tokens <= budget
        assert len(sched.running) <= max_seqs
        ids = Counter(c.request.request_id for c in out.chunks)
        assert max(ids.values()) == 1
        # refcounts equal the block-table references
        refs = Counter(b for t in kv.tables.values() for b in t.block_ids)
        for b in range(kv.num_blocks):
            assert kv.pool.ref_counts[b] == refs.get(b, 0)

    drive(sched, kv, check)
    for r in reqs:
        assert r.output_token_ids == reference(r.prompt_token_ids, r.sampling_params.max_tokens)
    assert kv.pool.num_free == kv.num_blocks and not kv.tables


@settings(max_examples=50, deadline=None)
@given(
    specs=st.lists(st.tuples(st.integers(0, 60), st.integers(1, 40), st.integers(1, 20)), min_size=1, max_size=8),
    block_size=st.sampled_from([1, 4, 16]),
    budget=st.integers(4, 96),
    spare_blocks=st.integers(0, 20),
)
def test_prefix_cache_under_pressure_keeps_outputs_and_refcounts(specs, block_size, budget, spare_blocks):
    """Requests share prefixes of random lengths; a small pool forces eviction
    and preemption. Outputs equal the stand-in model's, and every block's
    refcount = block tables holding it + 1 if the radix tree stores it."""
    shared = [7 + (j * 13) % 97 for j in range(60)]
    prompts = [shared[:s] + [(i * 17 + j) % VOCAB for j in range(u)] for i, (s, u, _) in enumerate(specs)]
    biggest = max(blocks_for(len(p) + m, block_size) for p, (_, _, m) in zip(prompts, specs))
    kv = KVCacheManager(biggest + spare_blocks, block_size, 0.0, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_prefill_chunk=budget), kv)
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=m, temperature=0, ignore_eos=True), 10**9)
            for i, (p, (_, _, m)) in enumerate(zip(prompts, specs))]
    for r in reqs:
        sched.add(r)

    def check(out):
        refs = Counter(b for t in kv.tables.values() for b in t.block_ids)
        for node in kv.radix.iter_nodes():
            refs.update(node.block_ids)
        for b in range(kv.num_blocks):
            assert kv.pool.ref_counts[b] == refs.get(b, 0), f"block {b}"

    drive(sched, kv, check)
    for r in reqs:
        assert r.output_token_ids == reference(r.prompt_token_ids, r.sampling_params.max_tokens)
    assert not kv.tables
    kv.clear_cache()
    assert kv.pool.num_free == kv.num_blocks
    kv.pool.check()


def test_later_requests_hit_blocks_of_earlier_ones():
    shared = [7 + (j * 13) % 97 for j in range(48)]
    prompts = [shared + [(i * 17 + j) % VOCAB for j in range(5)] for i in range(4)]
    kv = KVCacheManager(40, 4, 0.0, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_prefill_chunk=32), kv)
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), 10**9)
            for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add(r)
    drive(sched, kv)
    # The budget admits the first request alone; the second arrives while its
    # blocks are half computed, the rest after all 12 shared blocks are cached.
    assert [r.num_cached_tokens for r in reqs] == [0, 32, 48, 48]
    assert sched.prefix_hit_rate == (32 + 48 + 48) / (4 * 53)  # eq. 2
    for r in reqs:
        assert r.output_token_ids == reference(r.prompt_token_ids, 10)


def test_a_preempted_request_that_needs_the_whole_pool_is_readmitted():
    """Two requests share a 93-block prefix and each grows to the whole
    100-block pool: the newer is preempted, the older finishes and leaves
    the pool full of cached blocks. Readmitting the newer needs 4 blocks
    and only 7 are free or reclaimable: with the 5-block watermark held
    back for running decodes it could never get in, and the FCFS head
    blocked everyone behind it. With nothing running there is no decode to
    hold the watermark for."""
    kv = KVCacheManager(100, 4, 0.05, enable_prefix_caching=True)
    assert kv.watermark_blocks == 5
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512, max_prefill_chunk=512,
                                      admission_ceiling=1.0), kv)
    shared = [(j * 7 + 3) % VOCAB for j in range(372)]
    reqs = [Request(f"r{i}", shared + [i + 1], SamplingParams(max_tokens=27, temperature=0, ignore_eos=True),
                    kv.token_capacity) for i in range(2)]
    late = Request("late", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                   kv.token_capacity)
    for r in (*reqs, late):
        sched.add(r)
    drive(sched, kv)
    assert sched.num_preemptions >= 1
    for r in (*reqs, late):
        assert r.output_token_ids == reference(r.prompt_token_ids, r.sampling_params.max_tokens)
