"""What a `simulate` command line builds, apart from parsing it: the
simulated machine, model and pool (setup_from_args), the workload
(sessions_factory), and the defaults both read. `sim/cli.py` parses and
dispatches; `sim/report.py` and `bench/validate.py` run with what this builds,
so none of them imports the other's command line. Loads no torch."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from trajserve.plan.catalog import get_device, get_model
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


def agent_value(args: argparse.Namespace, name: str):
    v = getattr(args, name)
    if v is not None:
        return v
    return (BENCH_AGENT_DEFAULTS if args.validate else AGENT_DEFAULTS)[name]


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
                            max_prefill_chunk=args.max_prefill_chunk,
                            admission_ceiling=args.admission_ceiling, scheduling=args.scheduling,
                            program_half_life_s=args.program_half_life_s)
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
    if getattr(args, "weight_offload", None) and getattr(args, "offload_buffers", 2) < 1:
        raise ValueError(f"--offload-buffers must be >= 1 (offloaded weights need a buffer), got {args.offload_buffers}")
    host, disk = PROFILE_TIER_DEFAULTS if profile is not None else (HOST_TIER_DEFAULT, DISK_TIER_DEFAULT)
    host, disk = args.host_kv_memory or host, args.disk_kv or disk
    block_bytes = model.m_token * args.block_size  # one replica's block, all devices
    tier_blocks = [int(parse_bytes(v, flag) // block_bytes) if v else 0
                   for v, flag in ((args.prefix_host_cache, "--prefix-host-cache"),
                                   (args.prefix_disk_cache, "--prefix-disk-cache"))]
    return SimSetup(hw=hw, model=model, num_blocks=blocks, block_size=args.block_size, scheduler=sched,
                    watermark=args.watermark, prefix_caching=args.enable_prefix_caching, pool_source=why,
                    keep_policy=args.keep_policy, wait_hint=args.wait_hint,
                    host_kv_bytes=parse_bytes(host, "--host-kv-memory"), disk_kv_bytes=parse_bytes(disk, "--disk-kv"),
                    prefix_host_blocks=tier_blocks[0], prefix_disk_blocks=tier_blocks[1],
                    weight_offload_bytes=parse_bytes(args.weight_offload, "--weight-offload")
                    if getattr(args, "weight_offload", None) else 0.0,
                    offload_buffers=getattr(args, "offload_buffers", 2),
                    **spec_options(args))


def spec_options(args: argparse.Namespace) -> dict:
    """SimSetup's speculation fields from --spec-accept / --spec-draft."""
    accept = getattr(args, "spec_accept", None)
    if accept is None:
        return {}
    if not 0.0 <= accept <= 1.0:
        raise ValueError(f"--spec-accept must be in [0, 1], got {accept}")
    draft = getattr(args, "spec_draft", "4")
    adaptive = draft == "auto"
    from trajserve.speculative.proposer import SpecConfig

    m = SpecConfig().max_draft if adaptive else int(draft) if str(draft).isdigit() else -1
    if not 1 <= m <= 64:
        raise ValueError(f"--spec-draft must be a number of tokens in [1, 64] or auto, got {draft!r}")
    return {"spec_accept": accept, "spec_draft": m, "spec_adaptive": adaptive, "seed": getattr(args, "seed", 0) or 0}


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
                                  input_len=args.input_len, output_len=args.output_len, prefix_len=args.prefix_len,
                                  rate=args.rate, burstiness=args.burstiness, seed=args.seed)
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
