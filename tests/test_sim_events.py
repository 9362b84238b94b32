"""The simulator's event loop: arrivals, tool waits, idle jumps, concurrency
gates, forks, and the token streams that make later turns hit the cache.

Every step is observed through Simulator.on_step (start time, end time,
what ran), so the tests check the clock against each request's arrival
rather than trusting the simulator's own records.
"""
from __future__ import annotations

import numpy as np
import pytest

from trajserve.config import SchedulerConfig
from trajserve.plan.catalog import get_device, get_model
from trajserve.sim.build import SimSetup
from trajserve.sim.hardware import Hardware, ModelCost
from trajserve.sim.synthetic import AgentSpec, ChatSpec, agent_sessions, arrival_times, chat_sessions, wait_sampler
from trajserve.sim.workload import Call, Session, extend_with_fresh, fixed


def setup(num_blocks: int = 20_000, budget: int = 2048, seqs: int = 64) -> SimSetup:
    return SimSetup(Hardware.from_device(get_device("h100")), ModelCost.from_spec(get_model("llama-3-70b"), 8),
                    num_blocks, 16, SchedulerConfig(seqs, budget, budget))


def run(sessions_fn, s: SimSetup | None = None, **kw):
    s = s or setup()
    sim, tokens = s.simulator(**kw)
    steps = []
    sim.on_step = lambda t0, t1, out: steps.append((t0, t1, [(c.request, c.start, c.num_tokens) for c in out.chunks]))
    res = sim.run(sessions_fn(tokens))
    return res, steps


def test_no_request_runs_before_it_arrives_and_idle_jumps_to_arrivals():
    arrivals = [0.0, 0.004, 0.5, 3.0, 3.0, 100.0]

    def sessions(tokens):
        return [Session(f"s{i}", [Call(fixed(lambda: tokens.fresh(300)), 20, arrival=t)])
                for i, t in enumerate(arrivals)]

    res, steps = run(sessions)
    first_step = {}
    for t0, t1, chunks in steps:
        assert t1 > t0
        for req, start, n in chunks:
            assert req.arrival_time <= t0, f"{req.request_id} ran at {t0} before arriving at {req.arrival_time}"
            first_step.setdefault(req.request_id, t0)
    for i, t in enumerate(arrivals):
        rid = f"s{i}#0"
        assert first_step[rid] >= t
    # s5 arrives long after the rest finished: the clock jumps straight to it.
    assert first_step["s5#0"] == 100.0
    # s1 arrives during the first step: it waits for that step to end.
    assert first_step["s1#0"] == steps[0][1]
    # Consecutive steps never overlap.
    assert all(a[1] <= b[0] for a, b in zip(steps, steps[1:]))
    assert len(res.records) == len(arrivals) and list(res.records.col("output_tokens")) == [20] * 6


def test_turn_arrives_after_the_previous_turn_ends_plus_its_tool_wait():
    waits = [0.0, 2.0, 0.25, 7.5]

    def sessions(tokens):
        calls = [Call(fixed(lambda: tokens.fresh(500)), 30, arrival=1.0, turn=1)]
        calls += [Call(extend_with_fresh(lambda: tokens.fresh(200)), 30, wait=w, turn=k + 2)
                  for k, w in enumerate(waits[1:])]
        other = [Call(fixed(lambda: tokens.fresh(800)), 200, arrival=0.0)]  # keeps the engine busy meanwhile
        return [Session("agent", calls), Session("other", other)]

    res, steps = run(sessions)
    r = res.records
    rows = {n: k for k, n in enumerate(r.name)}
    finish, arrival = r.col("finish"), r.col("arrival")
    first_step = {}
    for t0, _, chunks in steps:
        for req, _, _ in chunks:
            first_step.setdefault(req.request_id, t0)
    assert arrival[rows["agent#0"]] == 1.0
    for k in range(1, len(waits)):
        prev, cur = rows[f"agent#{k - 1}"], rows[f"agent#{k}"]
        assert arrival[cur] == pytest.approx(finish[prev] + waits[k], abs=1e-12)
        assert first_step[f"agent#{k}"] >= arrival[cur]
    # Each turn re-sends the conversation: prompt = previous prompt + outputs + tool result.
    prompts = r.col("prompt_tokens")
    for k in range(1, len(waits)):
        assert prompts[rows[f"agent#{k}"]] == prompts[rows[f"agent#{k - 1}"]] + 30 + 200
    # ... and finds it in the prefix cache: all full blocks but the last token's.
    cached = r.col("cached_tokens")
    for k in range(1, len(waits)):
        prev_len = prompts[rows[f"agent#{k - 1}"]] + 30 - 1  # the last sampled token was never computed
        assert cached[rows[f"agent#{k}"]] == prev_len // 16 * 16


def test_max_concurrency_one_runs_requests_alone_in_arrival_order():
    res, steps = run(lambda tok: chat_sessions(ChatSpec(num_requests=12, input_len=600, output_len=8, rate=50.0),
                                               tok), max_concurrency=1)
    assert all(len({id(req) for req, _, _ in chunks}) == 1 for _, _, chunks in steps)
    r = res.records
    assert list(r.name) == [f"chat{i}#0" for i in range(12)]
    assert (r.col("arrival")[1:] >= r.col("finish")[:-1]).all()


def test_fork_branches_share_blocks_and_continue_on_their_own():
    spec = AgentSpec(trajectories=2, turns=3, preamble_tokens=500, task_tokens=20, tool_min_tokens=50,
                     tool_max_tokens=50, reply_tokens=12, tool_wait="const:1.5", branching=3, branch_turn=2)
    res, steps = run(lambda tok: agent_sessions(spec, tok))
    r = res.records
    names = list(r.name)
    turns = r.col("turn")
    # Turn 1 once per trajectory; turn 2 forks into 3; each branch runs its own turn 3.
    assert sorted(turns.tolist()) == [1, 1] + [2] * 6 + [3] * 6
    assert (r.col("output_tokens") == 12).all()
    assert sum(r.col("branch")) == 4  # two fork children per trajectory
    assert res.cow_copies >= 2 * 2  # each child copies the shared, partly filled tail block
    for i in range(2):
        for b in ("", ".b1", ".b2"):
            # Branch j of turn 2 is request traj{i}#1.b{j}; its session traj{i}.b{j} runs turn 3.
            prev, nxt = names.index(f"traj{i}#1{b}"), names.index(f"traj{i}{b}#2")
            assert r.col("arrival")[nxt] == pytest.approx(r.col("finish")[prev] + 1.5, abs=1e-12)


def test_trajectory_starts_follow_the_rate_and_waits_their_distribution():
    rng = np.random.default_rng(1)
    t = arrival_times(20_000, 4.0, 1.0, rng)
    assert t[0] == 0.0 and (np.diff(t) >= 0).all()
    assert np.mean(np.diff(t)) == pytest.approx(0.25, rel=0.03)  # Poisson at 4/s
    assert (arrival_times(5, float("inf"), 1.0, rng) == 0).all()
    w = wait_sampler("exp:2")(rng, 20_000)
    assert w.mean() == pytest.approx(2.0, rel=0.05)
    assert (wait_sampler("const:0.5")(rng, 3) == 0.5).all()
    u = wait_sampler("uniform:1,3")(rng, 1000)
    assert u.min() >= 1 and u.max() <= 3
    with pytest.raises(ValueError, match="tool wait"):
        wait_sampler("gauss:1")


def test_prompt_larger_than_the_pool_is_rejected_and_the_rest_runs():
    def sessions(tokens):
        return [Session("big", [Call(fixed(lambda: tokens.fresh(5000)), 4, arrival=0.0)]),
                Session("ok", [Call(fixed(lambda: tokens.fresh(100)), 4, arrival=0.0)])]

    res, _ = run(sessions, setup(num_blocks=200))
    assert res.rejected == ["big#0"]
    assert list(res.records.name) == ["ok#0"]


def test_timeline_records_u_kv_every_step():
    res, steps = run(lambda tok: chat_sessions(ChatSpec(num_requests=30, input_len=2000, output_len=40,
                                                        prefix_len=1000, rate=100.0), tok), setup(num_blocks=3000))
    tl = res.timeline
    assert len(tl.t) == len(steps) + 1  # plus the pool before the first step
    assert list(tl.t)[1:] == [t1 for _, t1, _ in steps]
    u = np.asarray(tl.u_kv)
    assert (u >= 0).all() and (u <= 1).all() and u.max() > 0.3
    assert 0 < res.hit_rate < 0.5  # the 1,000-token system prompt (of 2,000) is shared


@pytest.mark.parametrize("policy, first", [("fcfs", "early"), ("priority", "urgent")])
def test_a_calls_priority_reaches_the_scheduler(policy, first):
    """One slot, two calls queued behind a running one: under priority
    scheduling the later, more urgent call (priority -1) takes the slot
    from the earlier one and ends first; FCFS ends them in arrival order."""
    def sessions(tokens):
        return [Session("running", [Call(fixed(lambda: tokens.fresh(300)), 50, arrival=0.0)]),
                Session("early", [Call(fixed(lambda: tokens.fresh(300)), 5, arrival=0.001)]),
                Session("urgent", [Call(fixed(lambda: tokens.fresh(300)), 5, arrival=0.002, priority=-1)])]

    ended = _ends_on_one_slot(sessions, policy)
    assert min(("early", "urgent"), key=ended.get) == first


def _ends_on_one_slot(sessions, policy: str) -> dict[str, float]:
    """When each session's last step ended, one call running at a time."""
    s = setup(seqs=1)
    s.scheduler = SchedulerConfig(1, 2048, 2048, scheduling=policy)
    _, steps = run(sessions, s)
    ended = {}
    for _, t1, chunks in steps:
        for req, _, _ in chunks:
            ended[req.request_id.split("#")[0]] = t1
    return ended


@pytest.mark.parametrize("policy", ["priority", "program"])
def test_every_arrived_call_is_in_an_ordered_policys_queue(policy):
    """One slot, three calls queued behind a running one, the last urgent:
    under an ordering policy the scheduler sees it at once (as the engine's
    queue holds every call that has arrived), so it takes the slot and ends
    before every call that arrived before it."""
    def sessions(tokens):
        return [Session("running", [Call(fixed(lambda: tokens.fresh(300)), 50, arrival=0.0)]),
                *(Session(f"early{i}", [Call(fixed(lambda: tokens.fresh(300)), 5, arrival=0.001 * (i + 1))])
                  for i in range(2)),
                Session("urgent", [Call(fixed(lambda: tokens.fresh(300)), 5, arrival=0.004, priority=-1)])]

    ended = _ends_on_one_slot(sessions, policy)
    assert min(ended, key=ended.get) == "urgent"
