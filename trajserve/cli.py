"""`trajserve` command: generate, chat, bench."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from trajserve.sampling import SamplingParams


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="GGUF file or Hugging Face model directory "
                   "(default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    g.add_argument("--chat-template", default=None, metavar="FILE_OR_TEXT",
                   help="a Jinja chat template (a file, or the template itself) in place of the model's, "
                        "e.g. one that renders tools")
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                   help="auto: bfloat16 on CUDA and on CPUs with AVX-512 BF16/AMX, else float32")
    g.add_argument("--kv-cache-memory", default=None,
                   help="KV pool budget, e.g. 2GiB (default: --memory-fraction of free memory)")
    g.add_argument("--memory-fraction", type=float, default=0.25,
                   help="share of the memory free at start-up the KV pool takes, without --kv-cache-memory")
    g.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks (overrides memory)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (the prefix cache shares "
                   "whole blocks)")
    g.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="disable the radix prefix cache")
    g.add_argument("--kv-host-cache", default=None, metavar="BYTES",
                   help="host-memory tier of the prefix cache, e.g. 4GiB: blocks evicted from the KV pool "
                        "wait there and load back on a hit (default: none)")
    g.add_argument("--kv-disk-cache", default=None, metavar="BYTES",
                   help="disk tier below it (blocks the host tier pushes out; CRC-checked on read)")
    g.add_argument("--kv-disk-dir", default=None, help="directory of the disk tier (default: a temporary one)")
    g.add_argument("--max-num-seqs", type=int, default=64, help="sequences running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget per step")
    g.add_argument("--max-prefill-chunk", type=int, default=None,
                   help="per-request chunk cap (default: the token budget, --max-num-batched-tokens)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context limit, prompt + output (default: the model's)")
    g.add_argument("--seed", type=int, default=0, help="the engine's seed for requests that give none")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    g.add_argument("--no-cpu-kernels", dest="cpu_kernels", action="store_false",
                   help="float32 on the CPU: torch ops only, not the C kernels built on first use")


def make_llm(args: argparse.Namespace):
    from trajserve.llm import LLM

    return LLM(args.model, device=args.device, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
               memory_fraction=args.memory_fraction, num_blocks=args.num_blocks, block_size=args.block_size,
               max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
               max_prefill_chunk=args.max_prefill_chunk, max_model_len=args.max_model_len,
               seed=args.seed, num_threads=args.threads, enable_prefix_caching=args.prefix_caching,
               host_cache=args.kv_host_cache, disk_cache=args.kv_disk_cache, disk_cache_dir=args.kv_disk_dir,
               cpu_kernels=args.cpu_kernels, chat_template=args.chat_template)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus: the smallest set of this much mass")
    g.add_argument("--top-k", type=int, default=0, help="the k likeliest tokens only (0: off)")
    g.add_argument("--sampling-seed", type=int, default=None, help="this request's seed (default: from --seed)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages prompt and output tokens")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="[-2, 2], per occurrence in the output")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="[-2, 2], once per token in the output")


def sampling_from(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.sampling_seed, stop=list(args.stop),
                          repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
                          presence_penalty=args.presence_penalty)


def cmd_generate(args: argparse.Namespace) -> int:
    sp = sampling_from(args)  # bad sampling values fail before the model loads
    llm = make_llm(args)
    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.encode(
            llm.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}]),
            add_special_tokens=False)
    out = None
    for out in llm.stream(prompt, sp):
        sys.stdout.write(out.outputs[0].delta_text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if out is not None and args.verbose:
        m = out.metrics
        c = out.outputs[0]
        print(f"[{len(c.token_ids)} tokens, finish={c.finish_reason}, TTFT {m.ttft * 1e3:.0f} ms]", file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    sp = sampling_from(args)
    llm = make_llm(args)
    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("trajserve chat: empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)  # end the prompt's line
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages), add_special_tokens=False)
        reply = ""
        for out in llm.stream(ids, sp):
            sys.stdout.write(out.outputs[0].delta_text)
            sys.stdout.flush()
            reply = out.outputs[0].text
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": reply})
    return 0


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    from trajserve.bench.throughput import run

    return run(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from trajserve.server.serve import serve

    return serve(args)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from trajserve.bench.serve import run

    return run(args)


def cmd_bench_agent(args: argparse.Namespace) -> int:
    defaults = dict(trajectories=(8, 12), turns=(10, 4), preamble_tokens=(1500, 600), tool_min_tokens=(100, 50),
                    tool_max_tokens=(600, 200), reply_tokens=(24, 16))
    for k, (plain, waits) in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, waits if args.tool_waits else plain)
    if args.tool_waits:
        from trajserve.bench.agent_waits import run
    else:
        from trajserve.bench.agent import run
    return run(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trajserve", description="A serving engine for AI agents")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one prompt and print it")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    add_engine_args(g)
    add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat with the model's chat template")
    c.add_argument("--system", default=None, help="system message")
    add_engine_args(c)
    add_sampling_args(c)
    c.set_defaults(func=cmd_chat)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed at start-up)")
    s.add_argument("--allowed-origins", nargs="+", default=["*"], metavar="ORIGIN",
                   help="browser origins allowed to call the API (CORS; default: any, as vLLM)")
    s.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model id clients send (default: the file's stem); more names are aliases, e.g. the "
                        "model names an Anthropic client sends to /v1/messages; a reply names the one its "
                        "request used")
    s.add_argument("--max-waiting", type=int, default=256,
                   help="admission queue limit; a request beyond it gets 429 with Retry-After")
    s.add_argument("--max-body-bytes", type=int, default=8 * 2**20, help="request body cap (413 above it)")
    s.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                   help="/v1 routes want one of these keys (Authorization: Bearer KEY, or x-api-key: KEY); "
                        "default: $TRAJSERVE_API_KEY if set, else no key")
    s.add_argument("--session-ttl", type=float, default=3600.0, metavar="SECONDS",
                   help="close a session (and free its saved KV state) after this long without a turn, pause or "
                        "resume; 0: never (default 3600)")
    s.add_argument("--max-sessions", type=int, default=4096,
                   help="open session records; one more closes the least recently active (0: no limit)")
    s.add_argument("--tool-call-parser", choices=("auto", "hermes", "llama3_json"), default="auto",
                   help="how the model writes tool calls (auto: from the chat template; Hermes <tool_call> "
                        "for Qwen, Llama 3's JSON form)")
    add_engine_args(s)
    s.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    t = bsub.add_parser("throughput", help="decode/prefill throughput, bandwidth floor, step breakdown")
    t.add_argument("--batch-sizes", default="1,4,16,32,64")
    t.add_argument("--context", type=int, default=128, help="prompt tokens per sequence for decode runs")
    t.add_argument("--decode-steps", type=int, default=32)
    t.add_argument("--prefill-tokens", type=int, default=2048)
    t.add_argument("--repeats", type=int, default=3)
    t.add_argument("--json", action="store_true", help="print only JSON")
    add_engine_args(t)
    t.set_defaults(func=cmd_bench_throughput)

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
    a.set_defaults(func=cmd_bench_agent)

    from trajserve.bench.resume import add_parser as add_resume_parser
    add_resume_parser(bsub)
    from trajserve.bench.structured import add_parser as add_structured_parser
    add_structured_parser(bsub)

    v = bsub.add_parser("serve", help="load a running OpenAI-compatible server (like vLLM's bench serve)")
    v.add_argument("--base-url", default="http://127.0.0.1:8000")
    v.add_argument("--model", default=None, help="default: the server's first model")
    v.add_argument("--dataset", choices=["random", "shared-prefix", "agent"], default="random")
    v.add_argument("--num-prompts", type=int, default=64, help="requests (agent: trajectories)")
    v.add_argument("--input-len", type=int, default=256, help="prompt tokens (agent: tool-result words)")
    v.add_argument("--output-len", type=int, default=64)
    v.add_argument("--prefix-len", type=int, default=512, help="shared-prefix / agent preamble length")
    v.add_argument("--turns", type=int, default=4, help="agent: turns per trajectory")
    v.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf = all at once")
    v.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps (1 = Poisson)")
    v.add_argument("--max-concurrency", type=int, default=None)
    v.add_argument("--goodput", nargs="*", default=None, metavar="KEY:MS", help="SLOs, e.g. ttft:2000 tpot:200")
    v.add_argument("--timeout", type=float, default=600)
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--json", action="store_true", help="print only JSON")
    v.set_defaults(func=cmd_bench_serve)

    from trajserve.plan.cli import add_plan_parser  # arithmetic only: imports no torch
    add_plan_parser(sub.add_parser("plan", help="closed-form capacity: how many trajectories fit a node"))
    from trajserve.sim.cli import add_calibrate_parser, add_simulate_parser  # imports no torch
    add_simulate_parser(sub.add_parser("simulate", help="the real scheduler + KV cache on a cost model: latency, hit rate, U_KV"))
    add_calibrate_parser(sub.add_parser("calibrate", help="measure this machine's engine; write a hardware profile for simulate"))
    _show_defaults(p)
    return p


class _DefaultsHelp(argparse.HelpFormatter):
    """--help states each option's default (as ArgumentDefaultsHelpFormatter),
    except where it has none or its help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not _has_default(action) or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


def _has_default(action: argparse.Action) -> bool:
    """An option whose default is worth stating (not a flag, not unset)."""
    d = action.default
    return bool(action.option_strings) and action.nargs != 0 and d is not None and d != [] \
        and d is not argparse.SUPPRESS


def _show_defaults(p: argparse.ArgumentParser) -> None:
    p.formatter_class = _DefaultsHelp
    for action in p._actions:  # noqa: SLF001 - argparse keeps its subcommands only here
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for child in action.choices.values():
                _show_defaults(child)
        elif not action.help and _has_default(action):
            action.help = "default: %(default)s"  # argparse prints nothing for an option without help


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if not getattr(args, "json", False) else logging.WARNING,
                        format="%(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader left (`trajserve plan ... | head`): nothing more to say,
        # and Python's exit-time flush of stdout must not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
