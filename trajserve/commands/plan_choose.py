"""`trajserve plan choose`: the configuration a deadline and a memory
budget leave (plan/choose.py): each candidate's memory, time and
accelerator seconds per good result, and the one chosen."""
from __future__ import annotations

import argparse
import json
import math


def _seconds(text: str) -> float:
    from trajserve.units import parse_seconds

    try:
        return parse_seconds(text, "--deadline")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_choose_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=16, help="requests arriving together")
    p.add_argument("--input", type=int, default=8192, help="input tokens of each")
    p.add_argument("--shared-prefix", dest="choose_shared", type=int, default=6144,
                   help="leading input tokens every request shares")
    p.add_argument("--output", type=int, default=256, help="output tokens of each")
    p.add_argument("--deadline", type=_seconds, default=7.0, help="the batch's completion limit, e.g. 7s")
    p.add_argument("--memory", default="12GiB", help="memory left for KV and auxiliary buffers, e.g. 12GiB")
    p.add_argument("--model", dest="choose_model", default="qwen3-8b",
                   help="the catalog model the measurements are of (default: the chapter's Qwen3-8B)")
    p.add_argument("--gpu", dest="choose_gpu", default="rtx-pro-6000",
                   help="the catalog device (default: the chapter's RTX PRO 6000)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_choose)


def cmd_choose(args: argparse.Namespace) -> int:
    from trajserve.plan.catalog import get_device, get_model
    from trajserve.plan.choose import candidates, choose, report
    from trajserve.units import parse_bytes

    memory = parse_bytes(args.memory, "--memory")
    cands = candidates(get_model(args.choose_model), get_device(args.choose_gpu), args.requests, args.input,
                       args.choose_shared, args.output, memory, args.deadline)
    chosen = choose(cands)
    if args.json:
        print(json.dumps(report(cands, chosen)))
        return 0
    print(f"{args.requests} requests x {args.input:,} input ({args.choose_shared:,} shared) + {args.output} output "
          f"tokens, within {args.deadline:g} s and {memory / 2**30:.2f} GiB")
    print(f"{'':2} {'configuration':<48} {'memory':>9} {'time':>8} {'GPU-s / good':>13}")
    for x in cands:
        gpu = f"{x.gpu_s_per_good:.3f}" if math.isfinite(x.gpu_s_per_good) else "none good"
        notes = ", ".join(n for n, bad in (("does not fit", not x.fits), ("late", not x.on_time)) if bad)
        print(f"{x.name:<2} {x.what:<48} {x.memory_bytes / 2**30:>6.2f} GiB {x.time_s:>6.2f} s {gpu:>13}"
              f"{'  (' + notes + ')' if notes else ''}")
    print(f"chosen: {chosen.name} ({chosen.what})" if chosen else
          "chosen: none fits and is on time: relax the deadline, shorten the output, or add memory")
    return 0
