"""`trajserve serve --slo`: the configuration `plan choose` picks
(plan/choose.py, inference-optimization 8.6.3), priced for this engine on
this machine and then run.

The chapter prices its candidates from one measured configuration, B (the
shared prefix stored once, no drafts). Here B is the engine as the command
line builds it:

1. a calibration batch runs on it twice (the second finds the shared prefix
   cached, as B's prefill does) in a cache namespace of its own, dropped
   afterwards: requests that share a prefix, their outputs of different
   lengths so the decode batch shrinks step by step. Every step
   feeds the engine's step-time model (engine/step_time.py: t_0, t_tok,
   t_seq, t_pair fitted by least squares), the one deadline-aware admission
   prices requests with;
2. B is priced from that fit at the SLO's full size: its prefill (each
   request's private tokens after the cached shared prefix, in chunks of the
   step's token budget) and a decode round of the whole batch at the mean
   context; A and C's rounds are interpolated in rounds priced at batch 1, n
   and 2n (C by the bytes it reads: its dequantizing is not measured); E's
   round adds verifying `drafts` positions a request, its tokens a round are
   `lookup` (the chapter's 2 unless the SLO says);
3. the candidates are chosen among as `plan choose` does, memory being the
   KV pool's bytes unless the SLO names it. D is not offered: this engine runs
   no draft model. If the choice is not the engine as built, the engine is
   built again with the choice's options (--kv-cache-dtype,
   --no-prefix-caching, --speculative); if none fits and is on time, the
   engine stays as the command line built it.

The start-up line says what was measured, each candidate's memory and time,
and what runs.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from trajserve.plan.flops import causal_pairs, forward_flops
from trajserve.units import parse_bytes, parse_seconds

CALIBRATION_SALT = "trajserve-slo-calibration"
CALIBRATION_PROMPT = 256     # the calibration batch's prompt tokens at most
CALIBRATION_REQUESTS = 8     # and its requests at most (at least 4 where --max-num-seqs allows: batch sizes vary)
CALIBRATION_ROUNDS = 4       # batches run at most until the fit has enough steps

# What each candidate runs as (engine options); A, B and E keep the pool's format.
APPLIED = {
    "A": {"enable_prefix_caching": False, "speculative": "off"},
    "B": {"enable_prefix_caching": True, "speculative": "off"},
    "C": {"enable_prefix_caching": False, "speculative": "off", "kv_cache_dtype": "q8_0"},
    "E": {"enable_prefix_caching": True, "speculative": "ngram"},
}


@dataclass(frozen=True)
class SLOWorkload:
    """--slo: a batch of requests arriving together and its deadline."""
    requests: int
    input: int
    shared: int
    output: int
    deadline_s: float
    memory_bytes: int | None = None  # None: the KV pool's bytes
    lookup: float = 2.0              # E's tokens a round (the chapter's, exercise 8-9)
    drafts: int = 4                  # E's positions each request verifies a round


_KEYS = ("requests", "input", "shared", "output", "deadline", "memory", "lookup", "drafts")
SLO_HELP = ("requests=N,input=TOKENS,shared=TOKENS,output=TOKENS,deadline=SECONDS[,memory=BYTES][,lookup=TOKENS]"
            "[,drafts=N]")


def _count(key: str, text: str, low: int, high: int = 1 << 30) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"--slo {key} must be a whole number, got {text!r}") from None
    if not low <= value <= high:
        raise ValueError(f"--slo {key} must be in [{low:,}, {high:,}], got {value:,}")
    return value


def _positive(key: str, text: str, high: float) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"--slo {key} must be a number, got {text!r}") from None
    if not (0 < value <= high):  # NaN fails here too
        raise ValueError(f"--slo {key} must be > 0 and <= {high:g}, got {text!r}")
    return value


def parse_slo(text: str) -> SLOWorkload:
    """`requests=16,input=8192,shared=6144,output=256,deadline=7s` (memory,
    lookup and drafts optional). ValueError naming the key and its limit."""
    fields: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or key not in _KEYS:
            raise ValueError(f"--slo takes {SLO_HELP}; got {part.strip()[:40]!r}")
        if key in fields:
            raise ValueError(f"--slo names {key} twice")
        fields[key] = value.strip()
    missing = [k for k in _KEYS[:5] if k not in fields]
    if missing:
        raise ValueError(f"--slo needs {', '.join(missing)} ({SLO_HELP})")
    w = SLOWorkload(requests=_count("requests", fields["requests"], 1, 4096),
                    input=_count("input", fields["input"], 1),
                    shared=_count("shared", fields["shared"], 0),
                    output=_count("output", fields["output"], 1),
                    deadline_s=parse_seconds(fields["deadline"], "--slo deadline", 86_400.0),
                    memory_bytes=parse_bytes(fields["memory"], "--slo memory") if "memory" in fields else None,
                    lookup=_positive("lookup", fields.get("lookup", "2"), 64.0),
                    drafts=_count("drafts", fields.get("drafts", "4"), 1, 64))
    if w.shared >= w.input:
        raise ValueError(f"--slo shared ({w.shared:,}) must be below input ({w.input:,}): each request has its own "
                         "tokens to prefill")
    if w.memory_bytes is not None and w.memory_bytes <= 0:
        raise ValueError("--slo memory must be > 0 bytes")
    return w


def check_fits(engine, w: SLOWorkload) -> None:
    """The engine must be able to run the batch at once, as every candidate does."""
    sc = engine.config.scheduler
    if w.requests > sc.max_num_seqs:
        raise ValueError(f"--slo requests={w.requests} is over --max-num-seqs {sc.max_num_seqs}: the candidates "
                         "run the batch at once")
    if w.input + w.output > engine.max_model_len:
        raise ValueError(f"--slo input + output ({w.input + w.output:,} tokens) is over max_model_len "
                         f"{engine.max_model_len:,}")


def calibrate(engine, w: SLOWorkload) -> dict:
    """Run the calibration batch (module docstring, 1) until the engine's
    step-time model is ready; what ran."""
    import torch

    from trajserve.engine.calibration import random_tokens, run_private
    from trajserve.sampling import SamplingParams

    n = max(1, min(max(w.requests, 4), CALIBRATION_REQUESTS, engine.config.scheduler.max_num_seqs))
    longest = 2 * n + 2
    room = engine.kv.token_capacity // (2 * n)  # half the pool at most, so a small pool still runs it
    prompt = min(w.input, CALIBRATION_PROMPT, room - longest, engine.max_model_len - longest - 1)
    if prompt < 2:
        raise ValueError(f"the KV pool ({engine.kv.token_capacity:,} tokens) is too small to calibrate --slo")
    shared = min(prompt - 1, prompt * w.shared // w.input)
    g = torch.Generator().manual_seed(0)
    steps, start, rounds = engine.deadlines.steps, engine.deadlines.steps.num_steps, 0
    head = random_tokens(engine, shared, g)
    # Twice at least: the second batch finds the shared prefix cached, as B's prefill does.
    while rounds < 2 or (rounds < CALIBRATION_ROUNDS and not steps.ready):
        run_private(engine, [(head + random_tokens(engine, prompt - shared, g),
                              SamplingParams(max_tokens=2 + 2 * i, temperature=0, ignore_eos=True))
                             for i in range(n)], CALIBRATION_SALT, drop=False)
        rounds += 1
    engine.invalidate(cache_salt=CALIBRATION_SALT)
    if not steps.ready:
        raise RuntimeError(f"the SLO calibration ran {steps.num_steps - start} steps, too few to fit step times")
    return {"requests": n, "prompt": prompt, "shared": shared, "batches": rounds,
            "steps": steps.num_steps - start}


def measured_b(engine, w: SLOWorkload):
    """plan.choose.Measured for B at the SLO's size, from the engine's fitted
    step times (module docstring, 2)."""
    from trajserve.plan.choose import Measured

    steps = engine.deadlines.steps
    # The step's token budget (under --max-num-batched-tokens auto its ceiling: the ITL target may take less).
    budget = max(1, int(engine.config.scheduler.max_num_batched_tokens))
    n, private = w.requests, w.input - w.shared
    chunks = math.ceil(n * private / budget)
    prefill = steps.seconds(chunks, n * private, n + chunks - 1, n * causal_pairs(private, w.shared))
    ctx = w.input + w.output // 2  # a decode row's pairs are its context
    rounds = {b: steps.seconds(1, b, b, b * w.input) for b in sorted({1, n, 2 * n})}
    return Measured(shared_prefill_s=prefill, shared_round_s=steps.seconds(1, n, n, n * ctx),
                    rounds=rounds, round_context=w.input, lookup_tokens_per_round=w.lookup,
                    lookup_round_extra_s=steps.seconds(0, n * w.drafts, 0, n * w.drafts * ctx))


def price(engine, w: SLOWorkload):
    """The candidates for this engine (module docstring, 2 and 3) and the one chosen."""
    from trajserve.plan.catalog import DeviceSpec, ModelSpec
    from trajserve.plan.choose import candidates, choose
    from trajserve.plan.model_shapes import matmul_params, total_params

    c = engine.model_config
    m = measured_b(engine, w)
    memory = w.memory_bytes if w.memory_bytes is not None else engine.num_blocks * engine.block_bytes
    # The candidates scale B's FLOP efficiency; a device whose peak is what B
    # reaches (efficiency 1) prices A and C's prefills at B's FLOP rate.
    flops = w.requests * forward_flops(matmul_params(c), c.num_layers, c.num_heads * c.head_dim,
                                       w.input - w.shared, w.shared)
    device = DeviceSpec(key="this-engine", name=str(engine.device), memory_bytes=int(memory), hbm_bandwidth=0.0,
                        bf16_flops=flops / m.shared_prefill_s * (1 + 1e-9), host_link="", host_link_bandwidth=0.0,
                        nvme_bandwidth=0.0, source="the engine's fitted step times")
    model = ModelSpec(key=c.name or "model", config=c, params=total_params(c), dtype="engine", source="the engine")
    cands = candidates(model, device, w.requests, w.input, w.shared, w.output, memory, w.deadline_s, m,
                       engine.config.cache.block_size, engine.kv_format.plan_name, draft=False)
    return cands, choose(cands), memory


def runs_as(engine) -> dict:
    """The APPLIED options' values the engine runs with."""
    return {"enable_prefix_caching": engine.config.cache.enable_prefix_caching,
            "speculative": engine.speculative, "kv_cache_dtype": engine.kv_format.name}


def summary(w: SLOWorkload, ran: dict, cands, chosen, memory: int, rebuilt: bool) -> str:
    rows = "; ".join(f"{x.name} {x.memory_bytes / 2**20:,.1f} MiB {x.time_s:,.2f} s"
                     + ("" if x.fits else " (does not fit)") + ("" if x.on_time else " (late)") for x in cands)
    head = (f"SLO: {w.requests} requests x {w.input:,} input ({w.shared:,} shared) + {w.output:,} output tokens "
            f"within {w.deadline_s:g} s and {memory / 2**20:,.1f} MiB of KV; priced from {ran['steps']} calibration "
            f"steps ({ran['batches']} x {ran['requests']} requests of {ran['prompt']} tokens) | {rows}")
    if chosen is None:
        return f"{head} | none fits and is on time: serving as configured"
    options = ", ".join(f"{k}={v}" for k, v in APPLIED[chosen.name].items())
    return f"{head} | chosen: {chosen.name} ({chosen.what}): {options}" + (" (engine rebuilt)" if rebuilt else "")


def build_for_slo(args: argparse.Namespace, w: SLOWorkload):
    """The engine --slo chooses (module docstring), and the start-up line
    that says why."""
    from trajserve.llm import LLM

    engine = LLM.from_args(args).engine
    try:
        check_fits(engine, w)
        ran = calibrate(engine, w)
        cands, chosen, memory = price(engine, w)
    except BaseException:
        engine.close()
        raise
    rebuilt = False
    if chosen is not None:
        want = {**runs_as(engine), **APPLIED[chosen.name]}
        if want != runs_as(engine):
            engine.close()  # the new engine fits its own step times from its first steps
            engine = LLM.from_args(argparse.Namespace(**{**vars(args), **want})).engine
            rebuilt = True
    return engine, summary(w, ran, cands, chosen, memory, rebuilt)

