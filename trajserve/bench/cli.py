"""`trajserve bench`'s subcommands: their arguments and dispatch; the work
is in the sibling modules, imported when a command runs."""
from __future__ import annotations

import argparse

from trajserve.bench.kv_emulation import EMULATIONS
from trajserve.config import KV_CACHE_DTYPES, QUANTIZATIONS
from trajserve.engine.options import add_engine_args
from trajserve.sessions.config import SessionConfig


def _throughput(args: argparse.Namespace) -> int:
    from trajserve.bench.throughput import run

    return run(args)


def _quant_agreement(args: argparse.Namespace) -> int:
    from trajserve.bench.quant_agreement import run

    return run(args)


def _kv_agreement(args: argparse.Namespace) -> int:
    from trajserve.bench.kv_agreement import run

    return run(args)


def _serve(args: argparse.Namespace) -> int:
    if args.sweep_rate:
        from trajserve.bench.rate_sweep import run
    else:
        from trajserve.bench.serve import run
    return run(args)


def agent_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fill what `bench agent` left unset: the plain replay's defaults, or --tool-waits'."""
    defaults = dict(trajectories=(8, 12), turns=(10, 4), preamble_tokens=(1500, 600), tool_min_tokens=(100, 50),
                    tool_max_tokens=(600, 200), reply_tokens=(24, 16))
    for k, (plain, waits) in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, waits if args.tool_waits else plain)
    return args


def _agent(args: argparse.Namespace) -> int:
    agent_defaults(args)
    if args.tool_waits and args.api == "messages":
        from trajserve.bench.agent_harness import run
    elif args.tool_waits:
        from trajserve.bench.agent_waits import run
    else:
        from trajserve.bench.agent import run
    return run(args)


def parse_agent_args(flags: list[str]) -> argparse.Namespace:
    """`bench agent FLAGS` as its command line would set them, defaults filled."""
    root = argparse.ArgumentParser(prog="trajserve")
    add_bench_parser(root.add_subparsers(dest="command"))
    return agent_defaults(root.parse_args(["bench", "agent", *flags]))


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    t = bsub.add_parser("throughput", help="decode/prefill throughput, bandwidth floor, step breakdown")
    t.add_argument("--batch-sizes", default="1,4,16,32,64")
    t.add_argument("--context", type=int, default=128, help="prompt tokens per sequence for decode runs")
    t.add_argument("--decode-steps", type=int, default=32)
    t.add_argument("--prefill-tokens", type=int, default=2048)
    t.add_argument("--cached-prefix", type=int, default=0,
                   help="measure the prefill of --prefill-tokens new tokens after this many the prefix cache "
                        "holds (an agent's next turn; default 0: a cold prompt)")
    t.add_argument("--repeats", type=int, default=3)
    t.add_argument("--json", action="store_true", help="print only JSON")
    t.add_argument("--paths", action="store_true",
                   help="every path this machine runs (quantized per kernel build, float32 C, bf16 and float32 "
                        "torch), each in its own process, against what --dtype/--quantization auto pick")
    add_engine_args(t)
    t.set_defaults(func=_throughput)

    qa = bsub.add_parser("quant-agreement", help="quantized weights against the same weights in float32: "
                         "greedy agreement over 16 prompts x 64 tokens and |delta logprob|")
    qa.add_argument("--model", default=None)
    qa.add_argument("--quantization", default="auto", choices=[q for q in QUANTIZATIONS if q != "none"])
    qa.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                    help="the tested side's KV pool (the reference's is float32)")
    qa.add_argument("--num-blocks", type=int, default=None)
    qa.add_argument("--bf16", action="store_true", help="test torch's bfloat16 forward instead (a yardstick)")
    qa.add_argument("--json", action="store_true", help="print only JSON")
    qa.set_defaults(func=_quant_agreement)

    kva = bsub.add_parser("kv-agreement", help="a KV pool format against a float32 pool, all else equal: greedy "
                          "agreement and KL over 16 prompts of 200-3,000 tokens x 64 tokens")
    kva.add_argument("--model", default=None)
    kva.add_argument("--kv-cache-dtype", default="q8_0", choices=[k for k in KV_CACHE_DTYPES if k != "auto"])
    kva.add_argument("--quantization", default="none", choices=QUANTIZATIONS,
                     help="the weights of both sides (default none: float32, so only the pool differs)")
    kva.add_argument("--prompts", type=int, default=16, help="the first N of the 16 prompts (shortest first)")
    kva.add_argument("--num-blocks", type=int, default=None)
    kva.add_argument("--emulate", default=None, choices=EMULATIONS,
                     help="instead of --kv-cache-dtype: a float32 pool whose stored rows take this loss, float32 "
                     "compute (where the disagreement comes from; bench/kv_emulation.py)")
    kva.add_argument("--json", action="store_true", help="print only JSON")
    kva.set_defaults(func=_kv_agreement)

    a = bsub.add_parser("agent", help="multi-turn agent replay: TTFT and prefix hit rate, cached vs uncached")
    a.add_argument("--tool-waits", action="store_true",
                   help="concurrent agents with tool pauses: keep / drop / host / break-even policy side by side")
    a.add_argument("--trajectories", type=int, default=None, help="default 8 (--tool-waits: 12)")
    a.add_argument("--turns", type=int, default=None, help="default 10 (--tool-waits: 4 after the first)")
    a.add_argument("--preamble-tokens", type=int, default=None, help="shared system + tool definitions; "
                   "default 1500 (--tool-waits: 600)")
    a.add_argument("--tool-min-tokens", type=int, default=None, help="default 100 (--tool-waits: 50)")
    a.add_argument("--tool-max-tokens", type=int, default=None, help="default 600 (--tool-waits: 200)")
    a.add_argument("--reply-tokens", type=int, default=None, help="max tokens of each reply; default 24 "
                   "(--tool-waits: 16)")
    a.add_argument("--wait-scale", type=float, default=0.1, help="--tool-waits: multiply the wait mix by this")
    a.add_argument("--pool-fraction", type=float, default=0.5,
                   help="--tool-waits: pool as a fraction of all trajectories' final histories")
    a.add_argument("--host-bytes", type=int, default=2 * 2**30, help="--tool-waits: host tier capacity")
    a.add_argument("--wait-trace", default=None, metavar="DIR",
                   help="--tool-waits: draw waits from the gaps between a Claude Code trace's main-agent calls "
                   "(a directory of trace_*.json; 'claude-code' = the one in shared/data/traces) instead of "
                   "the synthetic mix, times --wait-scale")
    a.add_argument("--wait-cap", type=float, default=300.0,
                   help="--wait-trace: longest trace gap kept, in trace seconds (longer ones are human breaks)")
    a.add_argument("--policies", default="keep,drop,host,policy", help="--tool-waits: policies to compare")
    a.add_argument("--api", choices=("engine", "messages"), default="engine",
                   help="--tool-waits: drive the engine in process (the policies), or agents speaking Anthropic's "
                   "Messages API over HTTP with no trajserve field (--modes: lru, inferred, explicit)")
    a.add_argument("--idle-keep-factor", type=float, default=SessionConfig.idle_keep_factor, metavar="PHI",
                   help="--api messages: the server's keep allowance at an empty pool (serve --idle-keep-factor)")
    a.add_argument("--rounds", type=int, default=2,
                   help="--api messages: runs of every mode, the order reversed every other round")
    a.add_argument("--modes", default="lru,inferred,explicit",
                   help="--api messages: how agents name their conversations (bench/agent_harness.py)")
    a.add_argument("--uncached-trajectories", type=int, default=2,
                   help="trajectories re-run in pairs: each request with the cache, then with it emptied, "
                   "back to back (the TTFT ratio)")
    a.add_argument("--pair-repeats", type=int, default=1,
                   help="runs of each side of a pair; the fastest TTFT of each side counts (interference on a "
                   "shared machine only slows a run down)")
    a.add_argument("--pool-fractions", default="1.0,0.75,0.5,0.35,0.25",
                   help="pool sizes for the hit-rate sweep, as fractions of the working set")
    a.add_argument("--json", action="store_true", help="print only JSON")
    add_engine_args(a)
    a.set_defaults(func=_agent)

    from trajserve.bench.resume import add_parser as add_resume_parser
    add_resume_parser(bsub)
    from trajserve.bench.structured import add_parser as add_structured_parser
    add_structured_parser(bsub)
    from trajserve.bench.spec import add_parser as add_spec_parser
    add_spec_parser(bsub)
    from trajserve.bench.lora import add_parser as add_lora_parser
    add_lora_parser(bsub)
    from trajserve.bench.cluster import add_parser as add_cluster_parser
    add_cluster_parser(bsub)
    from trajserve.bench.random_model import add_parser as add_random_model_parser
    add_random_model_parser(bsub)
    from trajserve.bench.peers import add_parser as add_peers_parser
    add_peers_parser(bsub)
    from trajserve.bench.products import add_parser as add_products_parser
    add_products_parser(bsub)
    from trajserve.bench.latent import add_parser as add_latent_parser
    add_latent_parser(bsub)
    from trajserve.bench.programs import add_parser as add_programs_parser
    add_programs_parser(bsub)
    from trajserve.bench.budget import add_parser as add_budget_parser
    add_budget_parser(bsub)

    v = bsub.add_parser("serve", help="load a running OpenAI-compatible server (like vLLM's bench serve)")
    v.add_argument("--base-url", default="http://127.0.0.1:8000")
    v.add_argument("--model", default=None, help="default: the server's first model")
    v.add_argument("--dataset", choices=["random", "shared-prefix", "agent"], default="random")
    v.add_argument("--num-prompts", type=int, default=64, help="requests (agent: trajectories)")
    v.add_argument("--input-len", type=int, default=256, help="prompt tokens (agent: tool-result words)")
    v.add_argument("--output-len", type=int, default=64)
    v.add_argument("--prefix-len", type=int, default=512, help="shared-prefix / agent preamble length")
    v.add_argument("--turns", type=int, default=4, help="agent: turns per trajectory")
    v.add_argument("--preambles", type=int, default=1, help="agent: kinds of agent, each with its own system prompt")
    v.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf = all at once")
    v.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps (1 = Poisson)")
    v.add_argument("--max-concurrency", type=int, default=None)
    v.add_argument("--goodput", nargs="*", default=None, metavar="KEY:MS", help="SLOs, e.g. ttft:2000 tpot:200")
    v.add_argument("--sweep-rate", default=None, metavar="R1,R2,...",
                   help="run the load at each request rate in turn and report the knee: the rate of highest "
                        "goodput under --goodput, and the requests in the system there (8.6.2)")
    v.add_argument("--timeout", type=float, default=600)
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--json", action="store_true", help="print only JSON")
    v.set_defaults(func=_serve)
