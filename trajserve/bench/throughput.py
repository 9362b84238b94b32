"""`trajserve bench throughput`: decode and prefill speed of the real engine.

Reports, for the engine's dtype:
  * decode step time and tokens/s at several batch sizes (all sequences in
    decode, `--context` tokens of prompt each);
  * prefill tokens/s for one `--prefill-tokens` prompt;
  * the memory-bandwidth floor of one decode step (the bytes of weights it
    reads, in the format they run in, over the measured read bandwidth) and
    the ratio of the batch-1 step to it;
  * the share of each step spent outside the model forward (scheduling,
    KV bookkeeping, input preparation, sampling, detokenization).
All figures come from one process run; compare them as ratios. `--paths`
runs every execution path of the machine instead (bench/paths.py).
"""
from __future__ import annotations

import argparse
import json
import random
import time

from trajserve.bench.common import command_line, machine_info, read_bandwidth, spread
from trajserve.config import SchedulerConfig
from trajserve.sampling import SamplingParams

TARGETS = {
    "batch16_over_batch1_throughput": (">=", 6.0),
    "outside_share_batch32": ("<=", 0.10),
    "batch1_step_over_floor": ("<=", 2.0),
}


def weight_bytes(model) -> int:
    """Bytes of weights one decode step at batch 1 reads: every product's (the
    LM head's, a MoE layer's router and top_k experts': LlamaModel.weight_formats)
    and the norms (the embedding table is only gathered, B rows)."""
    total = sum(model.weight_formats().values()) + model.norm.numel() * model.norm.element_size()
    for L in model.layers:
        for t in (L.in_norm, L.post_norm, L.q_norm, L.k_norm):
            if t is not None:
                total += t.numel() * t.element_size()
    return total


def decode_run(engine, batch: int, context: int, steps: int, rng: random.Random) -> dict:
    vocab = engine.model_config.vocab_size
    # Early requests decode while later ones still prefill: leave them room
    # to keep decoding through the measured steps.
    prefill_steps = -(-batch * context // engine.scheduler.config.max_num_batched_tokens)
    sp = SamplingParams(max_tokens=steps + prefill_steps + 4, temperature=0, ignore_eos=True)
    ids = [engine.add_request([rng.randrange(vocab) for _ in range(context)], sp) for _ in range(batch)]
    sched = engine.scheduler
    # Prefill everything and take one warm-up decode step.
    while sched.waiting or any(r.num_tokens - r.num_computed_tokens > 1 for r in sched.running):
        engine.step()
    engine.step()
    walls, fwd = [], []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t)
        assert engine.last_step.num_seqs == batch, f"{engine.last_step.num_seqs} of {batch} sequences in the decode batch"
        fwd.append(engine.last_step.forward)
    for rid in ids:
        engine.abort_request(rid)
    step = spread(walls)
    outside = spread([(w - f) / w for w, f in zip(walls, fwd)])
    return {"batch": batch, "step_ms": step["median"] * 1e3, "step_ms_p10": step["p10"] * 1e3,
            "step_ms_p90": step["p90"] * 1e3, "tokens_per_s": batch / step["median"],
            "forward_ms": spread(fwd)["median"] * 1e3, "outside_share": outside["median"]}


def prefill_run(engine, tokens: int, repeats: int, rng: random.Random, cached_prefix: int = 0) -> dict:
    """Prefill tokens/s of a `tokens`-token prompt; with cached_prefix, of
    `tokens` new tokens after that many the prefix cache holds (an agent's
    next turn: the earlier turns are run first, untimed)."""
    vocab = engine.model_config.vocab_size
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def finish() -> list:
        done = []
        while engine.has_unfinished_requests():
            done += [o for o in engine.step() if o.finished]
        return done

    times = []
    for _ in range(repeats + 1):  # first run is warm-up
        prefix = [rng.randrange(vocab) for _ in range(cached_prefix)]
        if prefix:
            engine.add_request(prefix, one)
            finish()
        engine.add_request(prefix + [rng.randrange(vocab) for _ in range(tokens)], one)
        t = time.perf_counter()
        out = finish()
        times.append(time.perf_counter() - t)
        hit = out[0].num_cached_tokens
        if prefix and engine.kv.prefix_caching and hit < cached_prefix - engine.kv.block_size:
            raise RuntimeError(f"the {cached_prefix}-token prefix was not served from the cache ({hit} tokens were)")
    s = spread(times[1:])
    return {"tokens": tokens, "cached_prefix": cached_prefix, "chunk": engine.scheduler.config.max_prefill_chunk,
            "seconds": s["median"], "seconds_p10": s["p10"], "seconds_p90": s["p90"],
            "tokens_per_s": tokens / s["median"]}


def check(value: float, rule: tuple[str, float]) -> bool:
    op, limit = rule
    return value >= limit if op == ">=" else value <= limit


def run(args: argparse.Namespace) -> int:
    from trajserve.llm import LLM

    if args.paths:
        from trajserve.bench.paths import run as run_paths

        return run_paths(args)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    # The pool must hold the largest batch.
    longest = args.context + args.decode_steps + 8 + max(batches) * args.context // args.max_num_batched_tokens
    need_tokens = max(max(batches) * (longest + args.block_size), 2 * args.cached_prefix) + args.prefill_tokens + 64
    if args.num_blocks is None and args.kv_cache_memory is None:
        # Under the admission ceiling, or the last sequences of a long-context batch wait in the queue
        # (3,000-token prompts at batch 16 decoded 14 of 16).
        ceiling = SchedulerConfig().admission_ceiling
        args.num_blocks = int(need_tokens / ceiling) // args.block_size + 64
    # The forward's speed, a token a step: drafts would make a step's tokens
    # depend on the text (`bench spec` measures speculation).
    llm = LLM.from_args(argparse.Namespace(**{**vars(args), "speculative": "off"}))
    engine = llm.engine
    rng = random.Random(args.seed)

    bw = read_bandwidth(engine.device)
    wbytes = weight_bytes(engine.model)
    floor_s = wbytes / bw
    decode = [decode_run(engine, b, args.context, args.decode_steps, rng) for b in batches]
    prefill = prefill_run(engine, args.prefill_tokens, args.repeats, rng, args.cached_prefix)

    by_batch = {d["batch"]: d for d in decode}
    derived = {}
    if 1 in by_batch and 16 in by_batch:
        derived["batch16_over_batch1_throughput"] = by_batch[16]["tokens_per_s"] / by_batch[1]["tokens_per_s"]
    if 32 in by_batch:
        derived["outside_share_batch32"] = by_batch[32]["outside_share"]
    if 1 in by_batch:
        derived["batch1_step_over_floor"] = by_batch[1]["step_ms"] / (floor_s * 1e3)
    result = {
        "command": command_line(), "machine": machine_info(),
        "dtype": str(engine.dtype).removeprefix("torch."), "kv_dtype": engine.kv_format.name,
        "kernels": f"C ({engine.model.kernels.isa})" if engine.model.kernels is not None else "torch",
        "quantization": engine.quantization,
        "weights": " + ".join(f"{f} {b / 1e6:.1f} MB" for f, b in engine.model.weight_formats().items()),
        "context_tokens": args.context, "decode_steps": args.decode_steps,
        "read_bandwidth_GBps": bw / 1e9, "weight_bytes": wbytes, "decode_floor_ms": floor_s * 1e3,
        "decode": decode, "prefill": prefill,
        "targets": {k: {"value": v, "rule": " ".join(map(str, TARGETS[k])), "met": check(v, TARGETS[k])}
                    for k, v in derived.items()},
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"\n{result['command']}")
    m = result["machine"]
    print(f"{m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['torch_threads']} threads), "
          f"dtype {result['dtype']}, kernels {result['kernels']}, weights {result['weights']}")
    print(f"read bandwidth {bw / 1e9:.1f} GB/s, weights {wbytes / 1e6:.0f} MB "
          f"-> decode floor {floor_s * 1e3:.1f} ms/step\n")
    print(f"{'batch':>5} {'step ms':>9} {'p10-p90':>13} {'tok/s':>8} {'fwd ms':>8} {'outside':>8}")
    for d in decode:
        print(f"{d['batch']:>5} {d['step_ms']:>9.1f} {d['step_ms_p10']:>6.1f}-{d['step_ms_p90']:<6.1f} "
              f"{d['tokens_per_s']:>8.1f} {d['forward_ms']:>8.1f} {d['outside_share'] * 100:>7.1f}%")
    after = f" after {prefill['cached_prefix']:,} cached" if prefill["cached_prefix"] else ""
    print(f"\nprefill {prefill['tokens']} tokens{after} (chunk {prefill['chunk']}): {prefill['seconds'] * 1e3:.0f} ms "
          f"= {prefill['tokens_per_s']:.0f} tokens/s (p10-p90 {prefill['seconds_p10'] * 1e3:.0f}-"
          f"{prefill['seconds_p90'] * 1e3:.0f} ms)\n")
    for k, t in result["targets"].items():
        print(f"target {k}: {t['value']:.3g} ({t['rule']}) {'met' if t['met'] else 'NOT met'}")
    print("\nJSON:")
    print(json.dumps(result))
    return 0
