"""`trajserve calibrate`: measure the real engine on this machine and write
the hardware profile `trajserve simulate --profile` reads.

Measured, each step timed around LLMEngine.step() (wall time: the simulator
predicts wall time, host work included):
  * prefill: one prompt per chunk size c, cut into chunks of c (token budget
    = chunk cap = c), so chunk k runs c new tokens after k c cached ones:
    rate vs chunk size and context;
  * decode: b sequences decoding after an L-token prompt, for several b and
    L (the prompt is computed once and shared through the prefix cache, so
    the b sequences read the same blocks; on a CPU that flatters large b a
    little through the caches);
  * host copy bandwidth: one large tensor copy in memory (the host tier's
    link on a CPU), and an fsync'd file write (the disk tier).
Then the step-time model of sim/fit.py is fitted to all steps: P_eff,
P_att,eff, beta_eff (weights), beta_KV,eff (KV reads), t_fixed and t_seq;
the profile stores them with MFU = MBU = 1 (they are achieved rates).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from trajserve.plan import model_shapes
from trajserve.sim.fit import fit_steps
from trajserve.sim.hardware import PROFILE_KIND, ModelCost

# (prefill chunk sizes, prefill prompt tokens, decode batches, decode contexts, decode steps, repeats, copy MiB)
DEFAULT = dict(chunks=(32, 128, 512), prefill_tokens=2048, batches=(1, 4, 16, 32), contexts=(128, 1024),
               decode_steps=8, repeats=2, copy_mib=256)
QUICK = dict(chunks=(64, 512), prefill_tokens=1024, batches=(1, 4, 16), contexts=(128, 1024),
             decode_steps=4, repeats=1, copy_mib=64)


@dataclass(slots=True)
class Step:
    kind: str        # "prefill" | "decode"
    seconds: float
    chunks: list[tuple[int, int]]  # (new tokens, cached tokens) per sequence
    sampled: int
    size: int = 0    # the run's chunk size (prefill) or batch (decode)
    context: int = 0  # cached tokens before the chunk (prefill) or the prompt length (decode)


def model_cost_of(engine) -> ModelCost:
    from trajserve.bench.throughput import weight_bytes

    cfg = engine.model_config
    return ModelCost(name=cfg.name or os.path.basename(str(engine.model_path)), config=cfg,
                     matmul_params=model_shapes.matmul_params(cfg), head_params=model_shapes.lm_head_params(cfg),
                     weight_read_bytes=float(weight_bytes(engine.model)),
                     m_token=float(engine.kv_format.bytes_per_token(cfg)))


def _tokens(engine, rng: random.Random, n: int) -> list[int]:
    vocab = engine.model_config.vocab_size
    return [rng.randrange(vocab) for _ in range(n)]


def measure_prefill(engine, chunk: int, tokens: int, rng: random.Random) -> list[Step]:
    from trajserve.sampling import SamplingParams

    engine.scheduler.reconfigure(max_num_batched_tokens=chunk, max_prefill_chunk=chunk)
    engine.kv.clear_cache()
    rid = engine.add_request(_tokens(engine, rng, tokens), SamplingParams(max_tokens=1, temperature=0,
                                                                          ignore_eos=True))
    steps = []
    done = 0
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t
        n = engine.last_step.num_tokens
        if n:
            steps.append(Step("prefill", dt, [(n, done)], 1 if done + n == tokens else 0, chunk, done))
            done += n
    engine.abort_request(rid)
    return steps


def measure_decode(engine, batch: int, context: int, steps: int, rng: random.Random) -> list[Step]:
    from trajserve.sampling import SamplingParams

    engine.scheduler.reconfigure(max_num_batched_tokens=512, max_prefill_chunk=512)
    engine.kv.clear_cache()
    prompt = _tokens(engine, rng, context)
    # Compute the prompt once; the batch then hits it in the prefix cache.
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    warm = 2
    sp = SamplingParams(max_tokens=warm + steps + 4, temperature=0, ignore_eos=True)
    ids = [engine.add_request(prompt, sp) for _ in range(batch)]
    sched = engine.scheduler
    while sched.waiting or any(len(r.all_token_ids) - r.num_computed_tokens > 1 for r in sched.running):
        engine.step()
    out = []
    for i in range(warm + steps):
        ctx = [r.num_computed_tokens for r in sched.running]
        t = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t
        if engine.last_step.num_seqs != batch:
            raise RuntimeError(f"decode batch of {engine.last_step.num_seqs}, expected {batch}: pool too small?")
        if i >= warm:
            out.append(Step("decode", dt, [(1, h) for h in ctx], batch, batch, context))
    for rid in ids:
        engine.abort_request(rid)
    return out


def copy_bandwidth(mib: int, repeats: int = 3) -> float:
    import torch

    n = mib * 2**20 // 4
    src, dst = torch.ones(n), torch.empty(n)
    dst.copy_(src)  # first touch: page faults are not bandwidth
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return n * 4 / best


def disk_bandwidth(mib: int) -> float:
    data = os.urandom(2**20) * mib
    with tempfile.NamedTemporaryFile(dir=os.environ.get("TMPDIR")) as f:
        t = time.perf_counter()
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
        return len(data) / (time.perf_counter() - t)


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def work_terms(steps: list[Step], model: ModelCost) -> dict[str, np.ndarray]:
    """The fit's regressors per step (sim/fit.py), tp = 1."""
    from trajserve.plan.flops import causal_pairs

    L, qd = model.num_layers, model.q_dim
    n_tok = np.array([sum(c for c, _ in s.chunks) for s in steps], dtype=float)
    pairs = np.array([sum(causal_pairs(c, h) for c, h in s.chunks) for s in steps], dtype=float)
    kv = np.array([sum(c + h for c, h in s.chunks) for s in steps], dtype=float)
    return {"t": np.array([s.seconds for s in steps]), "n_seq": np.array([len(s.chunks) for s in steps], float),
            "f_mm": 2 * model.matmul_params * n_tok + 2 * model.head_params * np.array([s.sampled for s in steps]),
            "f_att": 4 * L * qd * pairs, "d_w": np.full(len(steps), model.weight_read_bytes),
            "d_kv": model.m_token * kv}


def calibrate(engine, quick: bool = False, seed: int = 0, log=print) -> dict:
    plan = QUICK if quick else DEFAULT
    rng = random.Random(seed)
    t0 = time.perf_counter()
    # Warm-up: first calls pay for allocation and oneDNN primitive creation.
    measure_prefill(engine, 64, 128, rng)
    steps: list[Step] = []
    for rep in range(plan["repeats"]):
        for c in plan["chunks"]:
            s = measure_prefill(engine, c, plan["prefill_tokens"], rng)
            steps += s
            log(f"prefill chunk {c:>4}: {sum(x.seconds for x in s):6.2f} s for {plan['prefill_tokens']} tokens "
                f"({len(s)} steps)")
    for L in plan["contexts"]:
        for b in plan["batches"]:
            s = measure_decode(engine, b, L, plan["decode_steps"], rng)
            steps += s
            log(f"decode batch {b:>3} context {L:>5}: {statistics.median(x.seconds for x in s) * 1e3:7.1f} ms/step")
    from trajserve.bench.common import read_bandwidth

    read_bw = read_bandwidth(engine.device, plan["copy_mib"] * 2**20)
    host = copy_bandwidth(plan["copy_mib"])
    disk = disk_bandwidth(min(plan["copy_mib"], 64))
    log(f"memory read {read_bw / 1e9:.1f} GB/s, host copy {host / 1e9:.1f} GB/s, "
        f"disk write (fsync) {disk / 1e9:.2f} GB/s")

    # Each configuration counts once: (decode, batch, prompt) or (prefill,
    # chunk, 512-token band of context), whatever its number of steps.
    groups = [(s.kind, s.size, s.context if s.kind == "decode" else s.context // 512) for s in steps]
    return profile_from_steps(engine, steps, read_bw, host, disk, groups,
                              f"trajserve calibrate{' --quick' if quick else ''}", t0, quick)


def profile_from_steps(engine, steps: list[Step], read_bw: float, host: float, disk: float, groups: list,
                       source: str, t0: float, quick: bool = False) -> dict:
    """The hardware profile of sim/fit.py's step model fitted to `steps`
    (decodes memory-bound first), each of `groups`' configurations weighing
    one in all."""
    from trajserve.engine.memory import available_memory

    model = model_cost_of(engine)
    terms = work_terms(steps, model)
    count = {g: groups.count(g) for g in set(groups)}
    fit = fit_steps(terms["t"], terms["n_seq"], terms["f_mm"], terms["f_att"], terms["d_w"], terms["d_kv"],
                    memory_bound_first=np.array([s.kind == "decode" for s in steps]), b_min=1.0 / read_bw,
                    weights=[1.0 / count[g] for g in groups])
    if fit.a_mm <= 0:
        raise RuntimeError(f"calibration could not separate compute from memory time (fit {fit}); "
                           "run without --quick for more points")
    abs_err = np.abs(fit.rel_error)
    cfg = engine.config
    return {
        "kind": PROFILE_KIND, "version": 1,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "calibration_s": time.perf_counter() - t0, "quick": quick,
        "machine": _machine(),
        "device": {
            "name": f"{engine.device.type}: {_machine()['cpu']}" if engine.device.type == "cpu" else str(engine.device),
            "peak_flops": 1.0 / fit.a_mm, "attention_flops": 1.0 / fit.a_att if fit.a_att > 0 else 0.0,
            "bandwidth": 1.0 / fit.b_w, "kv_bandwidth": 1.0 / fit.b_kv,
            "fixed_overhead_s": fit.t_fixed, "per_seq_overhead_s": fit.t_seq,
            "host_link_bandwidth": host, "nvme_bandwidth": disk, "read_bandwidth": read_bw,
            "memory_bytes": available_memory(engine.device),
            "source": f"{source}, dtype {str(engine.dtype).removeprefix('torch.')}",
        },
        "model": model.to_profile(),
        "engine": {"dtype": str(engine.dtype).removeprefix("torch."), "block_size": cfg.cache.block_size,
                   "memory_fraction": cfg.cache.memory_fraction, "threads": _threads()},
        "fit": {"median_abs_rel_error": float(np.median(abs_err)), "max_abs_rel_error": float(abs_err.max()),
                "steps": len(steps), "compute_bound_steps": int(fit.compute_bound.sum())},
        "measurements": [{"kind": s.kind, "size": s.size, "context": s.context, "seconds": s.seconds,
                          "new_tokens": sum(c for c, _ in s.chunks), "sequences": len(s.chunks),
                          "predicted": float(p)} for s, p in zip(steps, fit.predicted)],
    }


def _machine() -> dict:
    from trajserve.bench.common import machine_info

    return machine_info()


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def run(args: argparse.Namespace) -> int:
    # No OMP_WAIT_POLICY here: spinning vs sleeping OpenMP threads changes a
    # CPU decode step by ~30%, so the profile must be taken under the same
    # setting (and threads) as the engine it is meant to predict.
    from trajserve.llm import LLM

    log = (lambda *a, **k: None) if args.json else (lambda msg: print(msg, flush=True))
    # Room for the prefill prompt, or for the decode prompt (shared through the
    # prefix cache) plus each sequence's tail and decoded tokens.
    plan = QUICK if args.quick else DEFAULT
    per_seq = -(-(16 + plan["decode_steps"] + 8) // 16) + 1
    need = max(plan["prefill_tokens"], max(plan["contexts"])) // 16 + max(plan["batches"]) * per_seq + 64
    # Speculation off: the profile is the cost of steps of known shapes (the
    # simulator adds speculation's rows itself: --spec-accept).
    llm = LLM(args.model, device=args.device, dtype=args.dtype, num_blocks=need, block_size=16,
              max_num_seqs=max(64, max(plan["batches"])), max_num_batched_tokens=512, num_threads=args.threads,
              speculative="off")
    profile = calibrate(llm.engine, args.quick, log=log)
    with open(args.out, "w") as f:
        json.dump(profile, f, indent=2)
    if args.json:
        print(json.dumps(profile, indent=2))
        return 0
    print_profile(profile, args.out)
    return 0


def print_profile(p: dict, path: str) -> None:
    d, f = p["device"], p["fit"]
    print(f"\nhardware profile -> {path} ({p['calibration_s']:.0f} s, {f['steps']} steps, model {p['model']['name']}, "
          f"dtype {p['engine']['dtype']}, {p['engine']['threads']} threads)")
    print(f"  matmul rate        P_eff     = {d['peak_flops'] / 1e9:8.1f} GFLOP/s")
    att = d["attention_flops"]
    print(f"  attention rate     P_att,eff = {att / 1e9:8.1f} GFLOP/s" if att else
          "  attention rate     (not separable: taken = matmul rate)")
    print(f"  weight stream      beta_eff  = {d['bandwidth'] / 1e9:8.1f} GB/s "
          f"(raw read {d['read_bandwidth'] / 1e9:.1f} GB/s)")
    print(f"  KV read (attention) beta_KV  = {d['kv_bandwidth'] / 1e9:8.1f} GB/s")
    print(f"  fixed per step     t_fixed   = {d['fixed_overhead_s'] * 1e3:8.2f} ms")
    print(f"  per sequence       t_seq     = {d['per_seq_overhead_s'] * 1e3:8.3f} ms")
    print(f"  host copy                      {d['host_link_bandwidth'] / 1e9:8.1f} GB/s")
    print(f"  disk write (fsync)             {d['nvme_bandwidth'] / 1e9:8.2f} GB/s")
    print(f"  fit: median |error| {f['median_abs_rel_error'] * 100:.1f}%, max {f['max_abs_rel_error'] * 100:.1f}% "
          f"over {f['steps']} steps ({f['compute_bound_steps']} compute-bound)\n")
    rows: dict[tuple, list] = {}
    for m in p["measurements"]:
        if m["kind"] == "prefill" and m["context"] % 512:
            continue  # small chunks run dozens of steps: the table shows one per 512 tokens of context
        rows.setdefault((m["kind"], m["size"], m["context"]), []).append((m["seconds"], m["predicted"]))
    print("medians per configuration (decode: batch, prompt length; prefill: chunk, cached tokens before it)")
    print(f"{'step':<8} {'batch/chunk':>11} {'context':>8} {'measured ms':>12} {'model ms':>9} {'error':>7}")
    for (kind, n, ctx), v in sorted(rows.items()):
        meas = statistics.median(x for x, _ in v)
        pred = statistics.median(y for _, y in v)
        print(f"{kind:<8} {n:>11} {ctx:>8} {meas * 1e3:>12.1f} {pred * 1e3:>9.1f} {(pred / meas - 1) * 100:>6.1f}%")
