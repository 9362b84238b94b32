"""Tool pauses in the simulator (sim/pauses.py): the engine's keep policy on a
virtual clock, with tier transfer times per link.

Each test builds a tiny workload whose numbers can be worked out by hand:
one session of 1,000 prompt tokens + 8 outputs (63 full blocks of 16) that
pauses before a second call; the clock is read through Simulator.on_step.
"""
from __future__ import annotations

import math

import pytest

from trajserve.config import SchedulerConfig
from trajserve.engine.scheduler import Scheduler
from trajserve.kv.cache_manager import KVCacheManager
from trajserve.kv.cost_rates import CostRates
from trajserve.plan.catalog import get_device, get_model
from trajserve.sessions.keep_policy import KeepPolicy
from trajserve.sim.build import SimSetup
from trajserve.sim.cost_model import CostModel
from trajserve.sim.executor import CostModelRunner
from trajserve.sim.hardware import Hardware, ModelCost
from trajserve.sim.pauses import PauseController
from trajserve.sim.simulator import Simulator
from trajserve.sim.synthetic import AgentSpec, agent_sessions
from trajserve.sim.tokens import TokenSource
from trajserve.sim.workload import Call, Session, extend_with_fresh, fixed

B = 16
HISTORY_BLOCKS = (1000 + 8 - 1) // B  # full computed blocks of prompt + outputs (the last sampled token has no KV): 62


def cost() -> CostModel:
    return CostModel(Hardware.from_device(get_device("h100")), ModelCost.from_spec(get_model("llama-3-70b"), 8))


def simulator(mode: str, num_blocks: int = 4000, prefetch: float = 0.8, policy: KeepPolicy | None = None,
              wait_hint: str = "exact", host: float = 2**40, disk: float = 2**42):
    kv = KVCacheManager(num_blocks, B, enable_prefix_caching=True, model_id="m")
    sched = Scheduler(SchedulerConfig(64, 2048, 2048), kv)
    c = cost()
    pauses = PauseController(sched, c, mode=mode, wait_hint=wait_hint, host_bytes=host, disk_bytes=disk,
                             prefetch_fraction=prefetch, policy=policy)
    sim = Simulator(sched, CostModelRunner(c, B), TokenSource(B), pauses=pauses)
    steps = []
    sim.on_step = lambda t0, t1, out: steps.append((t0, t1, [c.request for c in out.chunks]))
    return sim, pauses, steps


def two_calls(tokens: TokenSource, wait: float, name: str = "agent", start: float = 0.0) -> Session:
    return Session(name, [Call(fixed(lambda: tokens.fresh(1000)), 8, arrival=start, turn=1),
                          Call(extend_with_fresh(lambda: tokens.fresh(100)), 8, wait=wait, turn=2)])


def first_step_of(steps, rid: str) -> float:
    return next(t0 for t0, _, reqs in steps if any(r.request_id == rid for r in reqs))


def row(res, rid: str) -> int:
    return res.records.name.index(rid)


def assert_pool_settled(sim: Simulator, pauses: PauseController) -> None:
    """Nothing pinned, nothing held on a lower tier, once every session ended."""
    kv = sim.kv
    assert kv.num_active_blocks == 0
    assert pauses.host_used == 0 and pauses.disk_used == 0 and not pauses.paused


def test_forced_host_costs_one_copy_out_and_one_copy_back_before_the_next_call():
    sim, pauses, steps = simulator("host", prefetch=0.0)
    res = sim.run([two_calls(sim.tokens, wait=5.0)])
    c = cost()
    copy = c.transfer_time(HISTORY_BLOCKS, B, "host")
    arrival = res.records.col("arrival")[row(res, "agent#1")]
    # The reload runs on the engine thread: the resumed call's first step starts after it.
    assert first_step_of(steps, "agent#1") == pytest.approx(arrival + copy)
    assert res.records.col("cached_tokens")[row(res, "agent#1")] == HISTORY_BLOCKS * B
    p = res.pauses
    assert p["decisions"] == {"host": 1}
    assert p["blocks_out"] == {"host": HISTORY_BLOCKS} and p["blocks_in"] == {"host": HISTORY_BLOCKS}
    assert p["link_s"]["host"] == pytest.approx(2 * copy)
    assert p["resume_stalls"] == 1 and p["resume_stall_s"] == pytest.approx(copy)
    assert p["host_peak_bytes"] == HISTORY_BLOCKS * B * c.model.m_token
    assert_pool_settled(sim, pauses)


def test_a_full_tier_passes_the_state_down_and_the_summary_says_where_it_went():
    """Forced host with no host room: the decision stays host (what was
    asked), and `placed` says the state went to disk; with no disk room either,
    it was dropped and the next call recomputes it."""
    for disk, where in ((2**42, "disk"), (0, "drop")):
        sim, pauses, _ = simulator("host", host=0, disk=disk)
        res = sim.run([two_calls(sim.tokens, wait=5.0)])
        p = res.pauses
        assert p["decisions"] == {"host": 1} and p["placed"] == {where: 1}
        assert p["blocks_out"] == ({"disk": HISTORY_BLOCKS} if where == "disk" else {})
        assert_pool_settled(sim, pauses)


def test_drop_recomputes_the_history_and_keep_finds_it_on_the_device():
    ttft = {}
    for mode in ("drop", "keep"):
        sim, pauses, _ = simulator(mode)
        res = sim.run([two_calls(sim.tokens, wait=5.0)])
        k = row(res, "agent#1")
        ttft[mode] = res.records.col("first_token")[k] - res.records.col("arrival")[k]
        cached = res.records.col("cached_tokens")[k]
        assert cached == (0 if mode == "drop" else HISTORY_BLOCKS * B)
        assert res.pauses["decisions"] == {mode: 1} and not res.pauses["link_s"]
        assert_pool_settled(sim, pauses)
    assert ttft["drop"] > 2 * ttft["keep"]


def test_policy_offloads_a_5s_wait_to_host_and_prefetches_it_back_in_time():
    sim, pauses, steps = simulator("policy")
    res = sim.run([two_calls(sim.tokens, wait=5.0)])
    p = res.pauses
    # H100, 70B: ~1 K tokens reload in well under a millisecond per device; T*_wait is milliseconds.
    assert p["decisions"] == {"host": 1}
    assert p["prefetches"] == 1 and p["prefetch_hits"] == 1 and p["resume_stalls"] == 0
    arrival = res.records.col("arrival")[row(res, "agent#1")]
    assert first_step_of(steps, "agent#1") == arrival  # already on the device: no copy to wait for
    assert res.records.col("cached_tokens")[row(res, "agent#1")] == HISTORY_BLOCKS * B
    assert_pool_settled(sim, pauses)


def test_policy_keeps_state_through_a_wait_shorter_than_the_break_even():
    sim, pauses, _ = simulator("policy")
    res = sim.run([two_calls(sim.tokens, wait=1e-4)])
    assert res.pauses["decisions"] == {"keep": 1} and res.pauses["lease_demotions"] == 0
    assert res.records.col("cached_tokens")[row(res, "agent#1")] == HISTORY_BLOCKS * B


def test_a_lease_that_runs_out_moves_kept_state_to_its_fallback_tier():
    # No hints: the estimator's prior (5 s) says keep under a slow link, the
    # tool takes 60 s, so the lease (T*_wait) expires while the clock idles.
    rates = CostRates(prefill_tokens_per_s=1e4, host_bytes_per_s=1e10, disk_bytes_per_s=1e9)
    policy = KeepPolicy(rates, idle_keep_factor=100.0)
    sim, pauses, _ = simulator("policy", policy=policy, wait_hint="estimate")
    res = sim.run([two_calls(sim.tokens, wait=60.0)])
    p = res.pauses
    assert p["decisions"] == {"keep": 1}
    assert p["lease_demotions"] == 1 and p["demoted_to"] == {"host": 1}
    assert p["blocks_out"] == {"host": HISTORY_BLOCKS} and p["resume_stalls"] == 1
    assert res.records.col("cached_tokens")[row(res, "agent#1")] == HISTORY_BLOCKS * B
    assert_pool_settled(sim, pauses)


def test_disk_reload_waits_for_the_background_write_and_streams_at_the_slower_link():
    c = cost()
    write = c.transfer_time(HISTORY_BLOCKS, B, "nvme")
    host = c.transfer_time(HISTORY_BLOCKS, B, "host")
    # Resume before the write has landed: the reload waits for it, then reads at NVMe speed.
    wait = write / 2
    sim, pauses, steps = simulator("disk", prefetch=0.0)
    res = sim.run([two_calls(sim.tokens, wait=wait)])
    finish0 = res.records.col("finish")[row(res, "agent#0")]
    p = res.pauses
    assert p["blocks_out"] == {"disk": HISTORY_BLOCKS} and p["blocks_in"] == {"disk": HISTORY_BLOCKS}
    assert p["link_s"]["nvme"] == pytest.approx(2 * write)
    assert p["link_s"]["host"] == pytest.approx(host + write)  # staging out; the read streams through at NVMe pace
    # copy out (host link), write (NVMe, background), then the read (NVMe-bound).
    assert first_step_of(steps, "agent#1") == pytest.approx(finish0 + host + write + write)
    assert_pool_settled(sim, pauses)


def test_a_full_host_tier_falls_to_disk_and_a_full_disk_to_drop():
    nbytes = HISTORY_BLOCKS * B * cost().model.m_token
    sim, pauses, _ = simulator("host", host=nbytes - 1)
    res = sim.run([two_calls(sim.tokens, wait=5.0)])
    assert res.pauses["blocks_out"] == {"disk": HISTORY_BLOCKS}
    sim, pauses, _ = simulator("host", host=0, disk=nbytes - 1)
    res = sim.run([two_calls(sim.tokens, wait=5.0)])
    assert not res.pauses["blocks_out"]
    assert res.records.col("cached_tokens")[row(res, "agent#1")] == 0


def test_kept_state_gives_way_to_running_work_before_anyone_is_preempted():
    # A slow host link makes the policy keep A's state through its 3 s wait
    # (T*_wait = 100 x a 65 ms round trip). B then needs most of the pool
    # while A is paused: the reclaimer moves A's state to the host instead of
    # preempting or refusing B.
    rates = CostRates(prefill_tokens_per_s=1e4, host_bytes_per_s=1e10, disk_bytes_per_s=1e9)
    policy = KeepPolicy(rates, idle_keep_factor=100.0, admission_ceiling=1.0)

    def sessions(tokens):
        a = two_calls(tokens, wait=3.0, name="a")
        b = Session("b", [Call(fixed(lambda: tokens.fresh(1400)), 8, arrival=1.0)])
        return [a, b]

    sim, pauses, _ = simulator("policy", num_blocks=130, policy=policy)
    res = sim.run(sessions(sim.tokens))
    p = res.pauses
    assert p["decisions"] == {"keep": 1}
    assert p["pressure_demotions"] == 1 and p["demoted_to"] == {"host": 1}
    assert res.preemptions == 0
    assert res.records.col("output_tokens")[row(res, "b#0")] == 8
    assert_pool_settled(sim, pauses)

    # Forced keeps do not move: B can only run once A's state is dropped (a stall drop).
    sim, pauses, _ = simulator("keep", num_blocks=130, policy=policy)
    res = sim.run(sessions(sim.tokens))
    assert res.pauses["stall_drops"] == 1 and res.pauses["pressure_demotions"] == 0
    assert res.records.col("cached_tokens")[row(res, "a#1")] == 0  # dropped: recomputed
    assert_pool_settled(sim, pauses)


def test_estimated_waits_start_from_the_prior_then_follow_observed_waits():
    sim, pauses, _ = simulator("policy", wait_hint="estimate")

    def sessions(tokens):
        return [Session("agent", [Call(fixed(lambda: tokens.fresh(1000)), 8, arrival=0.0)]
                        + [Call(extend_with_fresh(lambda: tokens.fresh(50)), 8, wait=2.0) for _ in range(5)])]

    res = sim.run(sessions(sim.tokens))
    assert res.pauses["wait_hint"] == "estimate" and res.pauses["pauses"] == 5
    # Three observed waits are needed before history replaces the prior; the
    # prior says "unknown" (inf), so no prefetch is planned for the first ones.
    assert pauses.waits.count() == 5
    assert 0 < res.pauses["prefetches"] < 5
    assert sum(res.pauses["decisions"].values()) == 5


def test_memory_bound_fleet_policy_beats_always_keep():
    """The spec's pitfall (keeping paused state resident whatever the wait)
    on a pool that holds a fraction of the fleet: the policy finishes the same
    work sooner, and every mode finishes every call. In arrival order (fcfs):
    the makespan is what is compared, and program scheduling trades it for
    fairness between programs (it equalises the agents' service, so more of
    them hold state at once; there the policy and always-keep end within 1 %)."""
    spec = AgentSpec(trajectories=64, turns=6, tool_wait="exp:5", seed=0)
    out = {}
    for mode in ("policy", "keep", "drop", "cache"):
        s = SimSetup(Hardware.from_device(get_device("h100")), ModelCost.from_spec(get_model("llama-3-70b"), 8),
                     12_000, B, SchedulerConfig(256, 8192, 8192, scheduling="fcfs"), keep_policy=mode,
                     host_kv_bytes=2**40,
                     disk_kv_bytes=2**43)
        sim, tokens = s.simulator()
        res = sim.run(agent_sessions(spec, tokens))
        assert len(res.records) == 64 * 6 and not res.rejected
        out[mode] = res
    assert out["cache"].pauses is None
    assert out["keep"].pauses["decisions"] == {"keep": 64 * 5}
    for other in ("keep", "drop", "cache"):
        assert out["policy"].end_time < out[other].end_time, other
    assert out["policy"].hit_rate > out["drop"].hit_rate
    assert math.isclose(sum(out["policy"].pauses["decisions"].values()), 64 * 5)


def h100_70b_agents(num_blocks: int, prefix_host_blocks: int):
    """32 agents x 4 turns on 8 x H100 / 70B with this pool and prefix host tier."""
    s = SimSetup(Hardware.from_device(get_device("h100")), ModelCost.from_spec(get_model("llama-3-70b"), 8),
                 num_blocks, B, SchedulerConfig(256, 8192, 8192), prefix_host_blocks=prefix_host_blocks)
    sim, tokens = s.simulator()
    return sim.run(agent_sessions(AgentSpec(trajectories=32, turns=4, tool_wait="exp:5", seed=1), tokens))


def test_prefix_cache_lower_tiers_recover_hits_and_their_traffic_costs_step_time():
    """The hierarchical prefix cache in the simulator: LRU spills to a host
    tier and matches load back, as in the engine; every block moved is
    charged once over the host link (CostModelRunner's transfer time)."""
    out = {}
    for host in (0, 100_000):
        res = h100_70b_agents(2_500, host)
        assert len(res.records) == 32 * 4
        out[host] = res
    plain, tiered = out[0], out[100_000]
    assert plain.prefix_tiers is None and plain.runner.stats.transfer_s == 0
    t = tiered.prefix_tiers
    assert t["spilled_blocks"] > 0 and t["promoted_blocks"] > 0 and t["loaded_host_blocks"] == t["promoted_blocks"]
    assert t["dropped_blocks"] == 0  # 100K blocks hold everything LRU pushed out
    assert tiered.hit_rate > plain.hit_rate + 0.1
    moved = t["spilled_blocks"] + t["loaded_host_blocks"]
    assert tiered.runner.stats.transfer_s == pytest.approx(cost().transfer_time(moved, B, "host"))


def test_simulated_preemptions_swap_to_the_host_tier_by_break_even():
    """The engine's preemption pricer in the simulator: on H100 / 70B a block
    round trip over PCIe (2 x 5 MB / 54 GB/s) beats recomputing 16 tokens,
    so with a prefix host tier every preemption swaps; with a host tier too
    small to take a victim's blocks, none can."""
    out = {}
    for host in (100_000, 1):
        out[host] = h100_70b_agents(600, host)
        assert len(out[host].records) + len(out[host].rejected) == 32 * 4  # two last turns outgrow the pool
    big, tiny = out[100_000], out[1]
    assert big.preemptions > 0 and big.swap_preemptions == big.preemptions
    assert tiny.preemptions > 0 and tiny.swap_preemptions == 0
