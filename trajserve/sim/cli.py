"""`trajserve simulate` and `trajserve calibrate` (arguments and dispatch;
the work is in the sibling modules). Importing this module loads no torch."""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from trajserve.plan.catalog import device_names, get_device, get_model, model_names
from trajserve.units import parse_bytes

WORKLOADS = ("agent", "chat", "mooncake", "claude-code")
# Agent knobs default to a 70B-scale agent fleet; --validate defaults them to `bench agent`'s.
AGENT_DEFAULTS = {"trajectories": 64, "turns": 10, "preamble_tokens": 4096, "task_tokens": 64,
                  "tool_min_tokens": 200, "tool_max_tokens": 2000, "reply_tokens": 200, "tool_wait": "exp:5"}
# Lower tiers for one simulated replica (assumptions, not datasheets: a DGX
# H100 has 2 TB of DRAM and ~30 TB of NVMe); a profiled machine gets the
# engine's own SessionManager defaults.
HOST_TIER_DEFAULT, DISK_TIER_DEFAULT = "1TiB", "8TiB"
PROFILE_TIER_DEFAULTS = ("2GiB", "8GiB")
BENCH_AGENT_DEFAULTS = {"trajectories": 8, "turns": 10, "preamble_tokens": 1500, "task_tokens": 64,
                        "tool_min_tokens": 100, "tool_max_tokens": 600, "reply_tokens": 24, "tool_wait": "0"}


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

    e = p.add_argument_group("engine")
    e.add_argument("--num-blocks", type=int, default=None, help="KV pool (default: device memory, eqs. 3-5)")
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--watermark", type=float, default=0.01)
    e.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false")
    e.add_argument("--max-num-seqs", type=int, default=256)
    e.add_argument("--max-num-batched-tokens", type=int, default=8192, help="token budget per step")
    e.add_argument("--max-prefill-chunk", type=int, default=None, help="default: the token budget")
    e.add_argument("--admission-ceiling", type=float, default=0.88,
                   help="tau_high: admit while active U_KV stays below it (kv-cache-management, eq. 8)")

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
    p.set_defaults(func=cmd_simulate)


def add_calibrate_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="profile.json", help="hardware profile to write (read by simulate --profile)")
    p.add_argument("--quick", action="store_true", help="fewer points (under a minute)")
    p.add_argument("--model", default=None, help="GGUF or HF directory (default: the embedded SmolLM2-135M)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    p.set_defaults(func=cmd_calibrate)


def agent_value(args: argparse.Namespace, name: str):
    v = getattr(args, name)
    if v is not None:
        return v
    return (BENCH_AGENT_DEFAULTS if args.validate else AGENT_DEFAULTS)[name]


def cmd_calibrate(args: argparse.Namespace) -> int:
    from trajserve.sim.calibrate import run

    return run(args)


def check_args(args: argparse.Namespace) -> None:
    """ValueError naming the option for a value the simulation cannot run
    with (a NaN rate or no sequence slots ran for ever), or one it would
    ignore; before any work, so a bad --plot path does not cost a run."""
    def need(ok: bool, flag: str, want: str, value) -> None:
        if not ok:
            raise ValueError(f"{flag} must be {want}, got {value!r}")

    for name in ("max_num_seqs", "max_num_batched_tokens", "tp"):
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


def cmd_simulate(args: argparse.Namespace) -> int:
    check_args(args)
    if args.validate:
        from trajserve.sim.validate import run as run_validate

        return run_validate(args)
    from trajserve.sim.report import run_simulate

    return run_simulate(args)


def setup_from_args(args: argparse.Namespace, profile: dict | None = None):
    """Hardware, model and pool from the catalog or a calibrated profile."""
    from trajserve.config import SchedulerConfig
    from trajserve.sim.build import SimSetup, pool_blocks_from_memory
    from trajserve.sim.hardware import Hardware, ModelCost, load_profile

    if args.block_size < 1:
        raise ValueError(f"--block-size must be >= 1, got {args.block_size}")
    budget = args.max_num_batched_tokens
    if args.max_prefill_chunk is not None and args.max_prefill_chunk < 1:  # 0 is not "the default"
        raise ValueError(f"--max-prefill-chunk must be >= 1 (unset: the token budget), got {args.max_prefill_chunk}")
    sched = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=budget,
                            max_prefill_chunk=budget if args.max_prefill_chunk is None else args.max_prefill_chunk,
                            admission_ceiling=args.admission_ceiling)
    if profile is None and args.profile:
        profile = load_profile(args.profile)
    if profile is not None:
        hw = Hardware.from_profile(profile)
        model = (ModelCost.from_spec(get_model(args.model), 1, args.kv_dtype, args.weight_dtype)
                 if args.model else ModelCost.from_profile(profile))
        if args.num_blocks is not None:
            blocks, why = args.num_blocks, "--num-blocks"
        else:
            mem = profile["device"].get("memory_bytes", 0) * profile.get("engine", {}).get("memory_fraction", 0.25)
            blocks = int(mem // (model.m_token * args.block_size))
            why = f"{mem / 1e9:.1f} GB (the engine's memory fraction of the profiled machine's free memory)"
    else:
        spec, dev = get_model(args.model or "llama-3-70b"), get_device(args.gpu)
        hw = Hardware.from_device(dev, args.mfu, args.mbu, args.overhead_ms / 1e3)
        model = ModelCost.from_spec(spec, args.tp, args.kv_dtype, args.weight_dtype)
        if args.num_blocks is not None:
            blocks, why = args.num_blocks, "--num-blocks"
        else:
            blocks, why = pool_blocks_from_memory(
                spec, dev, args.tp, args.block_size, args.kv_dtype, args.weight_dtype,
                parse_bytes(args.reserve, "--reserve"),
                parse_bytes(args.gpu_memory, "--gpu-memory") if args.gpu_memory else None)
    if blocks < 1:
        raise ValueError(f"the KV pool holds {blocks} blocks; pass --num-blocks")
    host, disk = PROFILE_TIER_DEFAULTS if profile is not None else (HOST_TIER_DEFAULT, DISK_TIER_DEFAULT)
    host, disk = args.host_kv_memory or host, args.disk_kv or disk
    block_bytes = model.m_token * args.block_size  # one replica's block, all devices
    tier_blocks = [int(parse_bytes(v, flag) // block_bytes) if v else 0
                   for v, flag in ((args.prefix_host_cache, "--prefix-host-cache"),
                                   (args.prefix_disk_cache, "--prefix-disk-cache"))]
    return SimSetup(hw=hw, model=model, num_blocks=blocks, block_size=args.block_size, scheduler=sched,
                    watermark=args.watermark, prefix_caching=args.prefix_caching, pool_source=why,
                    keep_policy=args.keep_policy, wait_hint=args.wait_hint,
                    host_kv_bytes=parse_bytes(host, "--host-kv-memory"), disk_kv_bytes=parse_bytes(disk, "--disk-kv"),
                    prefix_host_blocks=tier_blocks[0], prefix_disk_blocks=tier_blocks[1])


def sessions_factory(args: argparse.Namespace):
    """The workload as a function of a TokenSource (a sweep rebuilds it per run)."""
    from trajserve.sim import synthetic, trace_workloads

    trace_dir = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "traces"
    if args.workload == "agent":
        spec = synthetic.AgentSpec(**{k: agent_value(args, k) for k in AGENT_DEFAULTS},
                                   branching=args.branching, branch_turn=args.branch_turn, rate=args.rate,
                                   burstiness=args.burstiness, seed=args.seed)
        spec.validate()
        wait = f", tool wait {spec.tool_wait}" if spec.turns > 1 else ""
        fork = f", turn {spec.branch_turn} forks into {spec.branching}" if spec.branching > 1 else ""
        return (lambda tokens: synthetic.agent_sessions(spec, tokens),
                f"agent: {spec.trajectories} trajectories x {spec.turns} turns at {spec.rate:g}/s, preamble "
                f"{spec.preamble_tokens} + task {spec.task_tokens} tokens, tool results {spec.tool_min_tokens}-"
                f"{spec.tool_max_tokens}, replies {spec.reply_tokens}{wait}{fork}")
    if args.num_requests is not None and args.num_requests < 1:  # 0 is not "the default"
        raise ValueError(f"--num-requests must be >= 1, got {args.num_requests}")
    if args.workload == "chat":
        spec = synthetic.ChatSpec(num_requests=1000 if args.num_requests is None else args.num_requests,
                                  input_len=args.input_len, output_len=args.output_len, prefix_len=args.prefix_len, rate=args.rate,
                                  burstiness=args.burstiness, seed=args.seed)
        return (lambda tokens: synthetic.chat_sessions(spec, tokens),
                f"chat: {spec.num_requests} requests at {spec.rate:g}/s (burstiness {spec.burstiness:g}), "
                f"{spec.input_len} prompt tokens ({spec.prefix_len} shared), {spec.output_len} output")
    if args.workload == "mooncake":
        path = Path(args.trace) if args.trace else trace_dir / "mooncake" / "conversation_trace.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"Mooncake trace {str(path)!r} not found; pass --trace")
        reqs = trace_workloads.read_mooncake(path, args.num_requests)
        return (lambda tokens: trace_workloads.mooncake_sessions(reqs, tokens, args.time_scale),
                f"mooncake {path.name} ({len(reqs):,} requests, time x{args.time_scale:g})")
    path = Path(args.trace) if args.trace else trace_dir / "claude-code"
    files = trace_workloads.claude_code_files(path)
    return (lambda tokens: trace_workloads.claude_code_sessions(
        files, tokens, closed_loop=args.replay == "closed", time_scale=args.time_scale, rate=args.rate,
        burstiness=args.burstiness, seed=args.seed, limit=args.num_requests),
        f"claude-code {path.name} ({len(files)} traces, {args.replay} loop, time x{args.time_scale:g})")


def command_line() -> str:
    return "trajserve " + " ".join(sys.argv[1:])


def dump(obj: dict) -> str:
    return json.dumps(obj, indent=2, default=str)
