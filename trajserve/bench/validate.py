"""`trajserve simulate --validate`: predict `trajserve bench agent`'s
workload from a calibrated profile and compare with the real engine.

The measurement is either taken now (bench agent's cached phase, in this
process: requests one at a time, turn-major) or read from a file:
  * a measurement this command saved (--save-measured): every request's
    prompt and output token ids, so the simulator replays exactly the
    engine's requests and must reproduce its cache hits token for token;
  * a `trajserve bench agent --json` result: per-request prompt length,
    cached tokens and TTFT only. Prompts are rebuilt so each request shares
    exactly its measured cached prefix with the request that supplied it
    (the trajectory's previous turn, or trajectory 0's first prompt for the
    shared preamble); output lengths are unknown there and taken as
    --reply-tokens, and the file has no makespan.

The simulation runs the same scheduler and KV manager with the engine's
pool and token budget; each request arrives when the previous one finished,
as in the benchmark. Predicted vs measured: engine busy time (the sum of
step times, what the simulator's clock measures), throughput, TTFT p50 and
mean, prefix hit rate, and TTFT per turn.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import numpy as np

from trajserve.config import SchedulerConfig
from trajserve.sim.build import SimSetup
from trajserve.sim.from_args import BENCH_AGENT_DEFAULTS, agent_value, command_line, dump
from trajserve.sim.hardware import Hardware, ModelCost, load_profile
from trajserve.sim.tokens import TokenSource
from trajserve.sim.workload import Call, Session, fixed

MEASUREMENT_KIND = "trajserve-agent-measurement"


def measure(args: argparse.Namespace):
    """Run bench agent's cached phase on the real engine; returns (measurement, engine)."""
    from trajserve.bench import agent as bench
    from trajserve.bench.cli import parse_agent_args
    from trajserve.llm import LLM

    flags = ["--seed", str(args.seed)]
    for name in ("trajectories", "turns", "preamble_tokens", "tool_min_tokens", "tool_max_tokens", "reply_tokens"):
        flags += ["--" + name.replace("_", "-"), str(agent_value(args, name))]
    bargs = parse_agent_args(flags)  # bench agent's own defaults for everything else
    bargs.num_blocks = bench.default_pool_blocks(bargs)
    bargs.speculative = "off"  # the simulation decodes a token a step (no --spec-accept)
    engine = LLM.from_args(bargs).engine
    busy = [0.0]
    step = engine.step

    def timed_step():
        t = time.perf_counter()
        try:
            return step()
        finally:
            busy[0] += time.perf_counter() - t

    engine.step = timed_step  # instance attribute: counts this engine's step time only
    t0 = time.perf_counter()
    try:
        records, _ = bench.cached_phase(engine, bargs, random.Random(bargs.seed))
    finally:
        del engine.step
    wall = time.perf_counter() - t0
    sc = engine.scheduler.config
    meas = {
        "kind": MEASUREMENT_KIND, "command": command_line(),
        "engine": {"block_size": engine.kv.block_size, "num_blocks": engine.num_blocks,
                   "max_num_batched_tokens": sc.max_num_batched_tokens, "max_prefill_chunk": sc.max_prefill_chunk,
                   "max_num_seqs": sc.max_num_seqs, "dtype": str(engine.dtype).removeprefix("torch.")},
        "config": {k: getattr(bargs, k) for k in ("trajectories", "turns", "preamble_tokens", "tool_min_tokens",
                                                  "tool_max_tokens", "reply_tokens")},
        "wall_s": wall, "busy_s": busy[0],
        "requests": [{"turn": r["turn"], "trajectory": r["trajectory"], "prompt_tokens": r["prompt_tokens"],
                      "cached_tokens": r["cached_tokens"], "ttft_s": r["ttft_s"],
                      "output_tokens": len(r["output_ids"]), "prompt_ids": r["prompt_ids"],
                      "output_ids": r["output_ids"]} for r in records],
    }
    return meas, engine


def load_measurement(path: str) -> dict:
    with open(path) as f:
        doc = json.load(f)
    if doc.get("kind") == MEASUREMENT_KIND:
        return doc
    if "requests" not in doc or "block_size" not in doc:
        raise ValueError(f"{path!r} is neither a saved measurement nor a `trajserve bench agent --json` result")
    # bench agent's JSON: the engine ran its defaults unless the command line said otherwise.
    return {"kind": "bench-agent", "command": doc.get("command", ""),
            "engine": {"block_size": doc["block_size"], "num_blocks": doc["num_blocks"],
                       "max_num_batched_tokens": 512, "max_prefill_chunk": 512, "max_num_seqs": 64,
                       "dtype": doc.get("dtype")},
            "config": {"reply_tokens": doc.get("reply_tokens", BENCH_AGENT_DEFAULTS["reply_tokens"])},
            "wall_s": doc.get("wall_s"), "busy_s": doc.get("busy_s"), "requests": doc["requests"]}


def calls_for(meas: dict, tokens: TokenSource) -> list[Call]:
    calls = []
    reqs = meas["requests"]
    if all("prompt_ids" in r for r in reqs):
        for r in reqs:
            ids, outs = r["prompt_ids"], r["output_ids"]
            calls.append(Call(fixed(lambda ids=ids: list(ids)), len(outs), output_ids=outs, turn=r["turn"]))
        return calls
    history: dict[int, list[int]] = {}
    preamble_source: list[int] = []
    for r in reqs:
        i, turn = r["trajectory"], r["turn"]
        source = history.get(i, []) if turn > 1 else preamble_source
        c = min(r["cached_tokens"], len(source))
        prompt = source[:c] + tokens.fresh(r["prompt_tokens"] - c)
        if turn == 1 and not preamble_source:
            preamble_source = prompt
        n_out = r.get("output_tokens") or meas["config"]["reply_tokens"]
        outs = tokens.fresh(n_out)
        history[i] = prompt + outs
        calls.append(Call(fixed(lambda p=prompt: list(p)), n_out, output_ids=outs, turn=turn))
    return calls


def predict(meas: dict, profile: dict) -> tuple[dict, list[float], list[int]]:
    e = meas["engine"]
    sched = SchedulerConfig(max_num_seqs=e["max_num_seqs"], max_num_batched_tokens=e["max_num_batched_tokens"],
                            max_prefill_chunk=e["max_prefill_chunk"])
    setup = SimSetup(hw=Hardware.from_profile(profile), model=ModelCost.from_profile(profile),
                     num_blocks=e["num_blocks"], block_size=e["block_size"], scheduler=sched,
                     pool_source="the measured engine's pool")
    sim, tokens = setup.simulator()
    res = sim.run([Session("agent", calls_for(meas, tokens))])  # one session: one request at a time
    r = res.records
    order = np.argsort([int(n.rsplit("#", 1)[1]) for n in r.name])  # records come in finish order
    ttft = (r.col("first_token") - r.col("arrival"))[order]
    cached = r.col("cached_tokens")[order]
    summary = {"busy_s": res.end_time, "output_tokens": int(r.col("output_tokens").sum()),
               "hit_rate": res.hit_rate, "steps": res.steps}
    return summary, ttft.tolist(), cached.tolist()


def compare(meas: dict, profile: dict) -> dict:
    pred, ttft_p, cached_p = predict(meas, profile)
    reqs = meas["requests"]
    ttft_m = [r["ttft_s"] for r in reqs]
    out_m = sum(r["output_tokens"] for r in reqs) if all("output_tokens" in r for r in reqs) else None
    prompt = sum(r["prompt_tokens"] for r in reqs)
    busy = meas.get("busy_s")

    def row(name, m, p, unit):
        return {"metric": name, "unit": unit, "measured": m, "predicted": p,
                "ratio": p / m if m not in (None, 0) and p is not None else None}

    rows = [row("engine busy time (makespan)", busy, pred["busy_s"], "s"),
            row("throughput", out_m / busy if out_m and busy else None,
                pred["output_tokens"] / pred["busy_s"], "output tok/s"),
            row("TTFT p50", statistics.median(ttft_m) * 1e3, statistics.median(ttft_p) * 1e3, "ms"),
            row("TTFT mean", statistics.fmean(ttft_m) * 1e3, statistics.fmean(ttft_p) * 1e3, "ms"),
            row("prefix hit rate (eq. 2)", sum(r["cached_tokens"] for r in reqs) / prompt, pred["hit_rate"], "")]
    turns = []
    for t in sorted({r["turn"] for r in reqs}):
        idx = [k for k, r in enumerate(reqs) if r["turn"] == t]
        turns.append({"turn": t, "measured_ttft_ms": statistics.median(ttft_m[k] for k in idx) * 1e3,
                      "predicted_ttft_ms": statistics.median(ttft_p[k] for k in idx) * 1e3})
    return {"command": command_line(), "measurement": {k: v for k, v in meas.items() if k != "requests"},
            "profile": {"device": profile["device"], "model": profile["model"]["name"], "fit": profile.get("fit")},
            "rows": rows, "per_turn": turns,
            "hits_reproduced": cached_p == [r["cached_tokens"] for r in reqs],
            "ttft_abs_rel_error_median": statistics.median(abs(p / m - 1) for p, m in zip(ttft_p, ttft_m) if m > 0),
            "wall_s": meas.get("wall_s")}


def run(args: argparse.Namespace) -> int:
    log = (lambda msg: None) if args.json else (lambda msg: print(msg, flush=True))
    engine = None
    if args.measured:
        meas = load_measurement(args.measured)
    else:
        log("measuring: bench agent's cached phase on the real engine ...")
        meas, engine = measure(args)
        if args.save_measured:
            with open(args.save_measured, "w") as f:
                json.dump(meas, f)
            log(f"measurement saved to {args.save_measured}")
    if args.profile:
        profile = load_profile(args.profile)
    elif engine is not None:
        from trajserve.bench.calibrate import calibrate

        log("no --profile: calibrating this engine first (as `trajserve calibrate --quick`) ...")
        profile = calibrate(engine, quick=True, log=log)
    else:
        raise ValueError("--measured needs --profile (write one with: trajserve calibrate --out profile.json)")
    res = compare(meas, profile)
    if args.json:
        print(dump(res))
    else:
        print_comparison(res)
    return 0


def _fmt(v, unit: str) -> str:
    if v is None:
        return "n/a"
    if unit == "":
        return f"{v * 100:.2f}%"
    return f"{v:,.1f}" if abs(v) >= 10 else f"{v:,.3f}"


def print_comparison(res: dict) -> None:
    m, p = res["measurement"], res["profile"]
    print(f"\n{res['command']}")
    print(f"measured: {m.get('command') or m['kind']}; engine pool {m['engine']['num_blocks']} blocks x "
          f"{m['engine']['block_size']}, budget {m['engine']['max_num_batched_tokens']} tokens/step")
    d = p["device"]
    print(f"profile: {d['name']}; model {p['model']}; fit median error "
          f"{p['fit']['median_abs_rel_error'] * 100:.1f}%" if p.get("fit") else f"profile: {d['name']}")
    print(f"\n{'':<30} {'measured':>12} {'predicted':>12} {'pred/meas':>10}")
    for r in res["rows"]:
        label = f"{r['metric']}" + (f" ({r['unit']})" if r["unit"] else "")
        ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "n/a"
        print(f"{label:<30} {_fmt(r['measured'], r['unit']):>12} {_fmt(r['predicted'], r['unit']):>12} {ratio:>10}")
    print(f"\nper-request TTFT: median |predicted / measured - 1| = {res['ttft_abs_rel_error_median'] * 100:.1f}%; "
          f"cache hits reproduced request by request: {res['hits_reproduced']}")
    if res.get("wall_s"):
        print(f"(measured wall time {res['wall_s']:.1f} s includes tokenization between requests; "
              "busy time is the engine's steps)")
    print(f"\n{'turn':>4} {'TTFT p50 measured':>18} {'predicted':>10}")
    for t in res["per_turn"]:
        print(f"{t['turn']:>4} {t['measured_ttft_ms']:>16.1f}ms {t['predicted_ttft_ms']:>8.1f}ms")
    print()
