"""`trajserve bench budget`: 8.2.4's trade-off on this engine. A long prompt
arrives while --decoders requests decode; per token budget (a fixed
--max-num-batched-tokens, or auto from --itl-target-ms), the decoders'
longest wait between two tokens while it is prefilled, and its time to
first token. A bigger budget lets the newcomer's prefill finish in fewer
steps and the decoders wait longer for each; the ITL rule picks the budget
that keeps their wait under the target."""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

SETTINGS = ("512", "8192", "auto")


def run_setting(cfg, setting: str, args) -> dict:
    from trajserve.engine.engine import LLMEngine
    from trajserve.sampling import SamplingParams

    sc = cfg.scheduler
    budget = dict(max_num_batched_tokens="auto", itl_target_ms=args.itl_target_ms, max_prefill_chunk=None) \
        if setting == "auto" else dict(max_num_batched_tokens=int(setting), max_prefill_chunk=int(setting),
                                       itl_target_ms=None)
    engine = LLMEngine(dataclasses.replace(cfg, scheduler=dataclasses.replace(sc, speculative="off", **budget)))
    try:
        warm = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        for i in range(args.warmup):  # steps of several shapes for the step-time model
            engine.add_request(list(range(100 + i, 100 + i + 64 * (1 + i % 8))), warm)
            if i % 4 == 3:
                while engine.has_unfinished_requests():
                    engine.step()
        long = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
        decoders = [engine.add_request(list(range(2000 + 300 * i, 2000 + 300 * i + 200)), long)
                    for i in range(args.decoders)]
        while any(len(engine.groups[d].seqs[0].output_token_ids) < 2 for d in decoders):
            engine.step()
        arrival = time.perf_counter()
        rid = engine.add_request(list(range(5, 5 + args.prompt_tokens)), SamplingParams(max_tokens=1, temperature=0))
        gaps, last, ttft = [], time.perf_counter(), None
        while ttft is None:
            outs = engine.step()
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
            if any(o.request_id == rid for o in outs):
                ttft = now - arrival
        return {"setting": setting, "max_itl_ms": 1e3 * max(gaps), "ttft_ms": 1e3 * ttft, "steps": len(gaps)}
    finally:
        engine.close()


def run(args: argparse.Namespace) -> int:
    from trajserve.bench.common import command_line, machine_info
    from trajserve.engine.options import config_from_args

    cfg = config_from_args(args)
    rows = [run_setting(cfg, s, args) for s in args.settings.split(",")]
    report = {"command": command_line(), "machine": machine_info(), "decoders": args.decoders,
              "prompt_tokens": args.prompt_tokens, "itl_target_ms": args.itl_target_ms, "rows": rows}
    if not args.json:
        print(f"{args.decoders} requests decoding; a {args.prompt_tokens:,}-token prompt arrives; "
              f"auto: --itl-target-ms {args.itl_target_ms:g}")
        print(f"{'budget':<8} {'decoders max ITL':>17} {'newcomer TTFT':>14} {'steps':>6}")
        for r in rows:
            print(f"{r['setting']:<8} {r['max_itl_ms']:>14.1f} ms {r['ttft_ms']:>11.1f} ms {r['steps']:>6}")
    print(json.dumps(report))
    return 0


def add_parser(bsub) -> None:
    from trajserve.engine.options import add_engine_args

    s = bsub.add_parser("budget", help="8.2.4's trade-off: a long prompt's TTFT against the running requests' "
                        "longest ITL, per token budget (fixed, or auto from --itl-target-ms)")
    s.add_argument("--settings", default=",".join(SETTINGS), help="budgets to run: counts, and auto")
    s.add_argument("--decoders", type=int, default=4)
    s.add_argument("--prompt-tokens", type=int, default=4096)
    s.add_argument("--warmup", type=int, default=12, help="requests run first, for the step-time model")
    s.add_argument("--json", action="store_true", help="print only JSON")
    add_engine_args(s, defaults={"kv_cache_memory": "1GiB", "itl_target_ms": 50.0})
    s.set_defaults(func=run)
