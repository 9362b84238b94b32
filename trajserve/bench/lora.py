"""`trajserve bench lora`: the cost of serving many adapters.

One engine, one process; random PEFT adapters are written to a temporary
directory (rank --rank on --targets, none can be downloaded here) and loaded.
Cases, alternated round by round (this machine's speed drifts over minutes,
so both sides of a ratio are taken seconds apart):

  base         --requests requests on the base model alone
  lora         the same prompts over --adapters adapters (requests dealt
               round-robin), the adapters' products on the C kernel
               (cpu_kernels ts_lora_rows)
  lora-torch   the same with the adapters' products as torch matmuls
               grouped by adapter (what the C kernel was measured against)
  lora-vector  where bf16 adapters run on AVX512-BF16 dot products (the
               `lora` case there), the C kernel's float vector path instead

Each pass runs under a fresh cache_salt, so every prompt is prefilled;
speculation is off, so every decode step has one row per request. Per case:
the median time of a decode step with all requests in it, the prefill
rate, the pass's time, and the ratios to base (target: lora decode step
<= 1.3x at rank 16, 16 requests over 4 adapters). Then an adapter loaded on
demand vs resident: a request's TTFT when its adapter must first be copied
into a slot (--max-loras slots, more adapters than that, cycled) vs one
whose adapter sits in its slot; and the copy's own time.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

from trajserve.sampling import SamplingParams

TARGET = 1.3


def write_adapter(d: Path, model, rank: int, targets: list[str], seed: int, dtype: str = "bfloat16",
                  alpha: float | None = None) -> None:
    """A random PEFT LoRA adapter for `model` (a ModelConfig) in directory d,
    its matrices stored as `dtype` (bfloat16: as PEFT saves an adapter
    trained on a bf16 model)."""
    import torch
    from safetensors.torch import save_file

    from trajserve.plan.adapters import module_shape

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model.num_layers):
        for m in targets:
            fan_in, fan_out = module_shape(model, m)
            part = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{part}.{m}"
            # Small enough to leave the model fluent, large enough to change its tokens.
            tensors[key + ".lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in ** 0.5
            tensors[key + ".lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(getattr(torch, dtype)) for k, v in tensors.items()}, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha or 2 * rank, "target_modules": targets,
        "lora_dropout": 0.0, "bias": "none"}))


def _pass(engine, prompts: list[list[int]], loras: list[str | None], salt: str, max_tokens: int
          ) -> tuple[float, list[float], float, list[list[int]]]:
    """(wall s, decode step times with every request in, prefill tokens/s, outputs)."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, sp, cache_salt=salt, lora=name) for p, name in zip(prompts, loras)]
    done, steps, prefill_s, prefill_tokens = {}, [], 0.0, 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
        dt, st = time.perf_counter() - t, engine.last_step
        if st.num_tokens == st.num_seqs == len(prompts):
            steps.append(dt)
        elif st.num_tokens > st.num_seqs:
            prefill_s += dt
            prefill_tokens += st.num_tokens
    return time.perf_counter() - t0, steps, prefill_tokens / prefill_s if prefill_s else 0.0, [done[i] for i in ids]


def _on_demand(engine, names: list[str], prompt: list[int], rounds: int) -> dict:
    """TTFT of one request whose adapter must be loaded into a slot vs one
    whose adapter is resident, alternated."""
    slots = engine.lora.slots
    sp = SamplingParams(max_tokens=1, temperature=0)
    cold, warm = [], []
    for r in range(rounds * len(names)):
        name = names[r % len(names)]  # more adapters than slots, cycled: each is the least recent
        for label, out in (("cold", cold), ("warm", warm)):
            before = slots.num_loads
            t = time.perf_counter()
            rid = engine.add_request(prompt, sp, cache_salt=f"od-{r}-{label}", lora=name)
            while engine.has_unfinished_requests():
                engine.step()
            out.append((time.perf_counter() - t, slots.num_loads - before))
            assert rid not in engine.groups
    loads = [c for c in cold if c[1] == 1]
    return {"cold_ttft_ms": 1000 * statistics.median(t for t, _ in loads) if loads else None,
            "warm_ttft_ms": 1000 * statistics.median(t for t, n in warm if n == 0),
            "cold_loads": len(loads), "slot_load_ms": 1000 * slots.load_seconds / max(1, slots.num_loads)}


def run(args: argparse.Namespace) -> int:
    from trajserve.bench.common import command_line, machine_info  # imports torch: not at parser build
    from trajserve.engine.engine import LLMEngine
    from trajserve.engine.options import config_from_args
    from trajserve.plan.adapters import module_name

    targets = [module_name(t.strip()) for t in args.targets.split(",") if t.strip()]
    cfg = config_from_args(args)
    # Speculation off: one row per request per decode step.
    sc = dataclasses.replace(cfg.scheduler, max_loras=max(cfg.scheduler.max_loras, args.adapters),
                             max_num_seqs=max(cfg.scheduler.max_num_seqs, args.requests), speculative="off")
    cfg = dataclasses.replace(cfg, enable_lora=True, max_lora_rank=max(cfg.max_lora_rank, args.rank), scheduler=sc)
    engine = LLMEngine(cfg)
    tmp = tempfile.TemporaryDirectory(prefix="trajserve-bench-lora-")
    names = [f"ad{i}" for i in range(args.adapters + 1)]  # one more than resident: the on-demand case
    for i, name in enumerate(names):
        write_adapter(Path(tmp.name) / name, engine.model_config, args.rank, targets, i, args.adapter_dtype)
    tok = engine.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": f"Request {i}: write about the number {i * 37 % 101} "
                                 f"and the color of the sea at dawn, in detail."}]) for i in range(args.requests)]
    cases = {"base": [None] * args.requests,
             "lora": [names[i % args.adapters] for i in range(args.requests)]}
    # The comparisons run on engines built with a path off (--kernel-paths-off), beside the default one.
    engines = {"base": engine, "lora": engine}
    cases["lora-torch"] = cases["lora"]
    engines["lora-torch"] = LLMEngine(dataclasses.replace(cfg, kernel_paths_off=("lora",)))
    kernels = engine.model.kernels
    if kernels is not None and kernels.lora_dp:  # bf16 adapters run on AVX512-BF16 dot products here
        cases["lora-vector"] = cases["lora"]
        engines["lora-vector"] = LLMEngine(dataclasses.replace(cfg, kernel_paths_off=("lora_dp",)))
    for e in set(engines.values()):
        for name in names:
            e.lora.load(name, Path(tmp.name) / name)
    rows = {c: {"wall": [], "step": [], "prefill": [], "outs": None} for c in cases}
    for r in range(args.rounds):
        order = list(cases) if r % 2 == 0 else list(reversed(cases))
        for c in order:
            wall, steps, prefill, outs = _pass(engines[c], prompts, cases[c], f"{c}-{r}", args.max_tokens)
            row = rows[c]
            row["wall"].append(wall)
            row["step"].append(statistics.median(steps))
            row["prefill"].append(prefill)
            if row["outs"] is None:
                row["outs"] = outs
            elif row["outs"] != outs:
                row["outs"] = "differ"
    for e in set(engines.values()) - {engine}:
        e.close()
    base = rows["base"]
    out_cases = []
    for c, row in rows.items():
        ratio = [s / b for s, b in zip(row["step"], base["step"])]
        out_cases.append({"name": c, "decode_step_ms": 1000 * statistics.median(row["step"]),
                          "step_ratio": statistics.median(ratio), "step_ratio_rounds": ratio,
                          "prefill_tok_s": statistics.median(row["prefill"]),
                          "pass_s": statistics.median(row["wall"]), "repeatable": row["outs"] != "differ"})
    same_c_torch = rows["lora"]["outs"] == rows["lora-torch"]["outs"]
    changed = rows["lora"]["outs"] != base["outs"]
    on_demand = _on_demand(engine, names, prompts[0], args.rounds)
    res = {"command": command_line(), "machine": machine_info(), "engine": engine.startup_summary,
           "rank": args.rank, "targets": targets, "adapters": args.adapters, "requests": args.requests,
           "max_tokens": args.max_tokens, "rounds": args.rounds, "cases": out_cases, "target": TARGET,
           "meets_target": out_cases[1]["step_ratio"] <= TARGET, "torch_same_tokens": same_c_torch,
           "adapters_change_tokens": changed, "on_demand": on_demand,
           "adapter_dtype": args.adapter_dtype,
           "adapter_mib": engine.lora.get(names[0]).num_params * (2 if args.adapter_dtype == "bfloat16" else 4) / 2**20}
    tmp.cleanup()
    engine.close()
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print_report(res)
    return 0


def print_report(res: dict) -> None:
    print(res["engine"])
    print(f"\n{res['requests']} requests over {res['adapters']} adapters (rank {res['rank']} on "
          f"{', '.join(res['targets'])}; {res['adapter_mib']:.1f} MiB each in {res['adapter_dtype']}), "
          f"{res['max_tokens']} tokens "
          f"each, speculation off, {res['rounds']} alternated rounds")
    print(f"{'case':<11} {'decode step ms':>14} {'x base':>7} {'prefill tok/s':>13} {'pass s':>7} {'repeatable':>10}")
    for c in res["cases"]:
        print(f"{c['name']:<11} {c['decode_step_ms']:>14.1f} {c['step_ratio']:>6.2f}x {c['prefill_tok_s']:>13.0f} "
              f"{c['pass_s']:>7.2f} {str(c['repeatable']):>10}")
    print(f"target: lora decode step <= {res['target']}x base: {'met' if res['meets_target'] else 'NOT met'}; "
          f"adapters change the tokens: {res['adapters_change_tokens']}; C and torch adapter products give the "
          f"same tokens: {res['torch_same_tokens']}")
    od = res["on_demand"]
    cold = "-" if od["cold_ttft_ms"] is None else f"{od['cold_ttft_ms']:.1f}"
    print(f"on demand: TTFT {cold} ms with the adapter loaded into a slot first ({od['cold_loads']} loads, "
          f"{od['slot_load_ms']:.1f} ms a copy) vs {od['warm_ttft_ms']:.1f} ms resident")


def add_parser(bsub) -> None:
    from trajserve.engine.options import add_engine_args

    s = bsub.add_parser("lora", help="many LoRA adapters vs the base model alone: decode step time, prefill, "
                        "an adapter loaded on demand vs resident")
    s.add_argument("--adapters", type=int, default=4, help="adapters the requests are dealt over")
    s.add_argument("--requests", type=int, default=16)
    s.add_argument("--rank", type=int, default=16)
    s.add_argument("--targets", default="q,k,v,o,gate,up,down", help="adapted projections")
    s.add_argument("--adapter-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="what the adapters' files hold (they run in it)")
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--rounds", type=int, default=3)
    s.add_argument("--json", action="store_true", help="print only JSON")
    add_engine_args(s)
    s.set_defaults(func=run)
