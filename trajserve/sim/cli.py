"""`trajserve simulate` and `trajserve calibrate` (arguments and dispatch;
the work is in the sibling modules). Importing this module loads no torch."""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from trajserve.engine.options import add_engine_args
from trajserve.plan.catalog import device_names, model_names
from trajserve.sim.from_args import (AGENT_DEFAULTS, BENCH_AGENT_DEFAULTS, DISK_TIER_DEFAULT, HOST_TIER_DEFAULT,
                                      WORKLOADS)

def _ints(text: str) -> list[int]:
    try:
        vals = [int(float(t)) for t in text.replace("_", "").split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated block counts, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError("expected block counts >= 1")
    return vals


def add_simulate_parser(p: argparse.ArgumentParser) -> None:
    h = p.add_argument_group("hardware and model (catalog: trajserve/plan/catalog.toml)")
    h.add_argument("--gpu", default="h100", help=" | ".join(device_names()))
    h.add_argument("--model", default=None,
                   help=f"{' | '.join(model_names())}, a config.json / HF directory, or a .gguf file "
                        "(default llama-3-70b, or the profile's model)")
    h.add_argument("--tp", type=int, default=8, help="tensor parallel degree of the one replica simulated")
    h.add_argument("--profile", default=None, metavar="JSON",
                   help="hardware profile from `trajserve calibrate` (replaces --gpu and the efficiencies; "
                        "its measured model is used unless --model is given)")
    h.add_argument("--kv-dtype", default="bf16",
                   help="KV cache dtype (with --profile and no --model: the profiled engine's, e.g. fp32 on a CPU)")
    h.add_argument("--weight-dtype", default=None, help="default: the model's")
    h.add_argument("--mfu", type=float, default=0.45, help="achieved share of peak FLOP/s")
    h.add_argument("--mbu", type=float, default=0.7, help="achieved share of peak memory bandwidth")
    h.add_argument("--overhead-ms", type=float, default=2.0, help="fixed time per step (launches, host work)")
    h.add_argument("--reserve", default="4.5GB", help="activations + runtime per device, for the pool size")
    h.add_argument("--gpu-memory", default=None, help="override the device memory, e.g. 80GiB")
    h.add_argument("--weight-offload", default=None, metavar="BYTES",
                   help="weights kept in host memory and copied in over the host link every step, e.g. 2592MiB "
                        "(8.4.3; the pool is not enlarged: give --num-blocks for the memory it frees)")
    h.add_argument("--offload-buffers", type=int, default=2,
                   help="prefetch buffers: 2 or more overlap the copy with the step, 1 adds it")

    # The engine's own rows (engine/options.py), at a GPU replica's defaults.
    e = add_engine_args(p, only=("num_blocks", "block_size", "watermark", "enable_prefix_caching", "max_num_seqs",
                             "max_num_batched_tokens", "max_prefill_chunk", "admission_ceiling",
                             "scheduling", "program_half_life_s"),
                        defaults={"max_num_seqs": 256, "max_num_batched_tokens": 8192},
                        helps={"num_blocks": "KV pool (default: device memory, eqs. 3-5)"})
    e.add_argument("--spec-accept", type=float, default=None, metavar="A",
                   help="speculative decoding: each draft token accepted with probability A given the ones "
                        "before it (8.5.2), e.g. the acceptance_rate `trajserve bench spec --json` measured "
                        "(default: no speculation)")
    e.add_argument("--spec-draft", default="4", metavar="M",
                   help="--spec-accept: draft tokens per sequence per step, or auto (the engine's marginal "
                        "rule, 8.5.4, up to 8)")

    k = p.add_argument_group("tool pauses (the engine's keep policy, kv-cache-management section 6)")
    k.add_argument("--keep-policy", choices=["policy", "keep", "host", "disk", "drop", "cache"], default="policy",
                   help="where a paused session's KV waits: the policy's choice (break-even wait), forced "
                        "keep / host / disk / drop, or cache (no pause announced: unpinned in the prefix cache)")
    k.add_argument("--wait-hint", choices=["exact", "estimate"], default="exact",
                   help="the policy's expected wait: the true one (the harness announces it) or the "
                        "engine's estimator over observed waits")
    k.add_argument("--host-kv-memory", default=None,
                   help=f"host DRAM tier for one replica (default {HOST_TIER_DEFAULT}, half of a DGX H100's "
                        "2 TB; with --profile the engine's 2GiB)")
    k.add_argument("--prefix-host-cache", default=None, metavar="BYTES",
                   help="host tier of the prefix cache for one replica (hierarchical cache: LRU-evicted blocks "
                        "wait there and load back on a hit; default none)")
    k.add_argument("--prefix-disk-cache", default=None, metavar="BYTES", help="disk tier below it (default none)")
    k.add_argument("--disk-kv", default=None,
                   help=f"disk tier for one replica (default {DISK_TIER_DEFAULT}; with --profile the engine's 8GiB)")

    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=WORKLOADS, default="agent")
    w.add_argument("--trace", default=None, help="trace file (mooncake .jsonl; claude-code .json or a directory); "
                   "default: ../shared/data/traces")
    w.add_argument("--num-requests", type=int, default=None,
                   help="chat: requests (default 1000); traces: replay only the first N")
    w.add_argument("--rate", type=float, default=math.inf,
                   help="arrivals per second (chat requests, agent trajectories, claude-code sessions); inf = all at once")
    w.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps (1 = Poisson)")
    w.add_argument("--max-concurrency", type=int, default=None, help="calls in flight at most (closed-loop clients)")
    w.add_argument("--time-scale", type=float, default=1.0, help="multiply trace times and gaps by this")
    w.add_argument("--replay", choices=["closed", "open"], default="closed",
                   help="claude-code: next call after the previous one ends + recorded gap, or at recorded times")
    w.add_argument("--seed", type=int, default=0)
    for name, default in AGENT_DEFAULTS.items():
        flag = "--" + name.replace("_", "-")
        w.add_argument(flag, type=str if name == "tool_wait" else int, default=None,
                       help=f"agent (default {default}" + (", with --validate "
                       f"{BENCH_AGENT_DEFAULTS[name]})" if BENCH_AGENT_DEFAULTS[name] != default else ")")
                       + (": exp:MEAN | const:S | uniform:A,B | lognormal:MEDIAN,SIGMA | 0" if name == "tool_wait"
                          else ""))
    w.add_argument("--branching", type=int, default=1, help="agent: sequences the branch turn forks into")
    w.add_argument("--branch-turn", type=int, default=2)
    w.add_argument("--input-len", type=int, default=1024, help="chat: prompt tokens")
    w.add_argument("--output-len", type=int, default=256, help="chat: output tokens")
    w.add_argument("--prefix-len", type=int, default=0, help="chat: shared system-prompt tokens")

    c = p.add_argument_group("replicas (the cluster's router on the cost model)")
    c.add_argument("--replicas", type=int, default=1,
                   help="engine replicas, each with its own pool and cache, behind --router")
    c.add_argument("--router", default="all",
                   help="with --replicas > 1: kv, round-robin, least-loaded, char-prefix, a comma list, or all")

    o = p.add_argument_group("output")
    o.add_argument("--cache-blocks", type=_ints, default=None, metavar="N,N,...",
                   help="sweep: prefix hit rate vs KV pool size (blocks), one simulation per size")
    o.add_argument("--slo", nargs="*", default=None, metavar="KEY:MS", help="goodput SLOs: ttft:MS tpot:MS e2e:MS")
    o.add_argument("--plot", default=None, metavar="PNG", help="U_KV over time")
    o.add_argument("--sweep-plot", default=None, metavar="PNG", help="with --cache-blocks: hit rate vs pool size")
    o.add_argument("--json", action="store_true", help="print only JSON")
    o.add_argument("--no-progress", dest="progress", action="store_false")

    v = p.add_argument_group("validation against the real engine")
    v.add_argument("--validate", action="store_true",
                   help="predict `bench agent`'s workload from --profile and compare with a measurement")
    v.add_argument("--measured", default=None, metavar="JSON",
                   help="a `trajserve bench agent --json` result to compare with (default: run its cached "
                        "phase now on the real engine)")
    v.add_argument("--save-measured", default=None, metavar="JSON", help="write the measurement taken now")


def add_calibrate_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="profile.json", help="hardware profile to write (read by simulate --profile)")
    p.add_argument("--quick", action="store_true", help="fewer points (under a minute)")
    p.add_argument("--model", default=None, help="GGUF or HF directory (default: the embedded SmolLM2-135M)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")


def check_args(args: argparse.Namespace) -> None:
    """ValueError naming the option for a value the simulation cannot run
    with (a NaN rate or no sequence slots ran for ever), or one it would
    ignore; before any work, so a bad --plot path does not cost a run."""
    def need(ok: bool, flag: str, want: str, value) -> None:
        if not ok:
            raise ValueError(f"{flag} must be {want}, got {value!r}")

    for name in ("max_num_seqs", "max_num_batched_tokens", "tp", "replicas"):
        v = getattr(args, name)
        need(v >= 1, "--" + name.replace("_", "-"), "an integer >= 1", v)
    if args.max_concurrency is not None:
        need(args.max_concurrency >= 1, "--max-concurrency", "an integer >= 1 (unset: no limit)", args.max_concurrency)
    need(0 <= args.watermark < 1, "--watermark", "in [0, 1)", args.watermark)
    need(args.rate > 0, "--rate", "> 0 arrivals per second (inf: all at once)", args.rate)  # NaN fails too
    for flag, v in (("--burstiness", args.burstiness), ("--time-scale", args.time_scale)):
        need(0 < v < math.inf, flag, "a finite number > 0", v)
    need(0 <= args.overhead_ms < math.inf, "--overhead-ms", "a finite number of ms >= 0", args.overhead_ms)
    need(args.seed >= 0, "--seed", "an integer >= 0", args.seed)
    if not args.validate:
        for flag, v in (("--measured", args.measured), ("--save-measured", args.save_measured)):
            if v is not None:
                raise ValueError(f"{flag} compares with a measurement: it needs --validate")
    elif args.workload != "agent" or args.cache_blocks:
        raise ValueError("--validate predicts `bench agent`'s workload on one pool: it takes neither "
                         "--workload other than agent nor --cache-blocks")
    if args.workload != "agent":  # options the other workloads would run without
        given = [k for k in AGENT_DEFAULTS if getattr(args, k) is not None]
        given += ["branching"] if args.branching != 1 else []
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} shapes the agent workload; --workload "
                             f"{args.workload} does not use it")
    for flag in ("plot", "sweep_plot"):
        path = getattr(args, flag)
        if path is not None and not Path(path).expanduser().resolve().parent.is_dir():
            raise ValueError(f"--{flag.replace('_', '-')} {path!r}: no such directory to write it in")


def run_simulation(args: argparse.Namespace) -> int:
    """`trajserve simulate` without --validate (trajserve/cli.py sends that,
    which measures the engine, to bench/validate.py), args checked."""
    if args.replicas > 1:
        from trajserve.sim.fleet_report import run_fleet

        return run_fleet(args)
    from trajserve.sim.report import run_simulate

    return run_simulate(args)
