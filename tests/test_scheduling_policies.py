"""--scheduling fcfs | priority | program on the scheduler with a stand-in
model (tests/test_scheduler.py's: the next token a hash of the history):
the order calls are admitted and preempted in, the attained service that
orders programs, and the same tokens under every policy."""
import math
import time

import pytest
from hypothesis import given, settings, strategies as st

from test_scheduler import drive, make_requests, next_token, reference
from trajserve.config import SchedulerConfig
from trajserve.engine.attained_service import AttainedService
from trajserve.engine.program_precedence import (LEVEL_TOKENS, PREEMPT_SERVICE_MIN, outranks, program_rank,
                                                   service_level)
from trajserve.engine.scheduler import Scheduler
from trajserve.request import check_priority
from trajserve.kv.cache_manager import KVCacheManager


def _admitted_order(policy: str, reqs, kv_blocks: int = 1000, **cfg) -> list[str]:
    kv = KVCacheManager(kv_blocks, 16, 0.0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=256, scheduling=policy, **cfg), kv)
    for r in reqs:
        sched.add(r)
    order = []

    def check(out):
        for c in out.chunks:
            if c.start == 0 and c.request.request_id not in order:
                order.append(c.request.request_id)
    drive(sched, kv, check)
    for r in reqs:  # every policy computes the same tokens
        assert r.all_token_ids[len(r.prompt_token_ids):] == reference(r.prompt_token_ids, r.sampling_params.max_tokens)
    return order


def test_priority_admits_lower_values_first_and_arrival_breaks_ties():
    def reqs():
        rs = make_requests([(20, 3)] * 4)
        for r, p in zip(rs, [5, 0, 3, 0]):
            r.priority = p
        return rs
    assert _admitted_order("fcfs", reqs()) == ["r0", "r1", "r2", "r3"]
    assert _admitted_order("priority", reqs()) == ["r1", "r3", "r2", "r0"]


def test_program_scheduling_puts_the_least_served_program_first():
    """A long program's next call arrived first; a new program's first call
    after it. FCFS and priority serve the long program; program scheduling
    the new one, until the service it has attained passes the other's."""
    def reqs():
        rs = make_requests([(20, 3), (20, 3), (20, 3)])
        rs[0].program, rs[1].program, rs[2].program = "long", "short", "long"
        return rs
    for policy in ("fcfs", "priority"):
        assert _admitted_order(policy, reqs()) == ["r0", "r1", "r2"]
    kv = KVCacheManager(1000, 16, 0.0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, scheduling="program"), kv)
    sched.now = time.monotonic()  # drive()'s clock
    sched.service.add("long", 5000, sched.now)  # what its earlier calls were served
    rs = reqs()
    for r in rs:
        sched.add(r)
    order = []
    drive(sched, kv, lambda out: order.extend(c.request.request_id for c in out.chunks
                                              if c.start == 0 and c.request.request_id not in order))
    assert order == ["r1", "r0", "r2"]
    # 20 prompt rows and 2 decode rows (the third output is sampled, never computed)
    assert sched.service.of("short", sched.now) == pytest.approx(22, rel=0.01)


def _program_order(calls, served: dict[str, tuple[int, float]]) -> list[str]:
    """Calls (program, prompt length) queued in that order, one slot,
    program scheduling; served: program -> (service attained, seconds ago
    its first call arrived). The order their prefills start in."""
    kv = KVCacheManager(1000, 16, 0.0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, scheduling="program"), kv)
    sched.now = time.monotonic()  # drive()'s clock
    for program, (tokens, arrived) in served.items():
        sched.service.add(program, tokens, sched.now, arrived=sched.now - arrived)
    rs = make_requests([(n, 2) for _, n in calls])
    for r, (program, _) in zip(rs, calls):
        r.program = program
        sched.add(r)
    order = []
    drive(sched, kv, lambda out: order.extend(c.request.program for c in out.chunks
                                              if c.start == 0 and c.request.program not in order))
    return order


def test_within_a_service_level_the_program_that_started_first_goes_first():
    """A new program's first call queued before the next call of a program
    that started earlier and has had a little (level 0, as the newcomer):
    the older program goes first. One that has had more (a level up) goes
    after the newcomer, however early it started."""
    little, more = LEVEL_TOKENS // 2, 2 * LEVEL_TOKENS
    assert _program_order([("new", 20), ("old", 20)], {"old": (little, 30.0)}) == ["old", "new"]
    assert _program_order([("new", 20), ("old", 20)], {"old": (more, 30.0)}) == ["new", "old"]
    # Of two in one level, the start orders them, not the service.
    assert _program_order([("a", 20), ("b", 20)], {"a": (10, 1.0), "b": (LEVEL_TOKENS - 20, 5.0)}) == ["b", "a"]


def test_service_levels_double_and_outranking_means_a_lower_level():
    L = LEVEL_TOKENS
    assert [service_level(s) for s in (0, L - 1, L, 2 * L - 1, 2 * L, 4 * L - 1, 4 * L, 2**12 * L)] == \
        [0, 0, 1, 1, 2, 2, 3, 13]

    @given(st.floats(0, 1e7), st.floats(0, 1e7), st.floats(0, 100), st.floats(0, 100))
    @settings(max_examples=300, deadline=None)
    def agree(a, b, ta, tb):
        ra, rb = program_rank(0, a, ta, 0), program_rank(0, b, tb, 0)
        if outranks(ra, rb):  # what takes a slot or holds rows also sorts first
            assert ra[1] < rb[1] and ra < rb
    agree()


def test_a_calls_own_quantum_does_not_drop_its_level():
    """A new program's call of 1.5 LEVEL_TOKENS prompt tokens: once its
    prefill ran, the program has attained that (level 1), but the call
    itself ranks in level 0 (its first LEVEL_TOKENS are its quantum); the
    program's next call, computing nothing yet, ranks in level 1."""
    n = LEVEL_TOKENS * 3 // 2
    kv = KVCacheManager(1000, 16, 0.0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=512, scheduling="program"), kv)
    first, later = make_requests([(n, 8), (20, 2)])
    first.program = later.program = "p"
    sched.add(first)
    out = sched.schedule()
    sched.update(out, {first.request_id: 7}, sched.now + 0.01)
    assert sched.service.of("p", sched.now) == pytest.approx(n, rel=0.01)
    rank = sched.ranking()
    assert rank(first)[1] == 0 and rank(later)[1] == 1


def test_attained_service_keeps_when_the_program_started():
    s = AttainedService(60.0)
    assert s.started("p") is None
    s.add("p", 10, 5.0, arrived=4.0)
    s.add("p", 10, 9.0, arrived=8.5)  # a later call: the start stays
    assert s.started("p") == 4.0
    s.add("q", 10, 5.0)  # no arrival given: when first served
    assert s.started("q") == 5.0


def test_priority_outranks_attained_service():
    kv = KVCacheManager(1000, 16, 0.0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, scheduling="program"), kv)
    sched.service.add("busy", 10**6, 0.0)
    rs = make_requests([(20, 2), (20, 2)])
    rs[0].program, rs[1].program = "idle", "busy"
    rs[1].priority = -1
    for r in rs:
        sched.add(r)
    assert sched.schedule().chunks[0].request is rs[1]


def test_attained_service_halves_every_half_life_and_stays_bounded(monkeypatch):
    s = AttainedService(60.0)
    s.add("a", 100, 0.0)
    assert s.of("a", 60.0) == pytest.approx(50.0) and s.of("a", 120.0) == pytest.approx(25.0)
    s.add("a", 10, 60.0)
    assert s.of("a", 60.0) == pytest.approx(60.0)
    assert s.of("never", 5.0) == 0.0
    import trajserve.engine.attained_service as mod
    monkeypatch.setattr(mod, "MAX_PROGRAMS", 8)
    for i in range(20):
        s.add(f"p{i}", i + 1, 60.0)
    assert len(s) <= 8 and s.of("p19", 60.0) == 20  # the most-served stay
    with pytest.raises(ValueError, match="half-life"):
        AttainedService(0.0)


@pytest.mark.parametrize("policy, victim", [("fcfs", "r1"), ("priority", "r0"), ("program", "r0")])
def test_the_lowest_priority_running_request_is_preempted_first(policy, victim):
    """Two requests grow until the pool is short: FCFS preempts the newest
    (r1, the urgent one); priority and program scheduling the one of
    the lowest priority (r0), whatever its age."""
    kv = KVCacheManager(6, 16, 0.0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, scheduling=policy), kv)
    rs = make_requests([(30, 40), (30, 40)])
    rs[0].priority, rs[1].priority = 5, 0
    sched.add(rs[0])
    sched.schedule()  # r0 admitted first
    sched.add(rs[1])
    first = {}

    def check(out):
        for r in out.preempted:
            first.setdefault("victim", r.request_id)
    drive(sched, kv, check)
    assert first["victim"] == victim
    for r in rs:
        assert r.all_token_ids[30:] == reference(r.prompt_token_ids, 40)


@settings(max_examples=25, deadline=None)
@given(specs=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 12), st.integers(-2, 2), st.integers(0, 3)),
                      min_size=1, max_size=10),
       blocks=st.integers(18, 40), policy=st.sampled_from(["fcfs", "priority", "program"]))
def test_every_policy_computes_every_request_exactly(specs, blocks, policy):
    """Any mix of priorities and programs, under a pool that forces
    preemption (each fits alone: 72 tokens in 18 blocks of 4): every
    request gets the tokens it gets alone."""
    kv = KVCacheManager(blocks, 4, 0.0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, scheduling=policy), kv)
    rs = make_requests([(p, m) for p, m, _, _ in specs])
    for r, (_, _, prio, prog) in zip(rs, specs):
        r.priority, r.program = prio, f"prog{prog}"
        sched.add(r)
    drive(sched, kv)
    for r in rs:
        assert r.all_token_ids[len(r.prompt_token_ids):] == reference(r.prompt_token_ids, r.sampling_params.max_tokens)


@pytest.mark.parametrize("bad", [1.5, True, "1", 10**6, -10**6, math.nan, None])
def test_a_bad_priority_is_refused_by_name(bad):
    with pytest.raises(ValueError, match=r"priority must be an integer in \[-1000, 1000\]"):
        check_priority(bad)


def test_an_unknown_policy_is_refused_and_the_policy_is_fixed():
    with pytest.raises(ValueError, match="scheduling must be one of fcfs, priority, program"):
        SchedulerConfig(scheduling="lifo")
    sched = Scheduler(SchedulerConfig(scheduling="priority"), KVCacheManager(10, 16, 0.0))
    sched.reconfigure(max_num_batched_tokens=32)
    with pytest.raises(ValueError, match="fixed"):
        sched.reconfigure(scheduling="fcfs")


assert next_token  # the stand-in model the helpers drive


@pytest.mark.parametrize("policy, head_priority, served, taken", [
    ("fcfs", -5, 0, False),         # FCFS never displaces a running call
    ("priority", -5, 0, True),      # an urgent call takes the slot of a default one
    ("priority", 0, 0, False),      # an equal one waits
    ("program", 0, 10_000, True),   # a new program displaces one that has had 10,000 tokens
    # ... not one that has had 30 prompt rows + PREEMPT_SERVICE_MIN - 100 <= 2 x 0 + PREEMPT_SERVICE_MIN
    ("program", 0, PREEMPT_SERVICE_MIN - 100, False),
])
def test_a_full_house_gives_the_queues_head_a_slot_only_when_it_outranks(policy, head_priority, served, taken):
    kv = KVCacheManager(1000, 16, 0.0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, scheduling=policy), kv)
    long_call, head = make_requests([(30, 50), (20, 4)])
    long_call.program, head.program = "long", "new"
    head.priority = head_priority
    sched.add(long_call)
    sched.now = time.monotonic()
    sched.update(sched.schedule(), {}, sched.now)  # running, its prompt computed
    if sched.service is not None:
        sched.service.add("long", served, sched.now)
    sched.add(head)
    out = sched.schedule()
    assert (out.preempted == [long_call]) == taken
    nxt = sched.schedule() if taken else None
    if taken:  # the head runs the step after, the displaced call waits behind it
        assert [c.request for c in nxt.chunks] == [head] and list(sched.waiting) == [long_call]


@pytest.mark.parametrize("policy, head_priority, taken", [
    ("fcfs", -5, False),      # FCFS: the head waits for the pool
    ("priority", -5, True),   # an urgent call sends the default ones back until it fits
    ("priority", 0, False),   # an equal one waits
    ("program", -5, True),
])
def test_a_full_pool_makes_room_for_a_head_that_outranks(policy, head_priority, taken):
    """Slots are free but two running calls hold 10 of the pool's 12 blocks;
    the head needs 4: under priority scheduling the newest it outranks goes
    back (one is enough) and the head runs the step after; every call still
    gets the tokens it gets alone."""
    kv = KVCacheManager(12, 16, 0.0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, scheduling=policy), kv)
    a, b, head = make_requests([(70, 40), (70, 40), (60, 4)])
    head.priority = head_priority
    sched.add(a)
    sched.add(b)
    _step(sched)  # both running, their prompts computed (10 blocks)
    sched.add(head)
    out = _step(sched)
    assert out.preempted == ([b] if taken else [])
    if taken:
        nxt = _step(sched)
        assert head in [c.request for c in nxt.chunks] and list(sched.waiting) == [b]
    drive(sched, kv)
    for r in (a, b, head):
        assert r.all_token_ids[len(r.prompt_token_ids):] == reference(r.prompt_token_ids, r.sampling_params.max_tokens)


def _step(sched: Scheduler, now: float | None = None):
    """One step of the stand-in model (drive's, once), its clock at `now`
    seconds (drive's clock, time.monotonic(), by default)."""
    out = sched.schedule()
    sched.update(out, {c.request.request_id: next_token(c.request.all_token_ids) for c in out.chunks if c.sample},
                 time.monotonic() if now is None else now)
    return out


@pytest.mark.parametrize("policy, kept, dropped", [("priority", "r0", "r1"), ("program", "r0", "r1"),
                                                   ("fcfs", "r1", "r0")])
def test_a_high_priority_conversations_blocks_are_the_last_evicted(policy, kept, dropped):
    """r0 (priority -2) finishes before r1 (priority 5); a larger prompt then
    needs room. Under priority and program scheduling the prefix cache gives
    up r1's blocks and keeps r0's; FCFS ignores priorities: plain LRU takes
    r0's, the older."""
    kv = KVCacheManager(14, 16, 0.0, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=256, scheduling=policy), kv)
    urgent, bulk, big = make_requests([(64, 1), (64, 1), (128, 1)])
    urgent.priority, bulk.priority = -2, 5
    for r in (urgent, bulk, big):
        sched.add(r)
        drive(sched, kv)
    held = {r.request_id: kv.cached_prefix(r.prompt_token_ids, r.cache_scope) for r in (urgent, bulk)}
    assert held[kept] is not None and held[kept].num_tokens == 64
    assert held[dropped] is None or held[dropped].num_tokens == 0


def _decoding_short_and_long(policy: str, proposer=None, long_served: int = 10_000, short_priority: int = 0):
    """A long program (long_served tokens so far) and a new one; the new
    one's call (priority short_priority) decodes (its prompt computed), the
    long one's call is queued."""
    kv = KVCacheManager(1000, 16, 0.0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, scheduling=policy), kv,
                      proposer=proposer)
    short, long_call = make_requests([(20, 30), (90, 30)])
    short.program, long_call.program = "new", "long"
    short.priority = short_priority
    if sched.service is not None:
        sched.service.add("long", long_served, 0.0)
    sched.add(short)
    _step(sched, 0.0)
    sched.add(long_call)
    return sched, kv, short, long_call


@pytest.mark.parametrize("policy, urgent, held", [("fcfs", False, False), ("fcfs", True, False),
                                                   ("priority", False, False), ("priority", True, True),
                                                   ("program", False, True)])
def test_an_outranked_prefill_waits_while_a_less_served_program_decodes(policy, urgent, held):
    """Program scheduling, or priority scheduling when the new program's
    call is the more urgent: the long program's prefill stays out of the
    new program's decode steps for HOLD_S, then runs; otherwise it runs at
    once. Every call still gets the tokens it gets alone."""
    from trajserve.engine.program_precedence import HOLD_S
    sched, kv, short, long_call = _decoding_short_and_long(policy, short_priority=-1 if urgent else 0)
    ran = []
    for k in range(1, 11):  # a step schedules at the clock of the update before it: 0, HOLD_S / 8, ...
        out = _step(sched, k * HOLD_S / 8)
        ran.append(any(c.request is long_call for c in out.chunks))
        assert any(c.request is short for c in out.chunks)  # the short call decodes every step
    assert ran.index(True) == (8 if held else 0)
    drive(sched, kv)
    for r in (short, long_call):
        assert r.all_token_ids[len(r.prompt_token_ids):] == reference(r.prompt_token_ids, r.sampling_params.max_tokens)


def test_a_running_outranked_prefill_is_held_and_held_prefills_go_one_a_step():
    """Two long calls mid-prefill (chunks of 32) when a new program's call
    starts decoding: both wait; when their time is up, one goes a step
    (the less served first), not both at once."""
    from trajserve.engine.program_precedence import HOLD_S
    kv = KVCacheManager(1000, 16, 0.0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=128, max_prefill_chunk=32,
                                      scheduling="program"), kv)
    a, b, short = make_requests([(200, 5), (200, 5), (10, 40)])
    a.program, b.program, short.program = "a", "b", "new"
    sched.service.add("a", 5_000, 0.0)
    sched.service.add("b", 9_000, 0.0)
    sched.add(a)
    sched.add(b)
    _step(sched, 0.0)  # both started their prompts
    sched.add(short)
    _step(sched, 0.0)  # the short prompt is computed whole (rank first)
    assert short.num_computed_tokens == 10 and 0 < a.num_computed_tokens < 200
    for t in (0.1, HOLD_S):  # scheduled at the clocks 0.0 and 0.1: held
        assert [c.request for c in _step(sched, t).chunks] == [short]
    went, t = [], HOLD_S
    while b.num_computed_tokens < 200:
        t += 0.01
        out = _step(sched, t)
        went.append([c.request.program for c in out.chunks if c.num_tokens > 1])
        assert short.status.name == "RUNNING"  # the short call decodes throughout: it is what holds them
    assert all(len(w) == 1 for w in went)  # one a step
    assert went == [["a"]] * went.count(["a"]) + [["b"]] * went.count(["b"]) and went.count(["a"]) >= 5
    drive(sched, kv)
    for r in (a, b, short):
        assert r.all_token_ids[len(r.prompt_token_ids):] == reference(r.prompt_token_ids, r.sampling_params.max_tokens)


class _AlwaysDrafts:
    """A stand-in proposer: two draft tokens for every decode it is asked about."""

    def __init__(self):
        self.asked = []

    def begin_step(self, num_decodes, num_prefill_tokens):
        pass

    def propose(self, req, limit):
        self.asked.append(req.request_id)
        return [1, 2][:limit]

    def observe(self, req, drafted, accepted):
        pass

    def release(self, req):
        pass


def test_an_outranked_decode_drafts_nothing_while_a_less_served_program_decodes():
    """Both calls decode; the long program has had 20,000 tokens: only the
    new program's call is offered drafts."""
    proposer = _AlwaysDrafts()
    sched, kv, short, long_call = _decoding_short_and_long("program", proposer, long_served=0)
    _step(sched, 0.0)  # the long call's prompt, beside the short call's decode
    sched.service.add("long", 20_000, 0.0)
    assert long_call.num_computed_tokens == 90 and short.num_computed_tokens > 20
    proposer.asked.clear()
    out = sched.schedule()
    drafts = {c.request.request_id: tuple(c.draft) for c in out.chunks}
    assert drafts == {short.request_id: (1, 2), long_call.request_id: ()} and proposer.asked == [short.request_id]
