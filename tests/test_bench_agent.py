"""`trajserve bench agent` end to end on a small workload, and its oracle and
model-free replay on their own."""
import json

from test_cli import trajserve
from trajserve.bench.agent import flop_floor
from trajserve.bench.oracle import PrefixOracle
from trajserve.model.loader import load_model_config


def test_oracle_counts_leading_computed_blocks():
    o = PrefixOracle(4)
    assert o.reusable(list(range(20))) == 0
    o.add(list(range(10)))  # blocks [0..3], [4..7]; 8, 9 are a partial block
    assert o.num_blocks == 2
    assert o.reusable(list(range(20))) == 8
    assert o.reusable(list(range(9))) == 8
    assert o.reusable(list(range(8))) == 4  # the last prompt token is always computed
    assert o.reusable([0, 1, 2, 3, 9, 9, 9, 9, 9]) == 4
    assert o.reusable([1, 1, 2, 3, 4, 5, 6, 7, 8]) == 0  # a block counts only under its own prefix


def test_flop_floor_counts_the_history_the_new_tokens_attend_to():
    cfg = load_model_config(None)  # SmolLM2-135M: attention per token ~ the weights' at ~3k tokens
    req = {"prompt_tokens": 2905, "cached_tokens": 2430}
    assert flop_floor(cfg, [{"prompt_tokens": 2905, "cached_tokens": 0}]) == 1.0
    floor = flop_floor(cfg, [req])
    must = 475 / 2905
    # Each new token attends to ~2,700 keys where the average uncached one attends to ~1,450.
    assert 1.1 * must < floor < 1.5 * must
    assert flop_floor(cfg, [{"prompt_tokens": 2905, "cached_tokens": 2800}]) < floor


def test_bench_agent_small_run():
    r = trajserve("bench", "agent", "--json", "--dtype", "float32", "--trajectories", "3", "--turns", "3",
                  "--preamble-tokens", "150", "--tool-min-tokens", "20", "--tool-max-tokens", "60",
                  "--reply-tokens", "4", "--uncached-trajectories", "2", "--pool-fractions", "1,0.1",
                  "--pair-repeats", "2", timeout=600)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert len(res["per_turn"]) == 3 and len(res["requests"]) == 9
    assert res["uncached_outputs_identical"] and res["replay_matches_engine"]
    # Phase 2's cached runs found exactly what phase 1's did: trajectory 1's turn 1 the preamble
    # put back before it, every later turn the previous turn's uncached run, and the repeat the
    # same blocks again (what the first run added was invalidated).
    assert res["paired_hits_match"]
    pairs = res["paired_requests"]
    assert [(p["trajectory"], p["turn"]) for p in pairs] == [(i, t) for i in range(2) for t in (1, 2, 3)]
    assert pairs[0]["cached_tokens"] == 0 and pairs[3]["cached_tokens"] >= 144
    assert all(0 < p["ttft_cached_s"] and 0 < p["ttft_uncached_s"] for p in pairs)
    for p in pairs:  # each side ran twice and keeps its fastest run
        assert len(p["cached_tokens_runs"]) == len(p["ttft_cached_runs_s"]) == len(p["ttft_uncached_runs_s"]) == 2
        assert p["ttft_cached_s"] == min(p["ttft_cached_runs_s"])
        assert p["ttft_uncached_s"] == min(p["ttft_uncached_runs_s"])
    # The preamble is shared from the second request on, the history from turn 2 on.
    assert res["requests"][0]["cached_tokens"] == 0
    assert all(r["cached_tokens"] >= 144 for r in res["requests"][1:])
    assert res["targets"]["hit_rate_over_oracle"]["met"]
    assert all(t["ttft_uncached_ms"] is not None for t in res["per_turn"])
    # Each turn's floor sits above the share of its two pairs' prompts left to compute, since
    # those tokens attend to the whole history, and below 1 (turn 1: trajectory 1 found the preamble).
    for t in res["per_turn"]:
        ps = [p for p in pairs if p["turn"] == t["turn"]]
        must = 1 - sum(p["cached_tokens"] for p in ps) / sum(p["prompt_tokens"] for p in ps)
        assert must < t["flop_floor"] < 1
    assert res["pool_sweep"][0]["hit_rate"] > 0.5
    assert "skipped" in res["pool_sweep"][1]  # 10% of the working set cannot hold a request


def test_bench_agent_small_pool_with_a_host_tier_recovers_the_hits():
    """A pool of a third of the working set: LRU pushes histories out between
    turns; with a host tier they come back, the replay (same tiers, no model)
    still reproduces every request's hit, and the hit rate is the oracle's."""
    flags = ["bench", "agent", "--json", "--dtype", "float32", "--trajectories", "3", "--turns", "3",
             "--preamble-tokens", "150", "--tool-min-tokens", "20", "--tool-max-tokens", "60",
             "--reply-tokens", "4", "--uncached-trajectories", "0", "--pool-fractions", "1", "--num-blocks", "30"]
    res = {}
    for name, extra in (("lru", []), ("host", ["--kv-host-cache", "64MiB"])):
        r = trajserve(*flags, *extra, timeout=600)
        assert r.returncode == 0, r.stderr
        res[name] = json.loads(r.stdout)
        assert res[name]["replay_matches_engine"], name
    assert res["lru"]["promoted_blocks"] == 0 and res["host"]["promoted_blocks"] > 0
    assert res["host"]["lower_tier_blocks"]["host"] > 0
    assert res["host"]["hit_rate"] > res["lru"]["hit_rate"]
    assert res["host"]["targets"]["hit_rate_over_oracle"]["met"]
    # Same greedy replies whatever the tier did (the requests record the prompts, which carry the replies).
    assert [r["prompt_tokens"] for r in res["host"]["requests"]] == [r["prompt_tokens"] for r in res["lru"]["requests"]]


def test_bench_tool_waits_small_run_with_trace_waits():
    """Four policies over the same agents, waits drawn from the Claude Code
    traces: every policy gives the same greedy replies, and each policy's
    decisions are what it says it does."""
    r = trajserve("bench", "agent", "--tool-waits", "--json", "--dtype", "float32", "--trajectories", "3",
                  "--turns", "2", "--preamble-tokens", "64", "--tool-min-tokens", "10", "--tool-max-tokens", "30",
                  "--reply-tokens", "3", "--wait-trace", "claude-code", "--wait-scale", "0.002",
                  "--pool-fraction", "0.4", timeout=600)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["wait_source"] == "claude-code" and len(res["waits_s"]) == 3 * 2
    assert all(0 <= w <= 300 * 0.002 for w in res["waits_s"])
    assert res["replies_identical_across_policies"]
    by = {x["policy"]: x for x in res["results"]}
    assert set(by) == {"keep", "drop", "host", "policy"}
    for x in by.values():
        assert x["turns"] == 3 * 3 and x["makespan_s"] > 0
    assert set(by["keep"]["decisions"]) == {"keep"} and set(by["drop"]["decisions"]) == {"drop"}
    assert by["host"]["bytes_moved"] > 0 and by["drop"]["bytes_moved"] == 0
    assert by["drop"]["recomputed_tokens"] > 0
    # Always-keep reserves each agent's final history: fewer agents at once than the others start.
    assert by["keep"]["agents_started_at_once"] < 3 == by["policy"]["agents_started_at_once"]
    assert by["keep"]["stall_drops"] == 0


def test_bench_tool_waits_over_the_messages_api():
    """Agents speaking Anthropic's Messages API over HTTP: the same greedy
    replies whether conversations are left to LRU, inferred from
    metadata.user_id, or sent as sessions; only the last two pause."""
    r = trajserve("bench", "agent", "--tool-waits", "--api", "messages", "--json", "--dtype", "float32",
                  "--trajectories", "2", "--turns", "2", "--preamble-tokens", "64", "--tool-min-tokens", "10",
                  "--tool-max-tokens", "30", "--reply-tokens", "64", "--wait-trace", "claude-code",
                  "--wait-scale", "0.002", "--pool-fraction", "0.5", timeout=600)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["api"] == "messages" and res["replies_identical_across_modes"] and res["rounds"] == 2
    by = {x["mode"]: x for x in res["results"]}
    assert set(by) == {"lru", "inferred", "explicit"}
    assert not by["lru"]["decisions"]  # no conversation named: nothing pauses
    # Each agent's two tool_use replies pause its session; inferred, its last reply too (for the human); two rounds.
    assert sum(by["explicit"]["decisions"].values()) == 2 * 2 * 2
    assert sum(by["inferred"]["decisions"].values()) == 2 * 3 * 2
    assert all(len(x["throughput_per_round"]) == 2 for x in by.values())
    assert all(x["makespan_s"] > 0 and x["ttft_resumed_p50_ms"] > 0 for x in by.values())


def test_bench_resume_small_run():
    """`trajserve bench resume`: every mode gives the same first token; the
    host reload is counted as copied, the kept state copies nothing, and
    recomputing is the slowest way back."""
    r = trajserve("bench", "resume", "--json", "--dtype", "float32", "--kv-cache-memory", "64MiB",
                  "--history-tokens", "256", "--observation-tokens", "32", "--repeats", "1",
                  "--modes", "keep,host,host-serial,drop", timeout=600)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    m = res["modes"]
    assert res["same_first_token"] and set(m) == {"keep", "host", "host-serial", "drop"}
    assert m["keep"]["reload_copy_s"] == 0 and m["host"]["reload_copy_s"] > 0 and m["host-serial"]["reload_copy_s"] > 0
    assert m["drop"]["resume_to_first_token_s"] > m["keep"]["resume_to_first_token_s"]
