"""`trajserve plan QUESTION`: inference-optimization's sizing questions
beyond capacity, each answered by its own module of plan/:

    plan spec      speculative decoding: E[N], time per token, draft length (speculation.py; 8.5.2-8.5.4)
    plan offload   weight offload with prefetch: memory freed, copy time per round (weight_offload.py; 8.4.3)
    plan reads     a decode round's reads: I_weight, d(b, L), b_KV (batch_reads.py; 8.2.1)
    plan request   one request's time from its parts (batch_config.request_time; 8.1.1)
    plan goodput   requests in the system, goodput, cost per good result (goodput.py; 8.6.1-8.6.2)
    plan task      a whole agent task's time and speed-up when stages speed up (goodput.py; 8.6.3)
    plan lora      many LoRA adapters on one base: their bytes, the KV pool they take (adapters.py; 8.2.1)
"""
from __future__ import annotations

import argparse
import json


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_spec_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--accept", type=_floats, required=True,
                   help="acceptance probability a, or a profile a_1,a_2,... (each given all before it were "
                        "accepted; the last repeats)")
    p.add_argument("--draft-len", type=_ints, default=[1, 2, 4, 8], help="draft lengths m to compare")
    p.add_argument("--verify-ms", type=float, required=True, help="one verify step (target forward), ms")
    p.add_argument("--plain-ms", type=float, default=None, help="one plain decode step, ms (default: --verify-ms)")
    p.add_argument("--query-ms", type=float, default=0.0, help="a draft lookup per round, ms")
    p.add_argument("--draft-ms", type=float, default=0.0, help="drafting per draft token (a draft model), ms")
    p.add_argument("--draft-group", type=int, default=1,
                   help="draft positions run in groups of this many (a fixed execution shape)")
    p.add_argument("--setup-ms", type=float, default=0.0, help="one-off setup, e.g. building the index, ms")
    p.add_argument("--output-tokens", type=int, default=0, help="a request's output, for its total time")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=cmd_spec)


def add_questions(questions) -> None:
    add_spec_parser(questions.add_parser("spec", help="speculative decoding: E[N], time per token, draft length"))
    add_offload_parser(questions.add_parser("offload", help="weight offload with prefetch: memory freed, copy time"))
    add_reads_parser(questions.add_parser("reads", help="a decode round's reads per token and b_KV, by batch size"))
    add_request_parser(questions.add_parser("request", help="one request's time: queue + prefill + intervals"))
    add_goodput_parser(questions.add_parser("goodput", help="Little's law, R_good, GPU time and energy per good result"))
    add_task_parser(questions.add_parser("task", help="a task's time when its stages speed up (Amdahl), with setup"))
    add_lora_parser(questions.add_parser("lora", help="LoRA adapters on one base model: bytes, and the KV they take"))
    from trajserve.commands.plan_choose import add_choose_parser
    add_choose_parser(questions.add_parser("choose", help="the configuration a deadline and a memory budget "
                                           "leave (8.6.3): memory, time, GPU-s per good result"))


def add_lora_parser(p: argparse.ArgumentParser) -> None:
    from trajserve.plan.catalog import model_names

    p.add_argument("--model", required=True, help=" | ".join(model_names()) + ", or a config.json / .gguf")
    p.add_argument("--rank", type=int, default=16, help="r")
    p.add_argument("--targets", default="q,v", help="modules with an adapter: q,k,v,o,gate,up,down (or *_proj)")
    p.add_argument("--adapters", type=int, default=100, help="N adapters resident at once")
    p.add_argument("--adapter-dtype", default="bf16", help="s_a: the adapters' format")
    p.add_argument("--weight-dtype", default="bf16", help="the base model's matrices' format")
    p.add_argument("--kv-dtype", default="bf16")
    p.add_argument("--contexts", type=int, default=100, help="sequences for the KV comparison")
    p.add_argument("--context", type=int, default=8192, help="tokens per sequence for the KV comparison")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_lora)


def cmd_lora(args: argparse.Namespace) -> int:
    from trajserve.plan.adapters import plan_adapters
    from trajserve.plan.catalog import get_model
    from trajserve.plan.kv_format import m_token, storage_format

    cfg = get_model(args.model).config
    s_a = float(storage_format(args.adapter_dtype, "adapter dtype").bytes_per_value)
    s_w = float(storage_format(args.weight_dtype, "weight dtype").bytes_per_value)
    p = plan_adapters(cfg, args.rank, [t.strip() for t in args.targets.split(",") if t.strip()], args.adapters, s_a,
                      s_w, float(m_token(cfg, args.kv_dtype)), args.contexts, args.context)
    if args.json:
        print(json.dumps(p.to_dict()))
        return 0
    mib, gib = 2**20, 2**30
    print(f"one adapter (rank {p.rank} on {', '.join(p.targets)}): {p.adapter_params:,} parameters = "
          f"{p.adapter_bytes / mib:.1f} MiB")
    print(f"{p.adapters} adapters: {p.adapters_bytes / gib:.2f} GiB, against {p.matrix_weight_bytes / gib:.1f} GiB of "
          f"the base model's matrices")
    print(f"KV: m_token = {p.kv_per_token:,.0f} B; resident adapters take {p.pool_tokens_lost:,} tokens of pool; "
          f"{p.contexts} unshared {p.context_tokens:,}-token contexts hold {p.contexts_kv_bytes / gib:.1f} GiB")
    return 0


def add_goodput_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arrival-rate", type=float, default=None, help="lambda, requests/s (with --stay-s: n = lambda T)")
    p.add_argument("--stay-s", type=float, default=None, help="mean time a request spends in the system")
    p.add_argument("--completed", type=int, default=None, help="requests completed in the window")
    p.add_argument("--correct", type=int, default=None, help="of them, correct (Q_i = 1)")
    p.add_argument("--good", type=int, default=None, help="of those, on time too (Q_i D_i = 1)")
    p.add_argument("--window-s", type=float, default=None, help="T_obs")
    p.add_argument("--gpu-s", type=float, default=None, help="accelerator time in the window")
    p.add_argument("--energy-j", type=float, default=None, help="energy in the window")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_goodput)


def cmd_goodput(args: argparse.Namespace) -> int:
    from trajserve.plan.goodput import goodput, requests_in_system

    out = {}
    if args.arrival_rate is not None or args.stay_s is not None:
        if args.arrival_rate is None or args.stay_s is None:
            raise ValueError("Little's law needs both --arrival-rate and --stay-s")
        out["requests_in_system"] = requests_in_system(args.arrival_rate, args.stay_s)
    counts = (args.completed, args.correct, args.good, args.window_s)
    if any(v is not None for v in counts):
        if any(v is None for v in counts):
            raise ValueError("goodput needs --completed, --correct, --good and --window-s")
        out["goodput"] = goodput(args.completed, args.correct, args.good, args.window_s, args.gpu_s,
                                 args.energy_j).to_dict()
    if not out:
        raise ValueError("give --arrival-rate and --stay-s, or --completed, --correct, --good and --window-s")
    if args.json:
        print(json.dumps(out))
        return 0
    if "requests_in_system" in out:
        print(f"n = lambda T = {args.arrival_rate:g}/s x {args.stay_s:g} s = {out['requests_in_system']:g} requests "
              f"in the system on average")
    if "goodput" in out:
        g = out["goodput"]
        print(f"completed {g['completion_per_s']:.3f} req/s; R_good {g['goodput_per_s']:.3f} req/s (correct and on "
              f"time: {g['good']} of {g['completed']}; {g['correct_but_late']} correct but late)")
        if g["gpu_s_per_good"] is not None or g["joules_per_good"] is not None:
            print("per good result: " + ", ".join(
                f for f in (f"{g['gpu_s_per_good']:.3f} GPU-s" if g["gpu_s_per_good"] is not None else "",
                            f"{g['joules_per_good']:.1f} J" if g["joules_per_good"] is not None else "") if f))
    return 0


def _stages(text: str) -> dict[str, float]:
    try:
        pairs = [x.split("=", 1) for x in text.split(",") if x.strip()]
        return {k.strip(): float(v) for k, v in pairs}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected name=number,..., got {text!r}") from None


def add_task_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stages", type=_stages, required=True, help="the task's stages in seconds, e.g. "
                   "prefill=20,decode=50,tools=30")
    p.add_argument("--speedup", type=_stages, required=True, help="speed-ups of some stages, e.g. decode=4")
    p.add_argument("--setup-s", type=float, default=0.0, help="one-off time the change adds (e.g. drafting setup)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_task)


def cmd_task(args: argparse.Namespace) -> int:
    from trajserve.plan.goodput import setup_break_even_s, task_speedup, task_time

    before = sum(args.stages.values())
    after = task_time(args.stages, args.speedup, args.setup_s)
    out = {"before_s": before, "after_s": after, "speedup": before / after,
           "setup_break_even_s": setup_break_even_s(args.stages, args.speedup)}
    if len(args.speedup) == 1 and not args.setup_s:
        (stage, s_), = args.speedup.items()
        out["amdahl"] = task_speedup(args.stages[stage] / before, s_)  # S_task = 1 / ((1 - f) + f / s)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"task {before:g} s -> {after:g} s: {out['speedup']:.3f}x"
          + (f" (Amdahl: S_task = {out['amdahl']:.3f})" if "amdahl" in out else "")
          + f"; a setup of {out['setup_break_even_s']:g} s or more saves nothing")
    return 0


def _size(text: str) -> int:
    from trajserve.units import parse_bytes

    return parse_bytes(text, "size")


def add_offload_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layer-size", type=_size, required=True, help="bytes of one offloaded copy, e.g. 288MiB")
    p.add_argument("--layers", type=int, required=True, help="copies offloaded")
    p.add_argument("--buffers", type=int, default=1, help="prefetch buffers of --layer-size kept on the device")
    p.add_argument("--state-size", type=_size, required=True, help="one request's KV state, e.g. 1152MiB")
    p.add_argument("--link", type=float, required=True, help="one-way host link, GB/s (PCIe Gen5 x16: 64)")
    p.add_argument("--output-tokens", type=int, default=256, help="G: G - 1 rounds each move the offload again")
    p.add_argument("--copy-budget-s", type=float, default=None, help="total copy time allowed: the link it needs")
    p.add_argument("--round-ms", type=float, default=None,
                   help="a decode round without the offload: the round with it (buffers >= 2 overlap the copy)")
    p.add_argument("--compress", type=float, default=None, metavar="R",
                   help="also: moving --compress-size bytes compressed to R of them (the decompression rate it needs)")
    p.add_argument("--compress-size", type=_size, default=None, help="for --compress (default: --layer-size)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_offload)


def cmd_offload(args: argparse.Namespace) -> int:
    from trajserve.plan.weight_offload import compressed_move, plan_offload

    r = plan_offload(args.layer_size, args.layers, args.buffers, args.state_size, args.link * 1e9,
                     max(args.output_tokens - 1, 0), args.copy_budget_s,
                     args.round_ms / 1e3 if args.round_ms is not None else None)
    size = args.compress_size or args.layer_size
    c = compressed_move(size, args.compress, args.link * 1e9) if args.compress is not None else None
    if args.json:
        print(json.dumps({**r.to_dict(), "compressed": c.to_dict() if c else None}))
        return 0
    mib = 2**20
    print(f"offloaded {r.offloaded_bytes / mib:,.0f} MiB, {r.buffers} prefetch buffer(s): net {r.net_saved_bytes / mib:,.0f} "
          f"MiB freed = {r.extra_states} more request state(s) of {args.state_size / mib:,.0f} MiB")
    print(f"copy per round >= {r.copy_s_per_round * 1e3:.1f} ms at {args.link:g} GB/s; {r.rounds} rounds: "
          f"{r.copy_s_total:.2f} s")
    if r.step_s is not None:
        print(f"a round of {args.round_ms:g} ms becomes {r.step_s * 1e3:.1f} ms with the copy "
              f"({'overlapped' if r.buffers >= 2 else 'in turn'})")
    if r.link_for_budget:
        print(f"all copies in {args.copy_budget_s:g} s need >= {r.link_for_budget / 1e9:,.0f} GB/s one way")
    if c:
        print(f"{size / mib:,.0f} MiB compressed to {args.compress:g}: {c.direct_s * 1e3:.2f} ms direct, "
              f"{c.compressed_link_s * 1e3:.2f} ms compressed; pays only if decompression > "
              f"{c.min_decompress_bytes_per_s / 1e9:.1f} GB/s of raw bytes")
    return 0


def add_reads_parser(p: argparse.ArgumentParser) -> None:
    from trajserve.plan.catalog import model_names

    p.add_argument("--model", required=True, help=" | ".join(model_names()) + ", or a config.json / .gguf")
    p.add_argument("--context", type=int, required=True, help="L: context tokens per request")
    p.add_argument("--batch", type=_ints, default=[1, 16, 64], help="batch sizes b")
    p.add_argument("--weight-dtype", default="bf16", help="s_w: the matrix weights' format")
    p.add_argument("--kv-dtype", default="bf16", help="k: the KV format")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_reads)


def cmd_reads(args: argparse.Namespace) -> int:
    from trajserve.plan.batch_reads import kv_batch, reads_table
    from trajserve.plan.catalog import get_model
    from trajserve.plan.kv_format import m_token, storage_format
    from trajserve.plan.model_shapes import decode_read_params

    cfg = get_model(args.model).config
    s_w = float(storage_format(args.weight_dtype, "weight dtype").bytes_per_value)
    weights, k = decode_read_params(cfg) * s_w, float(m_token(cfg, args.kv_dtype))
    rows = reads_table(weights, s_w, args.context, k, args.batch)
    b_kv = kv_batch(weights, args.context, k)
    if args.json:
        print(json.dumps({"weights": weights, "kv_per_token": k, "context": args.context, "b_kv": b_kv,
                          "rows": [r.to_dict() for r in rows]}))
        return 0
    gib = 2**30
    print(f"D_w {weights / gib:.2f} GiB, L k {args.context * k / gib:.4f} GiB; b_KV = ceil(D_w / Lk) = {b_kv}\n")
    print(f"{'b':>5} {'I_weight':>9} {'D(b,L) GiB':>11} {'d(b,L) GiB':>11} {'weights share':>14}")
    for r in rows:
        print(f"{r.batch:>5} {r.weight_intensity:>9.1f} {r.round_bytes / gib:>11.2f} {r.bytes_per_token / gib:>11.3f} "
              f"{r.weight_share:>13.0%}")
    return 0


def add_request_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--queue-s", type=float, default=0.0)
    p.add_argument("--prefill-s", type=float, required=True, help="prefill, to the first token")
    p.add_argument("--output-tokens", type=int, required=True, help="G")
    p.add_argument("--interval-ms", type=float, required=True, help="the output interval (a decode round)")
    p.add_argument("--stall-s", type=float, default=0.0, help="other work inserted into the intervals")
    p.add_argument("--deadline-s", type=float, default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_request)


def cmd_request(args: argparse.Namespace) -> int:
    from trajserve.plan.batch_config import request_time

    total = request_time(args.queue_s, args.prefill_s, args.output_tokens, args.interval_ms / 1e3, args.stall_s)
    out = {"ttft_s": args.queue_s + args.prefill_s, "total_s": total,
           "meets_deadline": None if args.deadline_s is None else total <= args.deadline_s}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"TTFT {out['ttft_s']:.3f} s; total {args.queue_s:g} + {args.prefill_s:g} + {args.output_tokens - 1} x "
          f"{args.interval_ms / 1e3:g}{f' + {args.stall_s:g}' if args.stall_s else ''} = {total:.2f} s"
          + ("" if args.deadline_s is None else f" ({'within' if out['meets_deadline'] else 'past'} "
                                               f"{args.deadline_s:g} s)"))
    return 0


def cmd_spec(args: argparse.Namespace) -> int:
    from trajserve.plan.speculation import plan_speculation

    accept = args.accept[0] if len(args.accept) == 1 else args.accept
    r = plan_speculation(accept, args.draft_len, args.verify_ms, query_ms=args.query_ms, draft_ms=args.draft_ms,
                         draft_group=args.draft_group, plain_ms=args.plain_ms, setup_ms=args.setup_ms,
                         output_tokens=args.output_tokens)
    if args.json:
        print(json.dumps(r.to_dict()))
        return 0
    print(f"acceptance {r.accept}; verify {r.verify_ms:g} ms, lookup {r.query_ms:g} ms, draft {r.draft_ms:g} ms a "
          f"position in groups of {r.draft_group}; plain decode {r.plain_ms:g} ms a token\n")
    print(f"{'m':>3} {'E[N]':>7} {'T ms':>8} {'ms/token':>9} {'speed-up':>9} {'dN':>7} {'dT ms':>7} "
          f"{'dT/dN':>8}  longer pays (dT/dN < T/N before)")
    for x in r.lengths:
        per = "-" if x.added_ms_per_token is None else f"{x.added_ms_per_token:.2f}"
        pays = "-" if x.pays is None else ("yes" if x.pays else "no")
        print(f"{x.m:>3} {x.expected_output:>7.3f} {x.round_ms:>8.2f} {x.ms_per_token:>9.2f} "
              f"{r.plain_ms / x.ms_per_token:>8.2f}x {x.added_output:>7.3f} {x.added_ms:>7.2f} {per:>8}  {pays}")
    print(f"\nbest draft length {r.best}; its lookup may take up to {r.query_budget_ms:.1f} ms a round and "
          f"still beat plain decoding")
    if r.setup_ms:
        print(f"a {r.setup_ms:g} ms setup is paid back after {r.setup_break_even_tokens:.0f} output tokens")
    if r.output_tokens:
        print(f"{r.output_tokens} output tokens: {r.plain_request_s:.2f} s plain, {r.spec_request_s:.2f} s with "
              f"speculation (setup included)")
    return 0
