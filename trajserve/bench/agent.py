"""`trajserve bench agent`: multi-turn agent replay on the real engine.

N trajectories x T turns share a system + tool preamble; every turn appends
the model's (greedy) reply and a tool result of random length, and the
whole conversation is sent again, as agent harnesses do. Requests run one at
a time, turn-major (every trajectory's turn t before any turn t + 1), so
trajectories compete for the pool the way concurrent agents' histories do.

Three phases, one process:
  1. cached: the engine with the radix prefix cache; per request the TTFT,
     the tokens served from the cache, and the oracle (the most block-aligned
     tokens any cache could have reused, bench/oracle.py);
  2. paired: the first K trajectories' requests again, each twice back to
     back: with the cache holding what phase 1's request found (the
     trajectory's previous turn), then with the cache emptied; the greedy
     replies must be the ones phase 1 produced. This machine's speed drifts
     by tens of percent over minutes, so the two TTFTs of a pair are taken
     seconds apart, not a phase apart (with --pair-repeats R, each side
     runs R times and keeps its fastest). The TTFT target compares the
     pairs, summed from turn 3 on; per turn the table also shows the share
     of the prompt any cache must compute, which bounds a single request's
     ratio from below, and the FLOP floor: the ratio an engine bound by
     compute would reach, the FLOPs of the tokens left to compute (each
     attending to the whole cached history) over the FLOPs of the whole
     prompt (plan/flops.py, causal attention);
  3. pool sweep: the recorded requests replayed through the real scheduler
     and KV manager (no model, bench/replay.py) at pools smaller than the
     working set: hit rate vs pool size. The replay at phase 1's pool size
     must reproduce phase 1's per-request hits exactly.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from trajserve.bench.agent_workload import preamble, task, tool_result
from trajserve.bench.common import command_line, machine_info
from trajserve.bench.oracle import PrefixOracle
from trajserve.bench.replay import replay
from trajserve.kv.block_table import blocks_for
from trajserve.plan.flops import forward_flops
from trajserve.plan.model_shapes import lm_head_params, matmul_params
from trajserve.sampling import SamplingParams

TARGETS = {
    "hit_rate_over_oracle": (">=", 0.99),
    "ttft_cached_over_uncached_turn3plus": ("<=", 0.2),
}


def run_one(engine, ids: list[int], sp: SamplingParams):
    rid = engine.add_request(ids, sp)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out
    raise AssertionError(f"request {rid} did not finish")


def cached_phase(engine, args, rng: random.Random) -> tuple[list[dict], PrefixOracle]:
    tok = engine.tokenizer
    pre = preamble(tok, args.preamble_tokens)
    convs = [[{"role": "system", "content": pre}, {"role": "user", "content": task(i)}]
             for i in range(args.trajectories)]
    sp = SamplingParams(max_tokens=args.reply_tokens, temperature=0)
    oracle = PrefixOracle(engine.kv.block_size)
    records: list[dict] = []
    for turn in range(1, args.turns + 1):
        for i, conv in enumerate(convs):
            if turn > 1:
                n = rng.randint(args.tool_min_tokens, args.tool_max_tokens)
                conv.append({"role": "user", "content": "Tool output:\n" + tool_result(tok, rng, n)})
            ids = tok.encode_chat(conv)
            cut = engine.kv.num_window_recomputed_tokens
            out = run_one(engine, ids, sp)
            comp = out.outputs[0]
            records.append({"turn": turn, "trajectory": i, "prompt_tokens": len(ids),
                            "cached_tokens": out.num_cached_tokens, "oracle_tokens": oracle.reusable(ids),
                            # Hit tokens recomputed because a window layer's part of them was gone.
                            "window_recomputed_tokens": engine.kv.num_window_recomputed_tokens - cut,
                            "ttft_s": out.metrics.ttft, "output_tokens": len(comp.token_ids),
                            "prompt_ids": ids, "output_ids": list(comp.token_ids)})
            oracle.add(ids + list(comp.token_ids[:-1]))  # the last sampled token is never computed
            conv.append({"role": "assistant", "content": comp.text})
    return records, oracle


def paired_phase(engine, records: list[dict], k: int, repeats: int = 1) -> list[dict]:
    """Phase 2: trajectory by trajectory, turn by turn, request r with the
    cache, then r with the cache emptied. The uncached run of turn t leaves
    turn t's prompt and reply in the cache, which is what turn t + 1 found
    in phase 1 (its hit is the oracle's: the longest computed prefix is its
    own history); turn 1 finds the shared preamble, put back first.

    With `repeats` > 1 each side of a pair runs that many times and its
    fastest TTFT counts (a shared machine's interference only slows a run
    down; both sides are treated alike). A cached repeat runs on the same
    cached blocks as the first: the blocks the first run added are
    invalidated, so it finds phase 1's hit again. Repeats stop at the first
    token; the first cached and the last uncached run decode the whole
    reply, and the last leaves turn t in the cache."""
    one = SamplingParams(max_tokens=1, temperature=0)
    out = []
    for i in range(k):
        rs = [r for r in records if r["trajectory"] == i]  # in turn order: phase 1 ran turn-major
        engine.kv.clear_cache()
        if rs[0]["cached_tokens"]:
            run_one(engine, rs[0]["prompt_ids"][: rs[0]["cached_tokens"]], one)
        for r in rs:
            ids, want = r["prompt_ids"], r["output_ids"]
            full = SamplingParams(max_tokens=len(want), temperature=0)
            cached = [run_one(engine, ids, full)]
            for _ in range(repeats - 1):
                engine.invalidate(ids[: cached[0].num_cached_tokens + 1])  # blocks from the first uncached token on
                cached.append(run_one(engine, ids, one))
            uncached = []
            for j in range(repeats):
                engine.kv.clear_cache()
                uncached.append(run_one(engine, ids, full if j == repeats - 1 else one))
            assert all(u.num_cached_tokens == 0 for u in uncached)
            # The full runs must give phase 1's reply, the one-token repeats its first token.
            expect = [(cached[0], want), *((x, want[:1]) for x in cached[1:] + uncached[:-1]), (uncached[-1], want)]
            out.append({"turn": r["turn"], "trajectory": i, "prompt_tokens": r["prompt_tokens"],
                        "cached_tokens": cached[0].num_cached_tokens,
                        "cached_tokens_runs": [c.num_cached_tokens for c in cached],
                        "ttft_cached_s": min(c.metrics.ttft for c in cached),
                        "ttft_uncached_s": min(u.metrics.ttft for u in uncached),
                        "ttft_cached_runs_s": [c.metrics.ttft for c in cached],
                        "ttft_uncached_runs_s": [u.metrics.ttft for u in uncached],
                        "same_output": all(list(x.outputs[0].token_ids) == w for x, w in expect)})
    return out


def prefill_flops(cfg, prompt_tokens: int, cached_tokens: int) -> float:
    """FLOPs to the first token: the uncached tokens through every layer,
    attending causally to all before them, and one row of the LM head."""
    return (forward_flops(matmul_params(cfg), cfg.num_layers, cfg.num_heads * cfg.head_dim,
                          prompt_tokens - cached_tokens, cached_tokens) + 2 * lm_head_params(cfg))


def flop_floor(cfg, rs: list[dict]) -> float:
    """The TTFT ratio of requests `rs` if time were proportional to FLOPs."""
    return (sum(prefill_flops(cfg, r["prompt_tokens"], r["cached_tokens"]) for r in rs)
            / sum(prefill_flops(cfg, r["prompt_tokens"], 0) for r in rs))


def ttft_ratio(pairs: list[dict]) -> float:
    return sum(p["ttft_cached_s"] for p in pairs) / sum(p["ttft_uncached_s"] for p in pairs)


def per_turn(records: list[dict], pairs: list[dict], cfg) -> list[dict]:
    """Per turn: phase 1's hits and median TTFT over all trajectories; the
    TTFT ratio over phase 2's pairs (the same prompt with and without the
    cache), with its FLOP floor."""
    rows = []
    for turn in sorted({r["turn"] for r in records}):
        rs = [r for r in records if r["turn"] == turn]
        us = [u for u in pairs if u["turn"] == turn]
        prompt = sum(r["prompt_tokens"] for r in rs)
        rows.append({"turn": turn, "prompt_tokens_median": statistics.median(r["prompt_tokens"] for r in rs),
                     # Share of prompt tokens any cache must still compute: the floor under
                     # the per-request TTFT ratio (a 600-token tool result on a 2,900-token
                     # prompt is 21% of it, whatever is cached).
                     "must_compute": 1 - sum(r["oracle_tokens"] for r in rs) / prompt,
                     "hit_rate": sum(r["cached_tokens"] for r in rs) / prompt,
                     "window_recomputed_tokens": sum(r["window_recomputed_tokens"] for r in rs),
                     "oracle_hit_rate": sum(r["oracle_tokens"] for r in rs) / prompt,
                     "ttft_cached_ms": statistics.median(r["ttft_s"] for r in rs) * 1e3,
                     "ttft_uncached_ms": statistics.median(u["ttft_uncached_s"] for u in us) * 1e3 if us else None,
                     "ttft_ratio": ttft_ratio(us) if us else None,
                     "flop_floor": flop_floor(cfg, us) if us else None})
    return rows


def pool_sweep(engine, records: list[dict], working_set: int, fractions: list[float]) -> list[dict]:
    reqs = [(r["prompt_ids"], r["output_ids"]) for r in records]
    B = engine.kv.block_size
    wm = engine.config.cache.watermark
    biggest = max(blocks_for(len(p) + len(o), B) for p, o in reqs)
    rows = []
    for f in fractions:
        n = int(working_set * f)
        if n < biggest + int(wm * n) + 1:
            rows.append({"fraction": f, "num_blocks": n, "skipped": f"below the largest request ({biggest} blocks)"})
            continue
        res = replay(reqs, n, B, engine.config.scheduler, wm, *lower_tier_blocks(engine))
        rows.append({"fraction": f, "num_blocks": n, "hit_rate": res.hit_rate,
                     "evicted_blocks": res.evicted_blocks, "preemptions": res.preemptions})
    return rows


def lower_tier_blocks(engine) -> tuple[int, int]:
    """The engine's prefix-cache tiers (--kv-host-cache, --kv-disk-cache) in blocks."""
    from trajserve.kv.tiers import DISK_HEADER_BYTES

    cc = engine.config.cache
    if engine.lower is None:
        return 0, 0
    per = engine.block_bytes
    return cc.host_cache_bytes // per, cc.disk_cache_bytes // (per + DISK_HEADER_BYTES)


def default_pool_blocks(args) -> int:
    """Room for every trajectory's whole history (an upper bound on the
    working set), so phase 1 measures the cache, not eviction."""
    per_traj = args.preamble_tokens + 200 + args.turns * (args.tool_max_tokens + args.reply_tokens + 64)
    return args.trajectories * blocks_for(per_traj, args.block_size) + 64


def check(value: float, rule: tuple[str, float]) -> bool:
    op, limit = rule
    return value >= limit if op == ">=" else value <= limit


def run(args: argparse.Namespace) -> int:
    from trajserve.llm import LLM

    if args.pair_repeats < 1:
        raise ValueError(f"--pair-repeats must be at least 1, got {args.pair_repeats}")
    if not 1 <= args.tool_min_tokens <= args.tool_max_tokens:
        raise ValueError(f"tool result range [{args.tool_min_tokens}, {args.tool_max_tokens}] is empty")
    if args.num_blocks is None and args.kv_cache_memory is None:
        args.num_blocks = default_pool_blocks(args)
    if not args.enable_prefix_caching:
        raise ValueError("bench agent measures the prefix cache: drop --no-prefix-caching")
    engine = LLM.from_args(args).engine
    rng = random.Random(args.seed)

    t0 = time.perf_counter()
    records, oracle = cached_phase(engine, args, rng)
    cached_phase_s = time.perf_counter() - t0
    pairs = paired_phase(engine, records, min(args.uncached_trajectories, args.trajectories), args.pair_repeats)
    turns = per_turn(records, pairs, engine.model_config)
    fractions = [float(f) for f in args.pool_fractions.split(",")]
    sweep = pool_sweep(engine, records, oracle.num_blocks, fractions)
    check_replay = replay([(r["prompt_ids"], r["output_ids"]) for r in records], engine.num_blocks,
                          engine.kv.block_size, engine.config.scheduler, engine.config.cache.watermark,
                          *lower_tier_blocks(engine))

    prompt = sum(r["prompt_tokens"] for r in records)
    cached = sum(r["cached_tokens"] for r in records)
    ideal = sum(r["oracle_tokens"] for r in records)
    by_key = {(r["turn"], r["trajectory"]): r for r in records}
    late = [u for u in pairs if u["turn"] >= 3]
    derived = {"hit_rate_over_oracle": cached / ideal if ideal else 1.0}
    if late:
        # Summed over every pair from turn 3 on (same prompts with and without the cache).
        derived["ttft_cached_over_uncached_turn3plus"] = ttft_ratio(late)
    result = {
        "command": command_line(), "machine": machine_info(), "dtype": str(engine.dtype).removeprefix("torch."),
        "trajectories": args.trajectories, "turns": args.turns, "preamble_tokens": args.preamble_tokens,
        "tool_tokens": [args.tool_min_tokens, args.tool_max_tokens], "reply_tokens": args.reply_tokens,
        "block_size": engine.kv.block_size, "num_blocks": engine.num_blocks,
        "windowed_pool": engine.kv.windowed, "token_capacity": engine.kv.token_capacity,
        "working_set_blocks": oracle.num_blocks,
        "lower_tier_blocks": dict(zip(("host", "disk"), lower_tier_blocks(engine))),
        "promoted_blocks": engine.kv.num_promoted_blocks,
        "hit_rate": cached / prompt, "oracle_hit_rate": ideal / prompt,
        "window_recomputed_tokens": sum(r["window_recomputed_tokens"] for r in records),
        "cached_phase_s": cached_phase_s,  # wall time of phase 1: the makespan of the cached run
        "uncached_outputs_identical": all(u["same_output"] for u in pairs),
        # Phase 2's cached runs found what phase 1's did (else the pairs measure another cache state).
        "paired_hits_match": all(h == by_key[(u["turn"], u["trajectory"])]["cached_tokens"]
                                 for u in pairs for h in u["cached_tokens_runs"]),
        "pair_repeats": args.pair_repeats,
        "replay_matches_engine": check_replay.cached_tokens == [r["cached_tokens"] for r in records],
        "per_turn": turns, "pool_sweep": sweep,
        "ttft_ratio_max_turn3plus": max((t["ttft_ratio"] for t in turns if t["turn"] >= 3
                                         and t["ttft_ratio"] is not None), default=None),
        "flop_floor_turn3plus": flop_floor(engine.model_config, late) if late else None,
        "paired_requests": pairs,
        "targets": {k: {"value": v, "rule": " ".join(map(str, TARGETS[k])), "met": check(v, TARGETS[k])}
                    for k, v in derived.items()},
        "requests": [{k: v for k, v in r.items() if not k.endswith("_ids")} for r in records],
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print_report(result)
    return 0


def print_report(res: dict) -> None:
    m = res["machine"]
    print(f"\n{res['command']}")
    print(f"{m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['torch_threads']} threads), dtype {res['dtype']}")
    print(f"{res['trajectories']} trajectories x {res['turns']} turns, preamble {res['preamble_tokens']} tokens, "
          f"tool results {res['tool_tokens'][0]}-{res['tool_tokens'][1]} tokens, replies <= {res['reply_tokens']}; "
          f"pool {res['num_blocks']} blocks of {res['block_size']}, working set {res['working_set_blocks']} blocks")
    low = res["lower_tier_blocks"]
    if low["host"] or low["disk"]:
        print(f"prefix cache lower tiers: host {low['host']} blocks, disk {low['disk']} blocks; "
              f"{res['promoted_blocks']} blocks loaded back on hits")
    print()
    print("TTFT cached: median of phase 1 (all trajectories); uncached: median of phase 2's pairs; ratio: cached /")
    print("uncached TTFT summed over phase 2's pairs (each request with the cache, then without, back to back"
          + (f"; each side the fastest of {res['pair_repeats']} runs)" if res["pair_repeats"] > 1 else ")"))
    print("must: share of prompt tokens any cache must compute (1 - oracle); floor: the ratio if TTFT were")
    print("proportional to FLOPs (the new tokens attend to the whole history, so floor > must)")
    win = res["windowed_pool"]
    print(f"{'turn':>4} {'prompt':>7} {'hit':>7} {'oracle':>7} {'must':>6} {'TTFT cached':>12} {'uncached':>9} "
          f"{'ratio':>6} {'floor':>6}" + (f" {'window recomputed':>18}" if win else ""))
    for t in res["per_turn"]:
        unc = f"{t['ttft_uncached_ms']:>7.0f}ms" if t["ttft_uncached_ms"] is not None else f"{'-':>9}"
        ratio = f"{t['ttft_ratio']:>6.3f}" if t["ttft_ratio"] is not None else f"{'-':>6}"
        floor = f"{t['flop_floor']:>6.3f}" if t["flop_floor"] is not None else f"{'-':>6}"
        print(f"{t['turn']:>4} {t['prompt_tokens_median']:>7.0f} {t['hit_rate'] * 100:>6.1f}% "
              f"{t['oracle_hit_rate'] * 100:>6.1f}% {t['must_compute']:>6.3f} {t['ttft_cached_ms']:>10.0f}ms {unc} "
              f"{ratio} {floor}" + (f" {t['window_recomputed_tokens']:>18,}" if win else ""))
    print(f"\nall turns: hit rate {res['hit_rate'] * 100:.2f}%, oracle {res['oracle_hit_rate'] * 100:.2f}%; "
          f"greedy replies identical without the cache: {res['uncached_outputs_identical']}; "
          f"pairs found phase 1's hits: {res['paired_hits_match']}; "
          f"model-free replay reproduces the engine's hits: {res['replay_matches_engine']}\n")
    if win:
        print(f"window layers' pages freed behind their windows: the pool holds {res['token_capacity']:,} tokens' "
              f"worth of whole blocks and more across sequences; hit tokens recomputed for a window layer "
              f"{res['window_recomputed_tokens']:,} (column above). The replay below models an all-global pool.\n")
    print("hit rate vs pool size (replay of the same requests"
          + (", same lower tiers):" if low["host"] or low["disk"] else "):"))
    print(f"{'blocks':>7} {'of WS':>6} {'hit':>7} {'vs oracle':>9} {'evicted':>8} {'preempt':>8}")
    for s in res["pool_sweep"]:
        if "skipped" in s:
            print(f"{s['num_blocks']:>7} {s['fraction'] * 100:>5.0f}%  skipped: {s['skipped']}")
            continue
        print(f"{s['num_blocks']:>7} {s['fraction'] * 100:>5.0f}% {s['hit_rate'] * 100:>6.1f}% "
              f"{s['hit_rate'] / res['oracle_hit_rate']:>9.3f} {s['evicted_blocks']:>8} {s['preemptions']:>8}")
    print()
    for k, t in res["targets"].items():
        print(f"target {k}: {t['value']:.3g} ({t['rule']}) {'met' if t['met'] else 'NOT met'}")
    if res["ttft_ratio_max_turn3plus"] is not None:
        print(f"(worst single turn from turn 3 on: {res['ttft_ratio_max_turn3plus']:.3g}; FLOP floor of turns 3 on: "
              f"{res['flop_floor_turn3plus']:.3g})")
    print("\nJSON:")
    print(json.dumps({k: v for k, v in res.items() if k != "requests"}))
