"""`trajserve plan`: closed-form capacity for a model on an accelerator node."""
from __future__ import annotations

import argparse

from trajserve.plan.catalog import device_names, get_device, get_model, model_names
from trajserve.plan.kv_format import FORMATS
from trajserve.units import parse_bytes


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(float(t)) for t in text.replace("_", "").split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one token count")
    return values


DEFAULT_CONTEXTS = (8192, 32768, 131072)


def default_dtypes(device, gguf_file: bool = False, head_dim: int = 64) -> tuple[str, str | None]:
    """(KV dtype, weight dtype; None: the model's) when the flags leave them
    out: bf16 KV on accelerators. On this machine's CPU, what the engine runs
    there by default (engine/dtype.py): KV in bf16 where AMX runs the C
    kernels' prefill on a bf16 pool, else in the compute dtype (fp32 KV
    holds half the tokens bf16 would); a GGUF's weights in the file's own
    blocks where the C kernels run them (--quantization auto: the file's
    bytes, which is what the model's weight_bytes measures), other weights
    in the compute dtype."""
    if device.key == "cpu-local":
        import torch

        from trajserve.engine.dtype import resolve_dtype, resolve_kv_dtype, resolve_quantization
        from trajserve.model import cpu_kernels

        dtype = resolve_dtype("auto", torch.device("cpu"))[0]
        engine = "bf16" if dtype == torch.bfloat16 else "fp32"
        kernels = cpu_kernels.load() if dtype == torch.float32 else None
        kv = resolve_kv_dtype("auto", dtype, kernels, head_dim)[0].plan_name
        as_stored = gguf_file and resolve_quantization("auto", dtype, torch.device("cpu"))[0] == "auto"
        return kv, None if as_stored else engine
    return "bf16", None


def add_plan_parser(p: argparse.ArgumentParser) -> None:
    # Without a question: the capacity plan (needs --model and --gpu, checked in cmd_plan
    # so that `plan spec ...` parses without them).
    p.add_argument("--model", default=None,
                   help=f"{' | '.join(model_names())}, a config.json / HF directory, or a .gguf file (required)")
    p.add_argument("--gpu", default=None, help=" | ".join(device_names()) + " (required)")
    p.add_argument("--num-gpus", type=int, default=None, help="devices in all (default tp*pp: one replica)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel degree (divides the heads)")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel degree (divides the layers)")
    p.add_argument("--context", type=_ints, default=None,
                   help="context tokens per trajectory, comma-separated (default 8192,32768,131072, "
                        "leaving out those shorter than --shared-prefix, and those past the model's own "
                        "context where its file gives it, which is then listed)")
    p.add_argument("--output-tokens", type=int, default=0, help="tokens each trajectory generates (K_avg)")
    share = p.add_mutually_exclusive_group()
    share.add_argument("--shared-prefix", type=int, default=0,
                       help="tokens of a prefix every trajectory shares, stored once (S_shared, eq. 7)")
    share.add_argument("--shared-fraction", type=float, default=None,
                       help="share sigma of each context that is common to all trajectories")
    p.add_argument("--headroom", type=float, default=0.1, help="free share of the KV pool kept (default 0.1)")
    p.add_argument("--kv-dtype", default=None,
                   help=f"{' | '.join(FORMATS)} (default bf16; on cpu-local the dtype the engine runs in on "
                        "this CPU: fp32 without AVX-512 BF16 or AMX)")
    p.add_argument("--weight-dtype", default=None,
                   help=f"{' | '.join(FORMATS)} (default: the model's; on cpu-local as --kv-dtype)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--reserve", default="4.5GB", help="activations + runtime per device (default 4.5GB)")
    p.add_argument("--gpu-memory", default=None, help="override the device memory, e.g. 80GB or 80GiB")
    p.add_argument("--params", type=float, default=None, help="override the parameter count, e.g. 70e9")
    p.add_argument("--mfu", type=float, default=0.45, help="prefill FLOP efficiency for recompute times")
    p.add_argument("--hit-prob", type=float, default=0.5, help="p_h for the shared prefix's retention value")
    p.add_argument("--dram-cost-ratio", type=float, default=0.0,
                   help="mu_DRAM/mu_HBM for the break-even wait (0: memory-bound limit)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--plot", default=None, metavar="PNG", help="write concurrency vs context to this file")
    p.set_defaults(func=cmd_plan)
    questions = p.add_subparsers(dest="question", metavar="QUESTION",
                                 help="spec | offload | reads | request | goodput | task | lora | choose: "
                                      "chapter 8's other sizing questions")
    from trajserve.commands.plan_questions import add_questions
    add_questions(questions)


def request_from(args: argparse.Namespace):
    import dataclasses

    from trajserve.plan.planner import PlanRequest

    model = get_model(args.model)
    if args.params is not None:
        if args.params <= 0:
            raise ValueError(f"--params must be > 0, got {args.params}")
        model = dataclasses.replace(model, params=int(args.params), weight_bytes=None)
    contexts = args.context
    limit = model.max_context  # known from a GGUF or a config.json that gives it
    if contexts is None:  # a shared prefix longer than a default context asks about the longer ones
        contexts = tuple(c for c in DEFAULT_CONTEXTS if c >= args.shared_prefix)
        if limit is not None:  # and none past what the model was trained for: its own context instead
            contexts = tuple(c for c in contexts if c < limit) + ((limit,) if limit >= args.shared_prefix else ())
        if not contexts:
            raise ValueError(f"shared prefix ({args.shared_prefix} tokens) is longer than every default context "
                             f"(up to {DEFAULT_CONTEXTS[-1]} tokens); give --context")
    elif limit is not None and max(contexts) > limit:
        raise ValueError(f"--context {max(contexts):,} is over the model's context of {limit:,} tokens "
                         f"(max_position_embeddings); the engine refuses such a max_model_len too")
    device = get_device(args.gpu)
    kv_dtype, weight_dtype = default_dtypes(device, str(args.model).endswith(".gguf"), model.config.head_dim)
    return PlanRequest(
        model=model, device=device, contexts=contexts, num_gpus=args.num_gpus,
        tp=args.tp, pp=args.pp, output_tokens=args.output_tokens, shared_prefix=args.shared_prefix,
        shared_fraction=args.shared_fraction, headroom=args.headroom,
        kv_dtype=args.kv_dtype or kv_dtype, weight_dtype=args.weight_dtype or weight_dtype,
        block_size=args.block_size,
        reserve_bytes=parse_bytes(args.reserve, "--reserve"),
        memory_bytes=parse_bytes(args.gpu_memory, "--gpu-memory") if args.gpu_memory else None,
        mfu=args.mfu, hit_prob=args.hit_prob, dram_cost_ratio=args.dram_cost_ratio)


def cmd_plan(args: argparse.Namespace) -> int:
    from trajserve.plan.planner import plan
    from trajserve.plan.report import to_json, to_text

    missing = [flag for flag, v in (("--model", args.model), ("--gpu", args.gpu)) if v is None]
    if missing:
        raise ValueError(f"plan needs {' and '.join(missing)} (or a question: trajserve plan spec --help)")
    req = request_from(args)
    result = plan(req)
    print(to_json(result) if args.json else to_text(result))
    if args.plot:
        from trajserve.plan.plot import plot

        plot(req, args.plot)
    return 0
